"""``manage.py issue_token USERNAME --namespaces ns1,ns2``: an API token for a tenant."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from usage.tenancy import GrantError, issue_token, parse_namespaces


class Command(BaseCommand):
    help = (
        "Create the user if needed and a new API token that reads exactly the given namespaces "
        "(the user's other tokens are not widened), and print the token alone on the last line "
        "(send it as `Authorization: Token <token>`). Only a digest of the token is stored: it "
        "cannot be shown again; `revoke_token <key>` removes it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--namespaces", default="", help="comma-separated namespaces the user may read, e.g. t1,t2")
        parser.add_argument(
            "--only",
            action="store_true",
            help="narrow the user's other tokens to these namespaces too (revoke their other grants)",
        )
        parser.add_argument(
            "--days",
            type=int,
            default=settings.GPUPLANE_TOKEN_DAYS,
            help=f"days until the token expires, 0 = never (default {settings.GPUPLANE_TOKEN_DAYS})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            namespaces = parse_namespaces(options["namespaces"])
            issued = issue_token(options["username"], namespaces, days=options["days"], replace=options["only"])
        except GrantError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"user {issued.username}: {'created' if issued.created_user else 'existing'}")
        if issued.staff:
            self.stdout.write("  staff: reads every namespace (grants do not limit staff)")
        self.stdout.write(f"  this token may read: {', '.join(issued.namespaces) or '(no namespaces)'}")
        if issued.unknown:
            # Granted all the same (a tenant may be created after its token), but a typo would
            # otherwise go unnoticed until the tenant's first call answers 404.
            self.stderr.write(
                f"warning: no such namespace (yet): {', '.join(issued.unknown)}; this token reads "
                "it only once a namespace of that name exists"
            )
        self.stdout.write(f"  key: {issued.key} (revoke with: manage.py revoke_token {issued.key})")
        self.stdout.write(f"  expires: {issued.expires.isoformat() if issued.expires else 'never'}")
        self.stdout.write("  send it as: Authorization: Token <token>  (token on the next line)")
        self.stdout.write(issued.token)

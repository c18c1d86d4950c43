"""``manage.py revoke_token KEY`` or ``--user USERNAME``: remove API tokens and their grants."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from usage.tenancy import GrantError, revoke_tokens


class Command(BaseCommand):
    help = (
        "Delete one API token (given whole, or by the key issue_token printed and the admin shows) "
        "or every token of a user, with the namespace grants of each. The token stops working at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("token", nargs="?", default="", help="the token, or its key (e.g. gpp_1a2b3c4d)")
        parser.add_argument("--user", default="", help="revoke every token of this user instead")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            revoked = revoke_tokens(token=options["token"], username=options["user"])
        except GrantError as exc:
            raise CommandError(str(exc)) from None
        if not revoked.tokens:
            self.stdout.write(f"user {options['user']} has no tokens: nothing revoked")
        for username, key, namespaces in revoked.tokens:
            self.stdout.write(f"revoked token {key} of {username} (it read: {', '.join(namespaces) or 'nothing'})")

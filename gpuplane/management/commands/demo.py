"""``manage.py demo``: the embedded default, a demo cluster placed and ready to look at."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from binder.mirror.snapshot import SnapshotError, load_file
from binder.models import GpuDevice, PassKind, Phase
from binder.runtime.passes import run_pass
from gpuplane.management.addrport import ensure_free
from usage.tenancy import issue_token

#: The demo's tenant login for the API: a token that reads this namespace only.
DEMO_TENANT, DEMO_TENANT_USER = "team-vision", "vision"
DEMO_FILE = Path(settings.BASE_DIR) / "deploy" / "demo" / "cluster.yaml"


class Command(BaseCommand):
    help = (
        "Migrate, load the demo cluster (replacing the mirror), run passes, create a staff login "
        "and print it; with --serve, serve the admin and API."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--file", type=Path, default=DEMO_FILE, help="cluster snapshot to load")
        parser.add_argument("--username", default="admin", help="staff login to create or reset")
        parser.add_argument("--serve", action="store_true", help="serve on --addrport afterwards")
        parser.add_argument("--addrport", default="127.0.0.1:8000")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["serve"]:
            ensure_free(options["addrport"])  # before the database is touched or a login printed
        call_command("migrate", verbosity=0, interactive=False)
        try:
            report = load_file(options["file"], replace=True)
        except SnapshotError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(report.summary())
        first = run_pass(PassKind.FULL, triggered_by="command")
        second = run_pass(PassKind.FULL, triggered_by="command")
        for run in (first, second):
            self.stdout.write(
                f"full pass {run.pk}: bound {run.bound}, moved {run.moved}, lost {run.lost}, "
                f"refused {run.refused}, restored {run.restored}, {run.devices_written} devices written"
            )
        counts = {phase: GpuDevice.objects.filter(phase=phase).count() for phase in Phase.values}
        self.stdout.write("devices: " + ", ".join(f"{n} {phase}" for phase, n in counts.items()))

        password = secrets.token_urlsafe(12)
        user_model = get_user_model()
        user, _ = user_model.objects.get_or_create(username=options["username"])
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        tenant = issue_token(DEMO_TENANT_USER, [DEMO_TENANT], days=settings.GPUPLANE_TOKEN_DAYS, replace=True)
        host = options["addrport"]
        self.stdout.write(
            self.style.SUCCESS(
                f"\nstaff login: {options['username']} / {password}\n"
                f"admin:        http://{host}/admin/\n"
                f"board:        http://{host}/admin/placement-board/  (Lost sets, budgets, usage chart linked there)\n"
                f"API docs:     http://{host}/api/docs/  (schema: /api/schema/)\n"
                f"tenant token ({DEMO_TENANT_USER}, reads {DEMO_TENANT} only):\n"
                f"  curl -H 'Authorization: Token {tenant.token}' http://{host}/api/v1/tenants/{DEMO_TENANT}/usage\n"
            )
        )
        if options["serve"]:
            call_command("runserver", host, use_reloader=False)

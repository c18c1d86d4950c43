"""``manage.py run_pass [--answer-only] [--repeat N]``: run binder passes now and report them."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from binder.management.migrated import require_migrated
from binder.models import PassKind
from binder.runtime.passes import run_pass


class Command(BaseCommand):
    help = (
        "Run one full pass (or, with --answer-only, one answer pass) in this process; with --repeat N run N "
        "passes in this one process and print one JSON line per pass, so the cold first pass (which reads "
        "everything) and the steady ones (which apply only the change feed) can be compared."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--answer-only", action="store_true", help="only answer unanswered bind requests")
        parser.add_argument("--repeat", type=int, default=None, metavar="N", help="run N passes, one JSON line each")

    def handle(self, *args: Any, **options: Any) -> None:
        require_migrated()
        kind = PassKind.ANSWER if options["answer_only"] else PassKind.FULL
        repeat = options["repeat"]
        if repeat is None:
            run = run_pass(kind, triggered_by="command")
            self.stdout.write(
                f"{run.kind} pass {run.pk}: {run.devices_seen} devices, {run.devices_written} written; "
                f"bound {run.bound}, moved {run.moved}, lost {run.lost}, refused {run.refused}, "
                f"restored {run.restored} in {run.duration_ms:.1f} ms" + (f" ({run.skipped})" if run.skipped else "")
            )
            return
        if repeat < 1:
            self.stderr.write("--repeat must be at least 1")
            raise SystemExit(2)
        for _ in range(repeat):
            run = run_pass(kind, triggered_by="command")
            line = {
                "pass": run.pk,
                "kind": run.kind,
                "view": run.view,
                "duration_ms": round(run.duration_ms or 0.0, 3),
                "devices_seen": run.devices_seen,
                "rows_read": run.rows_read,
                "dirty_sets": run.dirty_sets,
                "devices_written": run.devices_written,
            }
            self.stdout.write(json.dumps(line, sort_keys=True))

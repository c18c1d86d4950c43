"""``manage.py run_pass [--answer-only]``: run one binder pass now and report it."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from binder.models import PassKind
from binder.runtime.passes import run_pass


class Command(BaseCommand):
    help = "Run one full pass (or, with --answer-only, one answer pass) in this process."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--answer-only", action="store_true", help="only answer unanswered bind requests")

    def handle(self, *args: Any, **options: Any) -> None:
        run = run_pass(PassKind.ANSWER if options["answer_only"] else PassKind.FULL)
        self.stdout.write(
            f"{run.kind} pass {run.pk}: {run.devices_seen} devices, {run.devices_written} written; "
            f"bound {run.bound}, moved {run.moved}, lost {run.lost}, refused {run.refused}, "
            f"restored {run.restored} in {run.duration_ms:.1f} ms" + (f" ({run.skipped})" if run.skipped else "")
        )

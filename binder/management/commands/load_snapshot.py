"""``manage.py load_snapshot FILE [--replace]``: load a cluster dump into the mirror."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from binder.management.migrated import require_migrated
from binder.mirror.snapshot import SnapshotError, load_file
from binder.models import PassKind
from binder.queue import passes_held, queue_full_pass
from binder.runtime.passes import run_pass


class Command(BaseCommand):
    help = (
        "Load a Kubernetes List or multi-document YAML (as `kubectl get -o yaml` prints it, "
        "status included) into the mirror. All or nothing: any invalid object rejects the file."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path, help="YAML or JSON file")
        parser.add_argument("--replace", action="store_true", help="clear the mirror before loading")
        parser.add_argument("--no-pass", action="store_true", help="do not queue a full pass after loading")

    def handle(self, *args: Any, **options: Any) -> None:
        require_migrated()
        try:
            # The pass (if any) is this command's, after the load: rows --replace deletes
            # would otherwise each ask for one (signals), --no-pass or not.
            with passes_held():
                report = load_file(options["file"], replace=options["replace"])
        except SnapshotError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(report.summary())
        if options["no_pass"] or not settings.GPUPLANE_AUTO_PASS:
            return
        if settings.CELERY_TASK_ALWAYS_EAGER:
            # Embedded (no broker): a queued pass would run here and now anyway; run it
            # directly and say what it did.
            run = run_pass(PassKind.FULL, triggered_by="command")
            self.stdout.write(
                f"ran full pass {run.pk}: bound {run.bound}, moved {run.moved}, lost {run.lost}, "
                f"refused {run.refused}, {run.devices_written} devices written"
            )
            return
        queue_full_pass(triggered_by="command")
        self.stdout.write("queued a full pass (the binder worker runs it)")

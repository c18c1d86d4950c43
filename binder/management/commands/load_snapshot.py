"""``manage.py load_snapshot FILE [--replace]``: load a cluster dump into the mirror."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from binder.mirror.snapshot import SnapshotError, load_file
from binder.queue import queue_full_pass


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
        try:
            report = load_file(options["file"], replace=options["replace"])
        except SnapshotError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(report.summary())
        if not options["no_pass"] and settings.GPUPLANE_AUTO_PASS:
            queue_full_pass(triggered_by="command")
            self.stdout.write("queued a full pass")

"""``manage.py sync_cluster``: cluster mode's long-running list-and-watch process."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from binder import apiserver, sync
from binder.errors import describe
from binder.mirror.write import Applied


class Command(BaseCommand):
    help = (
        "Mirror the cluster (namespaces, nodes, GPU pods, VMIs, GPUClasses, GPUs, GPUBudgets): list each "
        "kind, then watch from the list's resourceVersion, list again on 410 Gone and every "
        "GPUPLANE_RELIST_SECONDS. Every change queues a full pass. Runs until SIGTERM/SIGINT; "
        "--once lists every kind once and exits."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="list every kind once, mirror it and exit")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar on the first list")

    def handle(self, *args: Any, **options: Any) -> None:
        if not apiserver.cluster_mode():
            raise CommandError("sync_cluster needs GPUPLANE_CLUSTER=kubernetes (standalone mode has no cluster)")
        stop = threading.Event()
        try:
            runners, applied = self.first_list(stop, show=not options["no_progress"])
        except sync.MissingApi as exc:
            raise CommandError(f"cannot list the cluster: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the first list is the command's error
            raise CommandError(f"cannot list the cluster: {describe(exc)}") from None
        for kind, result in applied.items():
            self.stdout.write(
                f"{kind}: {result.upserted} mirrored, {result.deleted} removed, {result.invalid} invalid (skipped)"
            )
        if options["once"]:
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        # Each kind watches from its first list's version: no second list.
        threads = sync.run_forever(
            stop,
            relist_seconds=settings.GPUPLANE_RELIST_SECONDS,
            watch_seconds=settings.GPUPLANE_WATCH_SECONDS,
            runners=runners,
        )
        self.stdout.write(f"watching {len(threads)} kinds; relisting every {settings.GPUPLANE_RELIST_SECONDS} s")
        stop.wait()
        for thread in threads:
            thread.join(timeout=settings.GPUPLANE_WATCH_SECONDS + 15)
        self.stdout.write("stopped")

    def first_list(self, stop: threading.Event, show: bool) -> tuple[dict[str, sync.KindSync], dict[str, Applied]]:
        """The initial list, with a progress bar per kind (a large cluster takes a while)."""
        relist, watch = settings.GPUPLANE_RELIST_SECONDS, settings.GPUPLANE_WATCH_SECONDS
        if not show:
            return sync.list_all(stop, relist_seconds=relist, watch_seconds=watch)
        columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=False) as progress:
            tasks = {kind: progress.add_task(f"listing {kind}", total=None) for kind in sync.SYNC_ORDER}

            def progress_for(kind: str) -> Any:
                progress.update(tasks[kind], description=f"mirroring {kind}")
                return lambda n: progress.advance(tasks[kind], n)

            listed = sync.list_all(stop, relist_seconds=relist, watch_seconds=watch, progress_for=progress_for)
            for kind, task in tasks.items():
                done = progress.tasks[task].completed
                progress.update(task, total=done, completed=done, description=f"{kind}")
            return listed

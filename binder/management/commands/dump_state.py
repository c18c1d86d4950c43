"""``manage.py dump_state --json``: one document of placement, node booking and tenant usage."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from binder.management.migrated import require_migrated
from binder.reports.state import cluster_state


class Command(BaseCommand):
    help = "Print devices, node booking and tenant usage (--json: one stable JSON document)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON (the stable, scriptable shape)")

    def handle(self, *args: Any, **options: Any) -> None:
        require_migrated()
        state = cluster_state()
        if options["json"]:
            self.stdout.write(json.dumps(state, indent=1, sort_keys=False))
            return
        for d in state["devices"]:
            self.stdout.write(
                f"{d['namespace']}/{d['name']:<24} {d['class']:<10} vm={d['vm']:<16} {d['phase']:<8} "
                f"{d['node'] or '-':<16} {d['reason']}"
            )
        for n in state["nodes"]:
            cells = ", ".join(f"{r} {v['booked']}/{v['allocatable']}" for r, v in n["resources"].items())
            self.stdout.write(f"node {n['name']}: {cells or 'no GPU resources'}")
        for t in state["tenants"]:
            self.stdout.write(f"tenant {t['namespace']}: usage {t['usage']} limits {t['limits']}")

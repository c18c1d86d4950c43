"""README's "What the demo shows" and docs/testing.md describe the demo cluster with
numbers; they are read here and compared with the demo itself, loaded and placed as
``make demo`` does, so a change to deploy/demo/cluster.yaml cannot leave them stale."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from binder import models
from binder.mirror.snapshot import load_file
from binder.runtime.passes import run_pass

ROOT = Path(__file__).resolve().parents[2]
DEMO_FILE = ROOT / "deploy" / "demo" / "cluster.yaml"
SHOWS = re.compile(
    r"has (?P<nodes>\d+) GPU nodes \((?P<h100>\d+) HGX H100, (?P<a10>\d+) A10; one\s+cordoned, one NotReady for days\),"
    r" (?P<classes>\d+) GPU classes, (?P<tenants>\d+) tenants with budgets, (?P<devices>\d+) devices in\s+"
    r"(?P<sets>\d+) sets \((?P<smallest>\d+) to (?P<largest>\d+) GPUs\)"
)
BOUND = re.compile(r"^- (?P<bound>\d+) devices are Bound, each set whole on one node;$", re.MULTILINE)
BOARD = re.compile(r"read the board \((?P<nodes>\d+) nodes, a cell per unit")


def said(pattern: re.Pattern[str], page: Path) -> dict[str, int]:
    found = pattern.search(page.read_text())
    assert found, f"{page.name} no longer says {pattern.pattern!r}: update this test with it"
    return {name: int(value) for name, value in found.groupdict().items()}


@pytest.mark.django_db
def test_the_readme_and_testing_doc_count_what_the_demo_has() -> None:
    load_file(DEMO_FILE, replace=True)
    run_pass()  # "After the first pass"
    nodes = list(models.Node.objects.all())
    kinds = Counter("H100" if any("H100" in r for r in n.allocatable) else "A10" for n in nodes)
    sizes = Counter(models.GpuDevice.objects.values_list("namespace__name", "vm_name"))
    demo = {
        "nodes": len(nodes),
        "h100": kinds["H100"],
        "a10": kinds["A10"],
        "classes": models.GpuClass.objects.count(),
        "tenants": models.GpuBudget.objects.values("namespace").distinct().count(),
        "devices": models.GpuDevice.objects.count(),
        "sets": len(sizes),
        "smallest": min(sizes.values()),
        "largest": max(sizes.values()),
    }
    assert said(SHOWS, ROOT / "README.md") == demo
    assert sum(n.unschedulable for n in nodes) == 1  # "one cordoned"
    assert said(BOUND, ROOT / "README.md") == {"bound": models.GpuDevice.objects.filter(phase="Bound").count()}
    assert said(BOARD, ROOT / "docs" / "testing.md") == {"nodes": len(nodes)}

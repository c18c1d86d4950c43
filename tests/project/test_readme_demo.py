"""README's "What the demo shows" and docs/testing.md describe the demo cluster with
numbers; they are read here and compared with the demo itself, loaded and placed as
``make demo`` does, so a change to deploy/demo/cluster.yaml cannot leave them stale."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from binder import models
from binder.mirror.snapshot import load_file
from binder.runtime.passes import run_pass

ROOT = Path(__file__).resolve().parents[2]
DEMO_FILE = ROOT / "deploy" / "demo" / "cluster.yaml"
SHOWS = re.compile(
    r"has (?P<nodes>\d+) GPU nodes \((?P<h100>\d+) HGX H100, (?P<nvl>\d+) H100 NVL, (?P<a10>\d+) A10;\s+one"
    r" cordoned, one NotReady for days\), (?P<classes>\d+) GPU classes, (?P<tenants>\d+) tenants with budgets,"
    r" (?P<devices>\d+) devices in\s+(?P<sets>\d+) sets \((?P<smallest>\d+) to (?P<largest>\d+) GPUs\)"
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
    kinds = Counter(next((k for k in ("NVL", "H100") if any(k in r for r in n.allocatable)), "A10") for n in nodes)
    sizes = Counter(models.GpuDevice.objects.values_list("namespace__name", "vm_name"))
    demo = {
        "nodes": len(nodes),
        "h100": kinds["H100"],
        "nvl": kinds["NVL"],
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


@pytest.mark.django_db
def test_the_demo_lends_idle_a10s_and_a_reclaim_mark_waits_on_a_running_vm(admin_client: Client) -> None:
    """The lending story of the demo, as README tells it: team-sandbox holds a set borrowed
    beyond its limit (its budget's borrowing), and team-research's order within budget, finding
    no A10 free, marks that set for reclaim, which stays Bound because its VM runs; each says
    why, in the devices' reasons, dump_state, the tenant API and the placement board. The
    second pass (``make demo`` runs two) changes nothing."""
    load_file(DEMO_FILE, replace=True)
    run_pass()
    assert run_pass().devices_written == 0
    devices = {d.name: d for d in models.GpuDevice.objects.filter(vm_name__in=["a10-scratch", "render-a10"])}
    lent = [d for d in devices.values() if d.vm_name == "a10-scratch"]
    waiting = [d for d in devices.values() if d.vm_name == "render-a10"]
    # Borrowed idle A10s: Bound beyond the limit, flagged, marked for the waiting order.
    assert {(d.phase, d.node, d.borrowed, d.reclaim_for) for d in lent} == {
        ("Bound", "gpu-a10-04", True, "team-research/render-a10")
    }
    assert all("borrowed: over its limits on a10 by 2 (limit 2, borrowing 2)" in d.reason for d in lent)
    # The entitled order waits, saying for which set and why it is not taken back yet.
    assert {(d.phase, d.node) for d in waiting} == {("Pending", "")}
    assert all(
        d.reason.endswith(
            "waits for reclaim: team-sandbox/a10-scratch on gpu-a10-04, borrowed and marked for it, "
            "waits for its VM to stop"
        )
        for d in waiting
    )
    # Its VM runs: a Running pod that the VMI's activePods names (the shared launcher rule).
    vmi = models.VirtualMachineInstance.objects.get(namespace__name="team-sandbox", name="a10-scratch")
    pods = models.Pod.objects.filter(namespace__name="team-sandbox", uid__in=list(vmi.active_pods))
    assert [p.phase for p in pods] == ["Running"]
    # Nothing else of the demo borrows or is marked, and every A10 is taken.
    assert models.GpuDevice.objects.filter(borrowed=True).count() == 2
    assert models.GpuDevice.objects.exclude(reclaim_for="").count() == 2
    out = io.StringIO()
    call_command("dump_state", "--json", stdout=out)
    state = json.loads(out.getvalue())
    sandbox = next(t for t in state["tenants"] if t["namespace"] == "team-sandbox")
    assert sandbox["limits"]["a10"] == 2 and sandbox["usage"]["a10"] == 4
    assert sandbox["borrowing"]["a10"] == 2 and sandbox["borrowed"]["a10"] == 2
    assert all(n["resources"]["nvidia.com/GA102GL_A10"]["free"] == 0 for n in state["nodes"] if "a10" in n["name"])
    # The tenant API shows the flag, the mark and the reasons.
    one = admin_client.get("/api/v1/devices/team-sandbox/a10-scratch-gpu0").json()
    assert (one["borrowed"], one["reclaimFor"]) == (True, "team-research/render-a10")
    order = admin_client.get("/api/v1/devices/team-research/render-a10-gpu0").json()
    assert (order["phase"], order["borrowed"], order["reclaimFor"]) == ("Pending", False, "")
    assert "waits for reclaim: team-sandbox/a10-scratch" in order["reason"]
    # The staff console: the board's legend and cells, and the pending set's explanation.
    html = admin_client.get(reverse("admin:placement-board")).content.decode()
    assert "borrowed: 2 units lent beyond budgets" in html
    assert "1 set marked for reclaim (dashed): each waits for its VM to stop" in html
    assert "marked for reclaim by team-research/render-a10: waits for its VM to stop" in html
    assert "waits for reclaim: team-sandbox/a10-scratch on gpu-a10-04" in html


@pytest.mark.django_db
def test_the_demo_places_an_eight_gpu_order_by_moving_two_stopped_vms_sets(admin_client: Client) -> None:
    """README's making-room story: vlm-pretrain (8 H100 NVLs) finds no node with 8 free; the
    first pass moves the stopped docking-a and docking-b off nvl-h100-01 onto nvl-h100-02 (the
    running vlm-serve there stays) and binds the order on nvl-h100-01; the second changes nothing."""
    load_file(DEMO_FILE, replace=True)
    first = run_pass()
    assert run_pass().devices_written == 0
    assert (first.made_room, first.room_refused) == (2, 0)

    def where(vm: str) -> set[tuple[str, str]]:
        return set(models.GpuDevice.objects.filter(vm_name=vm).values_list("phase", "node"))

    assert where("docking-a") == where("docking-b") == where("vlm-serve") == {("Bound", "nvl-h100-02")}
    assert where("vlm-pretrain") == {("Bound", "nvl-h100-01")}
    moves = models.Decision.objects.filter(vm_name__in=["docking-a", "docking-b"])
    assert {(d.from_node, d.to_node, d.reason_code) for d in moves} == {("nvl-h100-01", "nvl-h100-02", "MadeRoom")}
    assert all("made room there for team-vision/vlm-pretrain" in d.reason for d in moves)
    order = models.GpuDevice.objects.filter(vm_name="vlm-pretrain").first()
    assert order is not None and "room made by moving team-research/docking-b (to nvl-h100-02), " in order.reason
    # The board shows the order on the freed node and the moved sets beside the running VM.
    html = admin_client.get(reverse("admin:placement-board")).content.decode()
    assert "team-vision/vlm-pretrain" in html and "team-research/docking-a" in html

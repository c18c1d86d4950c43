"""Making room through the product: VirtualMachines mirrored (parser, loader, feed), the
keep-node annotation, the database pass (kept state and from scratch), its decisions and
counts, the clock rule of a pass that skips the engine, the settings, and what a move that
does not land holds back."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from binder import models
from binder.engine import types as e
from binder.kube.objects import ObjectError, parse_object
from binder.mirror.convert import from_parsed
from binder.mirror.snapshot import SnapshotError, load_objects
from binder.runtime import admissions
from binder.runtime.mirror_state import Catchup
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness.clock import Clock
from harness.shapes import (
    A10,
    NOW,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    real,
    vmi_obj,
)

ROOT = Path(__file__).resolve().parents[2]


def virtual_machine(namespace: str, name: str, **template: Any) -> dict[str, Any]:
    """The captured fedora06 VM (stopped) renamed, its template's scheduling replaced by ``template``."""
    vm = real("virtualmachine.yaml")
    vm["metadata"].update(namespace=namespace, name=name, uid=f"uid-{name}")
    spec = vm["spec"]["template"]["spec"]
    for field in ("nodeSelector", "affinity", "tolerations"):
        spec.pop(field, None)
    spec.update(template)
    return vm


def held(ns: str, vm: str, n: int, node: str, since: str = "2026-11-29T10:00:00Z") -> list[dict[str, Any]]:
    return [gpu_obj(ns, f"{vm}-gpu{i}", "a10", vm, phase="Bound", node=node, since=since) for i in range(n)]


def fragmented() -> list[dict[str, Any]]:
    """Two nodes of 8 A10s: n1 holds two stopped 2-GPU VMs, n2 a running 4-GPU VM; t2 orders 8."""
    running = vmi_obj("t3", "c", [f"c-gpu{i}" for i in range(4)], {}, "n2")
    running["metadata"]["uid"] = "vmi-c"
    pod = launcher_obj(running, A10, 4, "n2", uid="pod-c", name="virt-launcher-c")
    running["status"]["activePods"] = {"pod-c": "n2"}
    return [
        *(namespace_obj(ns) for ns in ("t1", "t2", "t3")),
        class_obj("a10", A10),
        node_obj("n1", {A10: 8}),
        node_obj("n2", {A10: 8}),
        *held("t1", "a", 2, "n1", since="2026-11-28T10:00:00Z"),
        *held("t1", "b", 2, "n1"),
        *held("t3", "c", 4, "n2"),
        running,
        pod,
        virtual_machine("t1", "a"),
        virtual_machine("t1", "b"),
        virtual_machine("t3", "c"),
        *(gpu_obj("t2", f"big-gpu{i}", "a10", "big") for i in range(8)),
    ]


def where(vm: str) -> set[tuple[str, str]]:
    return set(models.GpuDevice.objects.filter(vm_name=vm).values_list("phase", "node"))


# -- the VirtualMachine kind ---------------------------------------------------------------


def test_a_virtual_machine_is_read_for_where_its_template_lets_it_start() -> None:
    parsed = parse_object(real("virtualmachine.yaml"))
    assert parsed is not None and (parsed.kind, parsed.namespace, parsed.name) == (
        "VirtualMachine",
        "default",
        "fedora06",
    )
    vm = from_parsed(parsed)
    assert vm == e.VirtualMachine(
        "default",
        "fedora06",
        {"kubernetes.io/arch": "amd64"},
        (e.Term((e.Requirement("nvidia.com/gpu.product", "In", ("NVIDIA-A10",)),)),),
        (e.Toleration("nvidia.com/gpu", "Exists", "", "NoSchedule"),),
    )
    bare = from_parsed(parse_object(virtual_machine("t1", "vm")))  # type: ignore[arg-type]
    assert (bare.node_selector, bare.affinity, bare.tolerations) == ({}, None, ())


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"nodeSelector": {"zone": 1}}, "spec.template.spec.nodeSelector[zone]"),
        ({"tolerations": [{"key": "k", "operator": "Sometimes"}]}, "spec.template.spec.tolerations[0].operator"),
        (
            {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "Near", "values": ["a"]}]}]}}}},
            "nodeSelectorTerms[0].matchExpressions[0].operator",
        ),
        (
            {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": "n1"}]}]}}}},
            "nodeSelectorTerms[0].matchFields[0].values",
        ),
        (
            {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": {"key": "zone"}}]}}}},
            "nodeSelectorTerms[0].matchExpressions",
        ),
    ],
)  # fmt: skip
def test_a_virtual_machine_that_does_not_parse_is_refused_naming_the_field(template: Any, field: str) -> None:
    with pytest.raises(ObjectError, match="VirtualMachine t1/vm") as caught:
        parse_object(virtual_machine("t1", "vm", **template))
    assert field in caught.value.field


def test_the_keep_node_annotation_is_read_as_true_in_any_case_and_anything_else_as_false() -> None:
    def keep(value: str | None) -> bool:
        obj = gpu_obj("t1", "g0", "a10", "vm")
        if value is not None:
            obj["metadata"]["annotations"]["gpuplane.io/keep-node"] = value
        device = from_parsed(parse_object(obj))  # type: ignore[arg-type]
        return bool(device.keep_node)

    assert keep("true") and keep("True") and keep(" TRUE ")
    assert not keep(None) and not keep("false") and not keep("") and not keep("yes")


@pytest.mark.django_db
def test_the_loader_mirrors_virtual_machines_into_the_change_feed_and_refuses_a_bad_one() -> None:
    report = load_objects([namespace_obj("t1"), virtual_machine("t1", "vm1", nodeSelector={"zone": "a"})])
    assert report.loaded["VirtualMachine"] == 1
    row = models.VirtualMachine.objects.get()
    assert (row.namespace.name, row.name, row.node_selector, row.affinity) == ("t1", "vm1", {"zone": "a"}, None)
    assert models.Change.objects.filter(kind="VirtualMachine", name="vm1").exists()
    state = ClusterState()
    state.rebuild("test")
    assert [vm.key for vm in state.cluster(NOW, e.Settings()).virtual_machines] == [("t1", "vm1")]
    with pytest.raises(SnapshotError, match="tolerations"):
        load_objects([virtual_machine("t1", "vm2", tolerations=[{"operator": "Equal"}])])


# -- the database pass -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("fresh", [False, True], ids=["kept-state", "from-scratch"])
def test_two_stopped_vms_sets_move_and_the_eight_gpu_order_is_placed_in_one_pass(fresh: bool, settings: Any) -> None:
    state = ClusterState()
    load_objects(fragmented())
    run = run_pass(models.PassKind.FULL, ClusterState() if fresh else state)
    assert where("a") == where("b") == {("Bound", "n2")}
    assert where("big") == {("Bound", "n1")} and where("c") == {("Bound", "n2")}
    assert (run.made_room, run.moved, run.room_refused) == (2, 2, 0)
    moves = models.Decision.objects.filter(vm_name__in=["a", "b"])
    assert moves.count() == 4 and set(moves.values_list("reason_code", flat=True)) == {"MadeRoom"}
    assert all("made room there for t2/big" in d.reason for d in moves)
    big = models.GpuDevice.objects.filter(vm_name="big").first()
    assert big is not None and "room made by moving t1/b (to n2), t1/a (to n2) off n1" in big.reason
    if not fresh:
        scratch = ClusterState()
        scratch.rebuild("test")
        assert compare_records(state, scratch) == []
        assert state.scope(Catchup(view="incremental")) == scratch.scope(Catchup(view="incremental"))
        settings.GPUPLANE_VERIFY_SECONDS = 0
        again = run_pass(models.PassKind.FULL, state)
        assert again.verify_mismatches == 0 and again.made_room == 0


@pytest.mark.django_db
def test_a_pass_with_nothing_changed_still_runs_once_an_admission_grace_ends(clock: Clock, settings: Any) -> None:
    """A set admitted 30 s ago stays; a pass with nothing changed skips the engine until the
    grace ends, and the first pass after it moves the set."""
    objects = fragmented()
    for obj in objects:
        if obj["kind"] == "GPU" and obj["metadata"]["name"] == "a-gpu0":
            stamp = (clock.now - timedelta(seconds=30)).isoformat().replace("+00:00", "Z")
            obj["metadata"]["annotations"]["gpuplane.io/admitted"] = stamp
    load_objects(objects)
    state = ClusterState()
    first = run_pass(models.PassKind.FULL, state)  # writes the order's reason
    assert first.made_room == 0 and where("big") == {("Pending", "")}
    clock.advance(seconds=10)
    assert run_pass(models.PassKind.FULL, state).devices_written == 0  # decides nothing
    clock.advance(seconds=20)
    quiet = run_pass(models.PassKind.FULL, state)
    assert quiet.view == "unchanged" and where("a") == {("Bound", "n1")}
    clock.advance(seconds=61)  # 121 s since the admission: past GPUPLANE_MOVE_GRACE_SECONDS (120)
    moved = run_pass(models.PassKind.FULL, state)
    assert moved.view != "unchanged" and moved.made_room == 2 and where("big") == {("Bound", "n1")}


@pytest.mark.django_db
def test_the_per_pass_limit_and_keep_node_come_from_settings_and_annotations(settings: Any) -> None:
    settings.GPUPLANE_MOVES_PER_PASS = 1
    load_objects(fragmented())
    run = run_pass(models.PassKind.FULL, ClusterState())
    assert (run.made_room, run.room_refused) == (0, 1) and where("big") == {("Pending", "")}
    assert "GPUPLANE_MOVES_PER_PASS=1" in models.GpuDevice.objects.filter(vm_name="big").first().reason  # type: ignore[union-attr]
    settings.GPUPLANE_MOVES_PER_PASS = 16
    models.GpuDevice.objects.filter(vm_name="a").update(keep_node=True)
    assert run_pass(models.PassKind.FULL, ClusterState()).made_room == 0
    models.GpuDevice.objects.filter(vm_name="a").update(keep_node=False)
    assert run_pass(models.PassKind.FULL, ClusterState()).made_room == 2


@pytest.mark.django_db
def test_a_move_that_does_not_land_holds_back_the_later_moves_and_the_waiting_set(monkeypatch: Any) -> None:
    """Standalone: the webhook admitted a VMI to t1/b (the first set taken) after the pass's
    catch-up: b stays, a (taken after it) stays, and t2/big waits for the next pass."""
    load_objects(fragmented())
    state = ClusterState()
    real_hold = admissions.hold_first_members

    def admitted_meanwhile(result: e.PassResult, st: ClusterState) -> tuple[e.PassResult, int]:
        models.GpuDevice.objects.filter(name="b-gpu0").update(admitted=timezone.now())
        return real_hold(result, st)

    monkeypatch.setattr(admissions, "hold_first_members", admitted_meanwhile)
    run = run_pass(models.PassKind.FULL, state)
    assert run.writes_failed == 12  # b's 2, a's 2 and big's 8 devices
    assert where("a") == where("b") == {("Bound", "n1")} and where("big") == {("Pending", "")}
    monkeypatch.setattr(admissions, "hold_first_members", real_hold)
    # The next pass sees b admitted just now: it stays; a alone cannot free n1 (4 + 2 < 8).
    run_pass(models.PassKind.FULL, state)
    assert where("b") == {("Bound", "n1")} and where("big") == {("Pending", "")}


@pytest.mark.django_db
def test_a_set_placed_where_a_move_that_did_not_land_frees_room_waits(monkeypatch: Any) -> None:
    """A raw pod over-books n1 (6 units beside the 4 of t1/s, stopped), so the pass moves s to n2
    and places t2/p (2 GPUs) into the room that frees on n1. The webhook admitted a VMI to s
    after the pass's catch-up: s stays on n1, so p must not be written there (n1 would hold 12 of
    8 units); it waits for the next pass, which places it where there is room."""
    load_objects([
        *(namespace_obj(ns) for ns in ("t1", "t2", "t3")),
        class_obj("a10", A10),
        node_obj("n1", {A10: 8}),
        node_obj("n2", {A10: 8}),
        *held("t1", "s", 4, "n1"),
        virtual_machine("t1", "s"),
        *held("t3", "c", 2, "n2"),
        plain_pod_obj("t3", "trainer", A10, 6, "n1"),
        *(gpu_obj("t2", f"p-gpu{i}", "a10", "p") for i in range(2)),
    ])  # fmt: skip
    state = ClusterState()
    planned: dict[str, tuple[str, str]] = {}
    real_hold = admissions.hold_first_members

    def admitted_meanwhile(result: e.PassResult, st: ClusterState) -> tuple[e.PassResult, int]:
        planned.update({d.name: (d.phase.value, d.node) for d in result.devices})
        models.GpuDevice.objects.filter(name="s-gpu0").update(admitted=timezone.now())
        return real_hold(result, st)

    monkeypatch.setattr(admissions, "hold_first_members", admitted_meanwhile)
    run_pass(models.PassKind.FULL, state)
    assert planned["s-gpu0"] == ("Bound", "n2") and planned["p-gpu0"] == ("Bound", "n1")  # what the pass decided
    assert where("s") == {("Bound", "n1")} and where("p") == {("Pending", "")}
    monkeypatch.setattr(admissions, "hold_first_members", real_hold)
    # The next pass decides from s where it is (admitted just now: it stays) and places p elsewhere.
    run_pass(models.PassKind.FULL, state)
    assert where("s") == {("Bound", "n1")} and where("p") == {("Bound", "n2")}


def test_held_back_names_the_waiting_set_and_the_sets_taken_after_a_stale_one() -> None:
    result = e.PassResult(
        devices=(), changes=(), counts={}, room_plans={("t2", "big"): (("t1", "x"), ("t1", "y"), ("t1", "z"))}
    )
    assert admissions.held_back_by(result, {("t1", "y")}, later=True) == {("t2", "big"), ("t1", "z")}
    assert admissions.held_back_by(result, {("t1", "y")}, later=False) == {("t2", "big")}
    assert admissions.held_back_by(result, {("t9", "other")}, later=True) == set()


class RefusingWrites:
    """``binder.runtime.cluster._Writes`` as the API answers it: every status write lands except
    those of the sets named (a 409: the webhook's admitted write came first); the calls in order."""

    def __init__(self, refused: set[tuple[str, str]]) -> None:
        self.refused, self.calls = refused, list[list[str]]()

    def patch_many(self, kind: str, writes: Any) -> list[e.Device]:
        self.calls.append([w[0].name for w in writes])
        return [w[0] for w in writes if w[0].set_key not in self.refused]


def test_cluster_mode_writes_a_plans_moves_in_order_and_stops_at_the_first_that_does_not_land() -> None:
    """SPEC §4 "Making room": a taken set whose write conflicts stays, and so do the sets taken
    after it; the sets taken before it stay where they went. Sets outside any plan go at once."""
    from binder.runtime import cluster as cluster_writes
    from harness.shapes import gpu

    plan = (("t1", "x"), ("t1", "y"), ("t1", "z"))
    result = e.PassResult(devices=(), changes=(), counts={}, room_plans={("t2", "big"): plan})
    leads = [
        (gpu(ns, f"{vm}-gpu0", "a10", vm, phase="Bound", node="n2"), ns, f"{vm}-gpu0", {}, "1")
        for ns, vm in (*plan, ("t3", "other"))
    ]
    writes = RefusingWrites({("t1", "y")})
    stale: set[tuple[str, str]] = set()
    moving = {w[0].set_key for w in leads}
    landed = cluster_writes._write_first_members(writes, leads, result, moving, stale)  # type: ignore[arg-type]
    assert landed == {("t1", "x"), ("t3", "other")}
    assert stale == {("t1", "y"), ("t1", "z")}
    assert writes.calls == [["other-gpu0"], ["x-gpu0"], ["y-gpu0"]]  # z is never written
    # A taken set already known stale (its row changed) is not written at all; nor what follows.
    writes, stale = RefusingWrites(set()), {("t1", "x")}
    landed = cluster_writes._write_first_members(writes, leads, result, moving, stale)  # type: ignore[arg-type]
    assert landed == {("t3", "other")} and stale == set(plan)
    assert writes.calls == [["other-gpu0"]]


# -- the settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["GPUPLANE_MOVES_PER_PASS", "GPUPLANE_MOVE_GRACE_SECONDS"])
def test_a_making_room_setting_that_does_not_parse_stops_start_up_naming_it(name: str) -> None:
    env = {**os.environ, name: "soon", "DJANGO_SETTINGS_MODULE": "gpuplane.settings"}
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and name in done.stderr and "soon" in done.stderr


# -- metrics -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_metrics_count_the_moves_and_the_plans_the_limit_refused(client: Any, settings: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scraped() -> dict[str, float]:
        text = client.get("/metrics").content.decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    assert (scraped()["gpuplane_room_moves_total"], scraped()["gpuplane_room_plans_refused_total"]) == (0, 0)
    load_objects(fragmented())
    settings.GPUPLANE_MOVES_PER_PASS = 1
    run_pass(models.PassKind.FULL, ClusterState())
    run_pass(models.PassKind.FULL, ClusterState())
    settings.GPUPLANE_MOVES_PER_PASS = 16
    run_pass(models.PassKind.FULL, ClusterState())
    samples = scraped()
    assert (samples["gpuplane_room_moves_total"], samples["gpuplane_room_plans_refused_total"]) == (2, 2)

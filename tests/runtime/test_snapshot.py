"""Loading cluster snapshots (``load_snapshot``): what lands in the mirror, and what is refused.

Objects are the real captures in tests/fixtures/kubernetes, or built from them by
harness/shapes.py, written to YAML and loaded through the real loader. A snapshot is all or
nothing: any invalid object rejects the whole file, naming the object and the field.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from binder import models
from binder.mirror.snapshot import SnapshotError, load_file, load_objects
from binder.runtime.passes import run_pass
from harness.shapes import (
    A10,
    FIXTURES,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    real,
    vmi_obj,
    write_snapshot,
)

pytestmark = pytest.mark.django_db

REAL_FILES = (
    "node-with-gpus.yaml",
    "vmi-with-gpus.yaml",
    "virt-launcher-pod.yaml",
    "virt-launcher-pod-migration-target.yaml",
)
MIRROR = (
    models.Namespace,
    models.Node,
    models.GpuClass,
    models.GpuDevice,
    models.GpuBudget,
    models.VirtualMachineInstance,
    models.Pod,
)


def counts() -> dict[str, int]:
    return {model.__name__: model.objects.count() for model in MIRROR}


def rows() -> dict[str, list[dict[str, Any]]]:
    """Every mirrored row by natural key (no database ids), to compare two loads."""
    result: dict[str, list[dict[str, Any]]] = {}
    for model in MIRROR:
        namespaced = model is not models.Namespace and hasattr(model, "NAMESPACE_LOOKUP")
        order = ("namespace__name", "name") if namespaced else ("name",)
        values = []
        for row in model.objects.order_by(*order).values():
            row.pop("id")
            if namespaced:
                row["namespace_id"] = models.Namespace.objects.get(pk=row["namespace_id"]).name
            values.append(row)
        result[model.__name__] = values
    return result


def small_cluster() -> list[dict[str, Any]]:
    """Two nodes, a class, a budget, a running VM with its launcher and a raw pod."""
    vmi = vmi_obj("t1", "vm1", ["g0", "g1"], {"11111111-2222-4333-8444-555555555555": "n1"}, "n1")
    return [
        namespace_obj("t1"),
        node_obj("n1", {A10: 4}),
        node_obj("n2", {A10: 2}, unschedulable=True),
        class_obj("a10", A10),
        gpu_obj("t1", "g0", "a10", "vm1"),
        gpu_obj("t1", "g1", "a10", "vm1"),
        budget_obj("t1", {"a10": 4, A10: 6}),
        vmi,
        launcher_obj(vmi, A10, 2, "n1", uid="11111111-2222-4333-8444-555555555555", name="virt-launcher-vm1-abcde"),
        plain_pod_obj("t1", "trainer-0", A10, 1, "n1"),
    ]


# -- the real captures ----------------------------------------------------------------


def test_real_nodes_keep_only_gpu_resources_as_integers() -> None:
    report = load_file(FIXTURES / "node-with-gpus.yaml")
    assert report.loaded["Node"] == 2

    a10 = models.Node.objects.get(name="gpu-a10-01")
    assert a10.allocatable["nvidia.com/GA102GL_A10"] == 2
    # cpu, memory, pods, hugepages and KubeVirt's own "1k" devices are not GPU resources
    assert not any(key.startswith("devices.kubevirt.io/") for key in a10.allocatable)
    assert set(a10.allocatable) <= {"nvidia.com/GA102GL_A10", "nvidia.com/gpu"}
    assert a10.allocatable.get("nvidia.com/gpu", 0) == 0  # the stale plugin resource stays at 0
    assert all(type(units) is int for units in a10.allocatable.values())
    assert a10.unschedulable is False
    assert a10.ready is True
    assert a10.ready_since == datetime(2026, 5, 4, 11, 21, 40, tzinfo=UTC)  # the Ready condition, not another
    assert a10.uid == "9a4c1e2f-3b5d-4e6f-8a7b-1c2d3e4f5a6b"
    assert a10.labels["nvidia.com/gpu.workload.config"] == "vm-passthrough"
    assert a10.created == datetime(2026, 5, 4, 11, 20, 31, tzinfo=UTC)

    hgx = models.Node.objects.get(name="hgx-h100-07")
    assert hgx.allocatable == {H100: 7, "nvidia.com/GH100_H100_NVSWITCH": 4}  # allocatable, not capacity (8)
    assert all(type(units) is int for units in hgx.allocatable.values())
    assert hgx.unschedulable is True
    assert hgx.draining is False
    assert hgx.ready is True
    assert hgx.ready_since == datetime(2026, 6, 11, 8, 3, 30, tzinfo=UTC)


def test_real_vmis_and_launcher_pods() -> None:
    reports = [load_file(FIXTURES / name) for name in REAL_FILES]
    assert reports[1].loaded["VirtualMachineInstance"] == 2
    assert reports[1].created_namespaces == ["default"]  # a namespaced object's namespace is created
    assert models.Namespace.objects.filter(name="default").exists()

    fedora = models.VirtualMachineInstance.objects.get(namespace__name="default", name="fedora06")
    assert fedora.uid == "2076f683-2d58-4f46-a2d9-4cb682060e36"
    assert fedora.active_pods == {"e566efd1-741e-4def-b164-403f2585fbba": "kubevirt-nn4bm-worker-srxr9"}
    assert fedora.device_names == ["nvidia.com/GA102GL_A10"]
    assert fedora.node == "kubevirt-nn4bm-worker-srxr9"
    assert fedora.phase == "Running"

    migrating = models.VirtualMachineInstance.objects.get(namespace__name="default", name="testvm")
    assert migrating.active_pods == {
        "e19201bc-9cb1-46bc-af3d-687d9c9419fb": "yj-qaovnk8swork-01",
        "de5d7166-9b5b-441c-a03a-5b131b3d5243": "yj-qaovnk8swork-02",
    }
    assert migrating.node == "yj-qaovnk8swork-01"  # stays the source node while migrating
    assert migrating.device_names == ["nvidia.com/NVIDIA_A10-12Q"]

    launcher = models.Pod.objects.get(namespace__name="default", name="virt-launcher-fedora06-wwtvw")
    assert launcher.uid == "e566efd1-741e-4def-b164-403f2585fbba"
    assert launcher.gpu_requests == {"nvidia.com/GA102GL_A10": 1}  # not the kvm/tun/vhost-net devices
    assert launcher.node == "kubevirt-nn4bm-worker-srxr9"
    assert launcher.phase == "Running"
    assert launcher.owner_kind == "VirtualMachineInstance"
    assert launcher.owner_name == "fedora06"
    assert launcher.owner_uid == "2076f683-2d58-4f46-a2d9-4cb682060e36"
    assert launcher.owner_vmi_hint == "fedora06"

    target = models.Pod.objects.get(namespace__name="default", name="virt-launcher-testvm-htmzg")
    assert target.node == "yj-qaovnk8swork-02"  # spec.nodeName, not the copied kubevirt.io/nodeName label
    assert target.gpu_requests == {"nvidia.com/NVIDIA_A10-12Q": 1}
    assert target.owner_vmi_hint == "testvm"


def test_pod_requests_fall_back_to_limits(tmp_path: Path) -> None:
    vmi = vmi_obj("t1", "vm1", ["g0"], {}, "n1")
    limits_only = launcher_obj(vmi, A10, 2, "n1", name="limits-only")
    del limits_only["spec"]["containers"][0]["resources"]["requests"][A10]
    both = launcher_obj(vmi, A10, 3, "n1", name="both")
    both["spec"]["containers"][0]["resources"]["limits"][A10] = "5"  # the request wins
    two_containers = plain_pod_obj("t1", "two-containers", H100, 2, "n2")
    second = {"name": "sidecar", "image": "x", "resources": {"requests": {H100: "1"}, "limits": {H100: "1"}}}
    two_containers["spec"]["containers"].append(second)
    with_init = plain_pod_obj("t1", "with-init", H100, 1, "")
    with_init["spec"]["initContainers"] = [{"name": "init", "image": "x", "resources": {"limits": {H100: "4"}}}]
    no_gpu = plain_pod_obj("t1", "no-gpu", A10, 1, "n1")
    no_gpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m", "devices.kubevirt.io/kvm": "1"}}
    pending = plain_pod_obj("t1", "unbound", A10, 1, "")
    del pending["status"]
    load_file(write_snapshot(tmp_path / "pods.yaml", [limits_only, both, two_containers, with_init, no_gpu, pending]))

    pods = {p.name: p for p in models.Pod.objects.all()}
    assert pods["limits-only"].gpu_requests == {A10: 2}
    assert pods["both"].gpu_requests == {A10: 3}
    assert pods["two-containers"].gpu_requests == {H100: 3}
    assert pods["with-init"].gpu_requests == {H100: 4}
    assert pods["no-gpu"].gpu_requests == {}
    assert pods["unbound"].node == ""
    assert pods["unbound"].phase == "Pending"
    # a plain pod has no owner: no VMI hint
    assert pods["two-containers"].owner_vmi_hint == ""
    assert pods["limits-only"].owner_vmi_hint == "vm1"


def test_only_a_vmi_controller_reference_hints_at_a_launcher(tmp_path: Path) -> None:
    """KubeVirt's virt-controller matches a controller reference by uid alone, so a pod naming
    the VMI's uid under another kind would be listed in activePods; the launcher policy guards
    only the kind VirtualMachineInstance. Such a pod, and one naming the VMI only in KubeVirt's
    annotation or in a reference that is not its controller, hints at no VMI."""
    vmi = vmi_obj("t1", "vm1", ["g0"], {}, "n1")
    other_kind = launcher_obj(vmi, A10, 1, "n1", name="other-kind")
    other_kind["metadata"]["ownerReferences"][0].update(apiVersion="apps/v1", kind="ReplicaSet")
    not_controller = launcher_obj(vmi, A10, 1, "n1", name="not-controller")
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    annotation_only = launcher_obj(vmi, A10, 1, "n1", name="annotation-only")
    del annotation_only["metadata"]["ownerReferences"]
    real = launcher_obj(vmi, A10, 1, "n1", name="real")
    load_file(write_snapshot(tmp_path / "pods.yaml", [other_kind, not_controller, annotation_only, real]))

    hints = dict(models.Pod.objects.values_list("name", "owner_vmi_hint"))
    assert hints == {"other-kind": "", "not-controller": "", "annotation-only": "", "real": "vm1"}
    assert "kubevirt.io/domain" in annotation_only["metadata"]["annotations"]


def test_node_conditions_and_vmi_host_devices(tmp_path: Path) -> None:
    bare = node_obj("bare", {A10: 1})
    del bare["status"]["conditions"]  # no conditions at all: counts as Ready
    down = node_obj("down", {A10: 1}, ready=False, transition="2026-11-30T08:00:00Z")
    unknown = node_obj("unknown", {A10: 1})
    for condition in unknown["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = "Unknown"
    vmi = vmi_obj("t1", "vm1", ["g0"], {}, "")
    vmi["spec"]["domain"]["devices"]["hostDevices"] = [{"deviceName": "gpuplane.io/g1", "name": "hd0"}]
    load_file(write_snapshot(tmp_path / "c.yaml", [bare, down, unknown, vmi]))

    nodes = {n.name: n for n in models.Node.objects.all()}
    assert (nodes["bare"].ready, nodes["bare"].ready_since) == (True, None)
    assert (nodes["down"].ready, nodes["down"].ready_since) == (False, datetime(2026, 11, 30, 8, 0, tzinfo=UTC))
    assert nodes["unknown"].ready is False
    loaded_vmi = models.VirtualMachineInstance.objects.get()
    assert loaded_vmi.device_names == ["gpuplane.io/g0", "gpuplane.io/g1"]
    assert (loaded_vmi.active_pods, loaded_vmi.node) == ({}, "")


# -- file shapes --------------------------------------------------------------------------


def test_kind_list_loads_like_multi_document_yaml(tmp_path: Path) -> None:
    objects = small_cluster()
    report = load_file(write_snapshot(tmp_path / "multi.yaml", objects))
    multi = rows()

    listing = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": objects}
    list_report = load_file(write_snapshot(tmp_path / "list.yaml", [listing]), replace=True)
    assert rows() == multi
    assert list_report.loaded == report.loaded

    # `kubectl get -o json` prints the same List as JSON
    (tmp_path / "list.json").write_text(json.dumps(listing))
    load_file(tmp_path / "list.json", replace=True)
    assert rows() == multi


def test_typed_lists_and_documents_mix(tmp_path: Path) -> None:
    objects = small_cluster()
    nodes = [o for o in objects if o["kind"] == "Node"]
    rest = [o for o in objects if o["kind"] != "Node"]
    node_list = {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": nodes}
    report = load_file(write_snapshot(tmp_path / "mixed.yaml", [node_list, None, *rest]))
    assert report.loaded["Node"] == 2
    assert models.Node.objects.count() == 2
    assert models.GpuDevice.objects.count() == 2


def test_devices_with_status_load_with_their_placement(tmp_path: Path) -> None:
    objects = [
        node_obj("n1", {A10: 4}),
        class_obj("a10", A10),
        gpu_obj("t1", "g0", "a10", "vm1", phase="Bound", node="n1", since="2026-11-29T10:00:00Z"),
        gpu_obj("t1", "g1", "a10", "vm1", phase="Bound", node="n1", since="2026-11-29T10:00:00Z"),
        gpu_obj("t2", "g0", "a10", "vm2", phase="Lost", since="2026-11-28T09:30:00Z"),
        gpu_obj("t2", "g1", "a10", "vm3"),
    ]
    objects[2]["status"]["answeredRequest"] = "req-7"
    objects[2]["status"]["answer"] = "bound:n1"
    objects[2]["metadata"]["annotations"]["gpuplane.io/bind-request"] = "req-7"
    load_file(write_snapshot(tmp_path / "placed.yaml", objects))

    g0 = models.GpuDevice.objects.get(namespace__name="t1", name="g0")
    assert (g0.phase, g0.node, g0.class_name, g0.vm_name) == ("Bound", "n1", "a10", "vm1")
    assert g0.since == datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    assert g0.reason == "loaded"
    assert (g0.bind_request, g0.answered_request, g0.answer) == ("req-7", "req-7", "bound:n1")
    assert g0.created == datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    lost = models.GpuDevice.objects.get(namespace__name="t2", name="g0")
    assert (lost.phase, lost.node, lost.since) == ("Lost", "", datetime(2026, 11, 28, 9, 30, tzinfo=UTC))
    fresh = models.GpuDevice.objects.get(namespace__name="t2", name="g1")
    assert (fresh.phase, fresh.node, fresh.since, fresh.reason) == ("Pending", "", None, "")

    # the loaded placement is the binder's truth: the Bound set stays where it is
    run_pass()
    g0.refresh_from_db()
    assert (g0.phase, g0.node, g0.since) == ("Bound", "n1", datetime(2026, 11, 29, 10, 0, tzinfo=UTC))
    assert not models.Decision.objects.filter(namespace="t1").exists()


def test_unquoted_yaml_timestamps_are_accepted(tmp_path: Path) -> None:
    text = (
        "apiVersion: gpuplane.io/v1alpha1\nkind: GPU\n"
        "metadata: {name: g0, namespace: t1, creationTimestamp: 2026-11-20T10:00:00Z}\n"
        "spec: {className: a10, vmName: vm1}\n"
        "status: {phase: Lost, since: 2026-11-29T10:00:00Z}\n"
    )
    (tmp_path / "ts.yaml").write_text(text)
    load_file(tmp_path / "ts.yaml")
    device = models.GpuDevice.objects.get()
    assert device.since == datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    assert device.created == datetime(2026, 11, 20, 10, 0, tzinfo=UTC)


# -- rejected snapshots: every problem named, nothing loaded ------------------------------


def _gpu_without_class() -> list[Any]:
    device = gpu_obj("t1", "g-noclass", "a10", "vm1")
    del device["spec"]["className"]
    return [device]


def _gpu_bogus_phase() -> list[Any]:
    return [gpu_obj("t1", "g-bogus", "a10", "vm1", phase="Bogus", node="n1")]


def _node_fractional() -> list[Any]:
    node = node_obj("n-frac", {A10: 1})
    node["status"]["allocatable"][A10] = "1.5"
    return [node]


def _pod_not_quantity() -> list[Any]:
    pod = plain_pod_obj("t1", "p-bad", A10, 1, "n1")
    pod["spec"]["containers"][0]["resources"] = {"requests": {A10: "two"}, "limits": {A10: "two"}}
    return [pod]


def _class_zero_units() -> list[Any]:
    return [class_obj("zero", A10, units=0)]


def _budget_negative() -> list[Any]:
    return [budget_obj("t1", {A10: -1}, name="neg")]


def _duplicate() -> list[Any]:
    return [gpu_obj("t1", "twice", "a10", "vm1"), gpu_obj("t1", "twice", "a10", "vm2")]


def _no_kind() -> list[Any]:
    device = gpu_obj("t1", "g-nokind", "a10", "vm1")
    del device["kind"]
    return [device]


def _not_a_mapping() -> list[Any]:
    return ["just a string"]


def _node_negative() -> list[Any]:
    node = node_obj("n-neg", {A10: 1})
    node["status"]["allocatable"][A10] = "-2"
    return [node]


def _pod_negative_limit() -> list[Any]:
    pod = plain_pod_obj("t1", "p-neg", A10, 3, "n1")
    pod["spec"]["containers"].append({"name": "side", "image": "x", "resources": {"limits": {A10: "-2"}}})
    return [pod]


INVALID: dict[str, tuple[Callable[[], list[Any]], tuple[str, ...]]] = {
    "gpu-missing-class": (_gpu_without_class, ("GPU t1/g-noclass", "spec.className", "required")),
    "gpu-bogus-phase": (_gpu_bogus_phase, ("GPU t1/g-bogus", "status.phase", "'Bogus'")),
    "node-negative": (_node_negative, ("Node n-neg", f"status.allocatable[{A10}]", "at least 0")),
    "pod-negative-limit": (
        _pod_negative_limit,
        ("Pod t1/p-neg", f"spec.containers[1].resources.limits[{A10}]", "at least 0"),
    ),
    "node-fractional": (_node_fractional, ("Node n-frac", f"status.allocatable[{A10}]", "'1.5'")),
    "pod-not-quantity": (_pod_not_quantity, ("Pod t1/p-bad", f"spec.containers[0].resources.requests[{A10}]", "two")),
    "class-zero-units": (_class_zero_units, ("GPUClass zero", "spec.unitsPerDevice", "at least 1")),
    "budget-negative": (_budget_negative, ("GPUBudget t1/neg", f"spec.limits[{A10}]", "at least 0")),
    "duplicate": (_duplicate, ("GPU t1/twice", "more than once")),
    "no-kind": (_no_kind, ("g-nokind", "kind", "required")),
    "not-a-mapping": (_not_a_mapping, ("document at line", "mapping", "str")),
}


@pytest.fixture
def loaded(tmp_path: Path) -> dict[str, int]:
    """A clean cluster already in the mirror, and its row counts."""
    load_file(write_snapshot(tmp_path / "base.yaml", small_cluster()))
    before = counts()
    assert before["GpuDevice"] == 2 and before["Pod"] == 2
    return before


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_object_rejects_the_whole_file(case: str, tmp_path: Path, loaded: dict[str, int]) -> None:
    build, expected = INVALID[case]
    snapshot = rows()
    # valid objects around the bad one: none of them may land
    good_before = [node_obj("n-new", {A10: 8}), gpu_obj("t9", "g-new", "a10", "vm9")]
    path = write_snapshot(tmp_path / "bad.yaml", [*good_before, *build(), class_obj("new-class", H100)])
    with pytest.raises(SnapshotError) as info:
        load_file(path)
    message = str(info.value)
    assert message.startswith("snapshot rejected, nothing loaded")
    assert len(info.value.problems) == 1, info.value.problems
    for part in expected:
        assert part in info.value.problems[0], (part, info.value.problems[0])
    assert counts() == loaded
    assert rows() == snapshot
    assert not models.Node.objects.filter(name="n-new").exists()
    assert not models.Namespace.objects.filter(name="t9").exists()


def test_malformed_yaml_names_the_line(tmp_path: Path, loaded: dict[str, int]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: v1\nkind: Node\nmetadata:\n  name: n9\n  labels: {a: b\nstatus: {}\n")
    with pytest.raises(SnapshotError) as info:
        load_file(path)
    assert "not valid YAML" in str(info.value)
    assert "line 6" in str(info.value)
    assert str(path) in str(info.value)
    assert counts() == loaded


def test_objects_without_a_name_or_kind_are_found_by_line(tmp_path: Path) -> None:
    path = tmp_path / "lines.yaml"
    path.write_text(
        "# a header comment\n"  # 1
        "---\n"  # 2
        "apiVersion: v1\n"  # 3
        "kind: Node\n"  # 4
        "metadata: {name: n1}\n"  # 5
        "---\n"  # 6
        "---\n"  # 7: an empty document
        "- not\n"  # 8
        "- an object\n"  # 9
        "---\n"  # 10
        "apiVersion: v1\n"  # 11
        "kind: List\n"  # 12
        "items:\n"  # 13
        "- {apiVersion: v1, kind: Node, metadata: {name: n2}}\n"  # 14
        "- metadata: {name: no-kind}\n"  # 15
        "- 42\n"  # 16
    )
    with pytest.raises(SnapshotError) as info:
        load_file(path)
    assert info.value.problems == [
        "document at line 8: must be a Kubernetes object (a mapping), got list",
        "object no-kind (List item 2 at line 15): kind: is required",
        "List item 3 at line 16: must be a Kubernetes object (a mapping), got int",
    ]
    assert not models.Node.objects.exists()


def test_names_too_long_for_kubernetes_are_rejected_on_every_database(tmp_path: Path, loaded: dict[str, int]) -> None:
    """The mirror's columns hold what Kubernetes allows (names up to 253 characters, namespaces
    up to 63); longer values are a clear problem, not a database error on PostgreSQL only."""
    long_ns = "t" * 64
    objects = [
        gpu_obj(long_ns, "g0", "a10", "vm1"),
        gpu_obj("t1", "g" * 254, "a10", "vm1"),
        gpu_obj("t1", "g-long-class", "c" * 254, "vm1"),
        node_obj("n" * 254, {A10: 1}),
    ]
    with pytest.raises(SnapshotError) as info:
        load_file(write_snapshot(tmp_path / "long.yaml", objects))
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert f"GPU {long_ns}/g0: metadata.namespace:" in problems[0] and "63" in problems[0]
    assert "metadata.name:" in problems[1] and "253" in problems[1]
    assert "GPU t1/g-long-class: spec.className:" in problems[2] and "253" in problems[2]
    assert "metadata.name:" in problems[3] and "253" in problems[3]
    assert counts() == loaded


def test_several_problems_are_all_reported(tmp_path: Path, loaded: dict[str, int]) -> None:
    objects: list[Any] = [node_obj("n-ok", {A10: 1})]
    for case in ("gpu-missing-class", "node-fractional", "class-zero-units", "budget-negative", "duplicate"):
        objects += INVALID[case][0]()
    with pytest.raises(SnapshotError) as info:
        load_file(write_snapshot(tmp_path / "many.yaml", objects))
    problems = info.value.problems
    assert len(problems) == 5, problems
    text = str(info.value)
    for needle in ("GPU t1/g-noclass", "Node n-frac", "GPUClass zero", "GPUBudget t1/neg", "GPU t1/twice"):
        assert needle in text
    assert counts() == loaded


def test_load_snapshot_command_reports_problems(tmp_path: Path, loaded: dict[str, int]) -> None:
    path = write_snapshot(tmp_path / "bad.yaml", [*_gpu_bogus_phase(), *_class_zero_units()])
    with pytest.raises(CommandError) as info:
        call_command("load_snapshot", str(path), stdout=io.StringIO())
    text = str(info.value)
    assert "nothing loaded" in text
    assert "GPU t1/g-bogus: status.phase" in text
    assert "GPUClass zero: spec.unitsPerDevice" in text
    assert counts() == loaded

    with pytest.raises(CommandError) as info:
        call_command("load_snapshot", str(write_snapshot(tmp_path / "frac.yaml", _node_fractional())), "--replace")
    assert f"Node n-frac: status.allocatable[{A10}]" in str(info.value)
    assert counts() == loaded  # --replace did not clear anything either

    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Node\nmetadata: [\n")
    with pytest.raises(CommandError, match=r"not valid YAML at line \d+"):
        call_command("load_snapshot", str(broken))
    with pytest.raises(CommandError, match="cannot read"):
        call_command("load_snapshot", str(tmp_path / "missing.yaml"))
    assert counts() == loaded


# -- replace and upsert -------------------------------------------------------------------


def test_replace_clears_the_mirror_first(tmp_path: Path, loaded: dict[str, int]) -> None:
    run_pass()  # some history, which --replace keeps
    passes = models.PassRun.objects.count()
    decisions = models.Decision.objects.count()
    assert decisions > 0

    other = [node_obj("n9", {H100: 8}), class_obj("h100", H100), gpu_obj("t5", "x0", "h100", "vmx")]
    out = io.StringIO()
    call_command("load_snapshot", str(write_snapshot(tmp_path / "other.yaml", other)), "--replace", stdout=out)
    assert "loaded 1 GPU, 1 GPUClass, 1 Node" in out.getvalue()
    assert list(models.Node.objects.values_list("name", flat=True)) == ["n9"]
    assert list(models.GpuClass.objects.values_list("name", flat=True)) == ["h100"]
    assert list(models.Namespace.objects.values_list("name", flat=True)) == ["t5"]
    assert list(models.GpuDevice.objects.values_list("name", flat=True)) == ["x0"]
    assert models.GpuBudget.objects.count() == 0
    assert models.Pod.objects.count() == 0
    assert models.VirtualMachineInstance.objects.count() == 0
    assert models.PassRun.objects.count() == passes
    assert models.Decision.objects.count() == decisions


def test_loading_without_replace_upserts(tmp_path: Path) -> None:
    objects = small_cluster()
    path = write_snapshot(tmp_path / "cluster.yaml", objects)
    call_command("load_snapshot", str(path), stdout=io.StringIO())
    first = counts()
    first_rows = rows()
    call_command("load_snapshot", str(path), stdout=io.StringIO())
    assert counts() == first
    assert rows() == first_rows

    # a changed object is updated in place; objects missing from the file stay
    objects[1]["status"]["allocatable"][A10] = "6"
    partial = [objects[1], node_obj("n3", {A10: 1})]
    call_command("load_snapshot", str(write_snapshot(tmp_path / "partial.yaml", partial)), stdout=io.StringIO())
    assert models.Node.objects.get(name="n1").allocatable == {A10: 6}
    assert sorted(models.Node.objects.values_list("name", flat=True)) == ["n1", "n2", "n3"]
    assert models.GpuDevice.objects.count() == first["GpuDevice"]


def test_load_objects_takes_dicts() -> None:
    report = load_objects(small_cluster())
    assert report.loaded == {
        "Namespace": 1,
        "Node": 2,
        "GPUClass": 1,
        "GPU": 2,
        "GPUBudget": 1,
        "VirtualMachineInstance": 1,
        "Pod": 2,
    }
    assert report.created_namespaces == []
    budget = models.GpuBudget.objects.get()
    assert budget.limits == {"a10": 4, A10: 6}


# -- kinds gpuplane does not mirror -------------------------------------------------------


def test_unknown_kinds_are_skipped_and_reported(tmp_path: Path) -> None:
    objects = [
        *[real("resourcequota-extended.yaml", i) for i in range(2)],
        real("kubevirt-permitted-host-devices.yaml"),
        node_obj("n1", {A10: 2}),
        {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
         "metadata": {"name": "vm1-move", "namespace": "t1"}},
    ]  # fmt: skip
    out = io.StringIO()
    call_command("load_snapshot", str(write_snapshot(tmp_path / "mixed.yaml", objects)), stdout=out)
    text = out.getvalue()
    assert "loaded 1 Node" in text
    assert (
        "skipped kinds gpuplane does not mirror: 1 KubeVirt, 2 ResourceQuota, 1 VirtualMachineInstanceMigration" in text
    )
    assert models.Node.objects.count() == 1
    # skipped objects create nothing, not even their namespaces
    assert not models.Namespace.objects.exists()

    report = load_file(FIXTURES / "resourcequota-extended.yaml")
    assert report.skipped == {"ResourceQuota": 2}
    assert report.loaded == {}
    assert report.summary().startswith("loaded nothing")


def test_load_snapshot_command_queues_a_pass_only_when_asked(
    tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    path = write_snapshot(tmp_path / "cluster.yaml", small_cluster())
    out = io.StringIO()
    call_command("load_snapshot", str(path), stdout=out)
    assert "queued a full pass" not in out.getvalue()  # GPUPLANE_AUTO_PASS is off in tests
    assert models.PassRun.objects.count() == 0

    settings.GPUPLANE_AUTO_PASS = True
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        call_command("load_snapshot", str(path), "--no-pass", stdout=out)
    assert callbacks == []
    out = io.StringIO()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        call_command("load_snapshot", str(path), stdout=out)
    assert callbacks == []  # embedded (no broker): the command runs the pass itself, once
    run = models.PassRun.objects.get()
    assert run.kind == models.PassKind.FULL
    assert run.bound == 1
    assert f"ran full pass {run.pk}: bound 1" in out.getvalue() and "queued" not in out.getvalue()
    # With a broker the binder worker runs it: queued once, at commit.
    settings.CELERY_TASK_ALWAYS_EAGER = False
    out = io.StringIO()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        call_command("load_snapshot", str(path), "--replace", stdout=out)
    assert "queued a full pass" in out.getvalue()
    assert len(callbacks) == 1

"""Test objects built from the real Kubernetes and KubeVirt shapes in tests/fixtures/kubernetes.

Every builder deep-copies a real captured object and changes only what the test is
about (names, uids, GPU requests, placement), so tests exercise the fields real
clusters send, not a shape remembered from memory.
"""

from __future__ import annotations

import copy
import uuid
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from binder.engine import types as e
from binder.kube.objects import parse_object
from binder.mirror.convert import from_parsed

#: The real captures, copied into the repository (their SOURCES.md says where each came from),
#: so a clone with nothing beside it runs the suite.
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kubernetes"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

H100 = "nvidia.com/GH100_H100_SXM5_80GB"
A10 = "nvidia.com/GA102GL_A10"


@cache
def _real(name: str) -> tuple[Any, ...]:
    with (FIXTURES / name).open() as handle:
        return tuple(doc for doc in yaml.safe_load_all(handle) if doc)


def real(name: str, index: int = 0) -> dict[str, Any]:
    """A deep copy of document ``index`` of a real fixture file."""
    return copy.deepcopy(_real(name)[index])


def new_uid() -> str:
    return str(uuid.uuid4())


def engine(obj: dict[str, Any]) -> Any:
    """Parse a Kubernetes object with the project's parser into its engine record."""
    parsed = parse_object(obj)
    assert parsed is not None, obj.get("kind")
    return from_parsed(parsed)


def node_obj(
    name: str,
    allocatable: dict[str, int],
    *,
    ready: bool = True,
    transition: str = "2026-05-04T11:21:40Z",
    unschedulable: bool = False,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    obj = real("node-with-gpus.yaml", 0)
    obj["metadata"]["name"] = name
    obj["metadata"]["uid"] = new_uid()
    obj["metadata"]["labels"]["kubernetes.io/hostname"] = name
    obj["metadata"]["labels"].update(labels or {})
    obj["spec"]["unschedulable"] = unschedulable
    for key in [k for k in obj["status"]["allocatable"] if k.startswith("nvidia.com/")]:
        del obj["status"]["allocatable"][key]
    obj["status"]["allocatable"].update({r: str(n) for r, n in allocatable.items()})
    for condition in obj["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = "True" if ready else "False"
            condition["lastTransitionTime"] = transition
            if not ready:
                condition["reason"] = "NodeStatusUnknown"
                condition["message"] = "Kubelet stopped posting node status."
    return obj


def node(name: str, allocatable: dict[str, int], **kwargs: Any) -> e.Node:
    return engine(node_obj(name, allocatable, **kwargs))  # type: ignore[no-any-return]


def class_obj(name: str, resource: str, units: int = 1, selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "gpuplane.io/v1alpha1",
        "kind": "GPUClass",
        "metadata": {"name": name, "uid": new_uid(), "creationTimestamp": "2026-11-01T00:00:00Z"},
        "spec": {
            "resourceName": resource,
            "unitsPerDevice": units,
            "nodeSelector": selector or {},
            "displayName": name,
        },
    }


def gpu_class(name: str, resource: str, units: int = 1, selector: dict[str, str] | None = None) -> e.GpuClass:
    return engine(class_obj(name, resource, units, selector))  # type: ignore[no-any-return]


def gpu_obj(
    namespace: str,
    name: str,
    class_name: str,
    vm: str,
    *,
    phase: str | None = None,
    node: str = "",
    since: str = "2026-11-29T10:00:00Z",
    created: str = "2026-11-20T10:00:00Z",
    bind_request: str = "",
    borrowed: bool = False,
    reclaim_for: str = "",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "gpuplane.io/v1alpha1",
        "kind": "GPU",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": new_uid(),
            "creationTimestamp": created,
            "annotations": {"gpuplane.io/bind-request": bind_request} if bind_request else {},
        },
        "spec": {"className": class_name, "vmName": vm},
    }
    if phase:
        obj["status"] = {"phase": phase, "node": node, "since": since, "reason": "loaded"}
        if borrowed:
            obj["status"]["borrowed"] = True
        if reclaim_for:
            obj["status"]["reclaimFor"] = reclaim_for
    return obj


def gpu(namespace: str, name: str, class_name: str, vm: str, **kwargs: Any) -> e.Device:
    return engine(gpu_obj(namespace, name, class_name, vm, **kwargs))  # type: ignore[no-any-return]


def budget(
    namespace: str, limits: dict[str, int], name: str = "gpu-budget", borrowing: dict[str, int] | None = None
) -> e.Budget:
    spec: dict[str, Any] = {"limits": limits}
    if borrowing is not None:
        spec["borrowing"] = borrowing
    return engine(  # type: ignore[no-any-return]
        {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GPUBudget", "metadata": {"name": name, "namespace": namespace},
         "spec": spec}
    )  # fmt: skip


def vmi_obj(namespace: str, name: str, devices: list[str], active_pods: dict[str, str], node: str) -> dict[str, Any]:
    """A VMI shaped like the captured fedora06, naming gpuplane devices."""
    obj = real("vmi-with-gpus.yaml", 0)
    obj["metadata"].update(name=name, namespace=namespace, uid=new_uid())
    obj["spec"]["domain"]["devices"]["gpus"] = [
        {"deviceName": f"gpuplane.io/{d}", "name": f"gpu{i}"} for i, d in enumerate(devices)
    ]
    obj["status"]["activePods"] = dict(active_pods)
    obj["status"]["nodeName"] = node
    return obj


def launcher_obj(
    vmi: dict[str, Any],
    resource: str,
    units: int,
    node: str,
    *,
    uid: str | None = None,
    phase: str = "Running",
    name: str | None = None,
) -> dict[str, Any]:
    """A virt-launcher pod shaped like the captured one, owned by ``vmi`` (labels and
    ownerReference as KubeVirt writes them). Whether it IS the launcher is decided only
    by the VMI's activePods, which this builder does not touch."""
    obj = real("virt-launcher-pod.yaml", 0)
    vmi_name, vmi_uid = vmi["metadata"]["name"], vmi["metadata"]["uid"]
    obj["metadata"]["name"] = name or f"virt-launcher-{vmi_name}-{uuid.uuid4().hex[:5]}"
    obj["metadata"]["generateName"] = f"virt-launcher-{vmi_name}-"
    obj["metadata"]["namespace"] = vmi["metadata"]["namespace"]
    obj["metadata"]["uid"] = uid or new_uid()
    obj["metadata"]["labels"].update(
        {"kubevirt.io/created-by": vmi_uid, "kubevirt.io/domain": vmi_name, "vm.kubevirt.io/name": vmi_name}
    )
    obj["metadata"]["annotations"]["kubevirt.io/domain"] = vmi_name
    obj["metadata"]["ownerReferences"][0].update(name=vmi_name, uid=vmi_uid)
    resources = obj["spec"]["containers"][0]["resources"]
    for section in ("limits", "requests"):
        resources[section].pop("nvidia.com/GA102GL_A10", None)
        resources[section][resource] = str(units)
    obj["spec"]["nodeName"] = node
    obj["status"]["phase"] = phase
    return obj


def plain_pod_obj(namespace: str, name: str, resource: str, units: int, node: str) -> dict[str, Any]:
    """A non-KubeVirt pod with a raw GPU request (the captured pod, KubeVirt parts removed)."""
    obj = real("virt-launcher-pod.yaml", 0)
    obj["metadata"] = {"name": name, "namespace": namespace, "uid": new_uid(), "labels": {"app": name}}
    obj["spec"]["containers"][0]["resources"] = {"limits": {resource: str(units)}}
    obj["spec"]["nodeName"] = node
    return obj


def budget_obj(
    namespace: str, limits: dict[str, int], name: str = "gpu-budget", borrowing: dict[str, int] | None = None
) -> dict[str, Any]:
    """A GPUBudget object (the same shape :func:`budget` parses), for snapshot files."""
    spec: dict[str, Any] = {"limits": dict(limits)}
    if borrowing is not None:
        spec["borrowing"] = dict(borrowing)
    return {
        "apiVersion": "gpuplane.io/v1alpha1",
        "kind": "GPUBudget",
        "metadata": {"name": name, "namespace": namespace, "uid": new_uid()},
        "spec": spec,
    }


def namespace_obj(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Namespace as ``kubectl get ns -o yaml`` prints it."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "uid": new_uid(),
            "creationTimestamp": "2026-09-14T10:02:51Z",
            "labels": {"kubernetes.io/metadata.name": name, **(labels or {})},
        },
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }


def write_snapshot(path: Path, objects: list[Any]) -> Path:
    """``objects`` as a multi-document YAML file at ``path``, in their order, for
    ``load_file`` or ``manage.py load_snapshot`` to read as a snapshot of the cluster."""
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path

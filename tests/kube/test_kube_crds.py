"""gpuplane's CRDs enforced by the real kube-apiserver (SPEC §1): every object below is sent
to the test control plane (harness/controlplane/), which validates it against the
CRDs of deploy/ exactly as a production cluster does (OpenAPI schema, CEL rules, the
status subresource, metadata names). The objects the CRDs must refuse are refused with a
message naming the field; what the loader would refuse the apiserver refuses first, so a
bad object never reaches the sync; and what slipped past anyway (an older CRD, a direct
write) waits alone with a reason while every other set is placed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from binder.kube.client import RESOURCES
from binder.kube.objects import ObjectError, parse_object
from harness.controlplane import SERVER_SET, ApiError, ControlPlane
from harness.shapes import FIXTURES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GROUP, VERSION = "gpuplane.io", "v1alpha1"
GPUPLANE_KINDS = ("GPUClass", "GPU", "GPUBudget")


def path_of(obj: dict[str, Any], name: str | None = None, sub: str | None = None) -> str:
    """Where ``obj`` lives in the API (a bad kind or apiVersion goes to GPUs: the server says why)."""
    meta = obj.get("metadata") or {}
    resource = RESOURCES.get(obj.get("kind", ""), RESOURCES["GPU"])
    return resource.path(meta.get("namespace"), name, sub)


def causes(exc: ApiError) -> list[str]:
    """The refusal as "field: message" lines (the apiserver's own words)."""
    details = exc.status.get("details") or {}
    found = [f"{c.get('field', '')}: {c.get('message', '')}" for c in details.get("causes") or []]
    return found or [exc.message]


def schema_errors(plane: ControlPlane, obj: dict[str, Any]) -> list[str]:
    """What the apiserver says of ``obj``: [] when it takes it, with strict field validation as
    ``kubectl apply`` asks for it (the API's default only warns of an unknown field and drops
    it). The spec and metadata go through a dry-run create; a status (written by the binder through ``/status``, dropped
    on create) through a dry-run status patch of the object created for the purpose."""
    meta = obj.get("metadata") or {}
    if meta.get("namespace"):
        try:
            plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": meta["namespace"]}})
        except ApiError as exc:
            assert exc.code == 409, exc
    body = {k: v for k, v in obj.items() if k != "status"}
    body["metadata"] = {k: v for k, v in meta.items() if k not in SERVER_SET}
    try:
        plane.request("POST", path_of(obj) + "?dryRun=All&fieldValidation=Strict", body)
    except ApiError as exc:
        return causes(exc)
    if "status" not in obj:
        return []
    name = meta["name"]
    with _created(plane, body):
        try:
            plane.request(
                "PATCH", path_of(obj, name, "status") + "?dryRun=All&fieldValidation=Strict", {"status": obj["status"]}
            )
        except ApiError as exc:
            return causes(exc)
    return []


class _created:
    """The object exists while the block runs (created for real, deleted after)."""

    def __init__(self, plane: ControlPlane, body: dict[str, Any]) -> None:
        self.plane, self.body = plane, body

    def __enter__(self) -> None:
        self.path = path_of(self.body, self.body["metadata"]["name"])
        try:
            self.plane.request("DELETE", self.path)
        except ApiError as exc:
            assert exc.code == 404, exc
        self.plane.request("POST", path_of(self.body), self.body)

    def __exit__(self, *exc: object) -> None:
        self.plane.request("DELETE", self.path)


def loader_error(obj: dict[str, Any]) -> str | None:
    try:
        parse_object(copy.deepcopy(obj))
    except ObjectError as e:
        return str(e)
    return None


def gpu_class(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GPUClass",
        "metadata": {"name": "h100"},
        "spec": {"resourceName": "nvidia.com/GH100_H100_SXM5_80GB", "unitsPerDevice": 1, **spec},
    }


def gpu(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GPU",
        "metadata": {"name": "vm1-gpu0", "namespace": "team-a"},
        "spec": {"className": "h100", "vmName": "vm1", **spec},
    }
    if status is not None:
        obj["status"] = status
    return obj


def gpu_budget(limits: dict[str, Any], used: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GPUBudget",
        "metadata": {"name": "gpu-budget", "namespace": "team-a"},
        "spec": {"limits": limits},
    }
    if used is not None:
        obj["status"] = {"used": used}
    return obj


BOUND = {"phase": "Bound", "node": "n1", "since": "2026-11-29T10:00:00Z", "reason": "bound: fullest node with room"}

#: Objects the CRDs must accept (and so the loader must read).
VALID = {
    "class": gpu_class(),
    "class, defaults and everything": gpu_class(
        nodeSelector={"nvidia.com/gpu.workload.config": "vm-passthrough"}, displayName="NVIDIA H100"
    ),
    "class with tolerations": gpu_class(
        tolerations=[
            {"key": "nvidia.com/gpu", "operator": "Equal", "value": "dedicated", "effect": "NoSchedule"},
            {"key": "nvidia.com/gpu", "operator": "Exists"},
            {"operator": "Exists"},
            {"key": "maintenance", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
            {"key": "a", "value": "b"},
        ]
    ),
    "class without unitsPerDevice": {**gpu_class(), "spec": {"resourceName": "nvidia.com/GA102GL_A10"}},
    "class, vGPU name with a hyphen": gpu_class(resourceName="nvidia.com/NVIDIA_A10-12Q", unitsPerDevice=2),
    "class with status": {**gpu_class(), "status": {"allocatable": 40, "bound": 31, "lost": 8}},
    "gpu, new order": gpu(),
    "gpu, pending": gpu({"phase": "Pending", "reason": "over budget"}),
    "gpu, bound": gpu(BOUND),
    "gpu, lost with an empty node": gpu({"phase": "Lost", "node": "", "since": "2026-11-29T10:00:00.5+01:00"}),
    "gpu, answered": gpu({**BOUND, "answeredRequest": "r" * 128, "answer": "n1"}),
    "gpu with alternatives": gpu(alternativeClassNames=["a100", "l40s"]),
    "gpu held as its second choice": gpu({**BOUND, "className": "a100"}, alternativeClassNames=["a100"]),
    "gpu with eight alternatives": gpu(alternativeClassNames=[f"c{i}" for i in range(8)]),
    "budget": gpu_budget({"h100": 8, "nvidia.com/GH100_H100_SXM5_80GB": 18, "a10": 0}),
    "budget with usage": gpu_budget({"h100": 8}, {"h100": 5, "nvidia.com/GA102GL_A10": 2}),
    "budget, empty": gpu_budget({}),
    "budget with borrowing": {
        **gpu_budget({"a10": 2}),
        "spec": {"limits": {"a10": 2, "h100": 0}, "borrowing": {"a10": 4, "h100": 2}},
    },
    "gpu, borrowed and marked": gpu({**BOUND, "borrowed": True, "reclaimFor": "team-b/train-1"}),
    "gpu, dotted vmName": gpu(vmName="web.vm-1"),
}

#: Objects the CRDs must refuse: (object, the field the apiserver's refusal names).
INVALID = {
    "gpu, phase Running": (gpu({"phase": "Running"}), "status.phase"),
    "class, unitsPerDevice 0": (gpu_class(unitsPerDevice=0), "spec.unitsPerDevice"),
    "class, unitsPerDevice as a string": (gpu_class(unitsPerDevice="2"), "spec.unitsPerDevice"),
    "class, fractional unitsPerDevice": (gpu_class(unitsPerDevice=1.5), "spec.unitsPerDevice"),
    "class, no resourceName": ({**gpu_class(), "spec": {"unitsPerDevice": 1}}, "spec.resourceName"),
    "class, resourceName without a '/'": (gpu_class(resourceName="GH100"), "spec.resourceName"),
    "class, resourceName with a control character": (
        gpu_class(resourceName="nvidia.com/H\x07100"),
        "spec.resourceName",
    ),
    "class, displayName with a NUL": (gpu_class(displayName="H100\x00"), "spec.displayName"),
    "class, nodeSelector value not a string": (gpu_class(nodeSelector={"gpu": True}), "spec.nodeSelector"),
    "class, nodeSelector key with a newline": (gpu_class(nodeSelector={"gpu\nx": "a"}), "spec.nodeSelector"),
    "class, name not a DNS-1123 subdomain": (
        {**gpu_class(), "metadata": {"name": "H100_SXM"}},
        "metadata.name",
    ),
    "class, negative status": ({**gpu_class(), "status": {"bound": -1}}, "status.bound"),
    "class, toleration operator Near": (
        gpu_class(tolerations=[{"key": "a", "operator": "Near"}]),
        "spec.tolerations[0].operator",
    ),
    "class, toleration effect Sometimes": (
        gpu_class(tolerations=[{"key": "a", "effect": "Sometimes"}]),
        "spec.tolerations[0].effect",
    ),
    "class, Exists with a value": (
        gpu_class(tolerations=[{"key": "a", "operator": "Exists", "value": "b"}]),
        "spec.tolerations[0]",
    ),
    "class, empty key without Exists": (gpu_class(tolerations=[{"value": "b"}]), "spec.tolerations[0]"),
    "class, tolerationSeconds on NoSchedule": (
        gpu_class(tolerations=[{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]),
        "spec.tolerations[0]",
    ),
    "class, unknown field": (gpu_class(unitPerDevice=2), "unitPerDevice"),
    "gpu, unknown status field": (gpu({**BOUND, "nodeName": "n1"}), "nodeName"),
    "gpu, no vmName": ({**gpu(), "spec": {"className": "h100"}}, "spec.vmName"),
    "gpu, empty className": (gpu(className=""), "spec.className"),
    "gpu, className not a class name": (gpu(className="H100 SXM"), "spec.className"),
    "gpu, vmName not a DNS-1123 subdomain": (gpu(vmName="VM_1"), "spec.vmName"),
    "gpu, vmName with a NUL": (gpu(vmName="vm1\x00"), "spec.vmName"),
    "gpu, vmName too long": (gpu(vmName="v" * 254), "spec.vmName"),
    "gpu, name not a DNS-1123 subdomain": (
        {**gpu(), "metadata": {"name": "GPU 0", "namespace": "team-a"}},
        "metadata.name",
    ),
    "gpu, nine alternatives": (gpu(alternativeClassNames=[f"c{i}" for i in range(9)]), "spec.alternativeClassNames"),
    "gpu, an alternative twice": (gpu(alternativeClassNames=["a100", "a100"]), "spec.alternativeClassNames[1]"),
    "gpu, className among its alternatives": (gpu(alternativeClassNames=["h100"]), "spec"),
    "gpu, alternative with a control character": (
        gpu(alternativeClassNames=["a1\x0b00"]),
        "spec.alternativeClassNames[0]",
    ),
    "gpu, no spec": ({k: v for k, v in gpu().items() if k != "spec"}, "spec"),
    "gpu, bound without a node": (gpu({"phase": "Bound"}), "status"),
    "gpu, pending on a node": (gpu({"phase": "Pending", "node": "n1"}), "status"),
    "gpu, lost on a node": (gpu({"phase": "Lost", "node": "n1"}), "status"),
    "gpu, node without a phase": (gpu({"node": "n1"}), "status"),
    "gpu, since not a time": (gpu({**BOUND, "since": "yesterday"}), "status.since"),
    "gpu, since without a zone": (gpu({**BOUND, "since": "2026-11-29T10:00:00"}), "status.since"),
    "gpu, request id too long": (gpu({**BOUND, "answeredRequest": "r" * 129}), "status.answeredRequest"),
    "budget, no limits": ({**gpu_budget({}), "spec": {}}, "spec.limits"),
    "budget, negative limit": (gpu_budget({"h100": -1}), "spec.limits.h100"),
    "budget, limit as a quantity string": (gpu_budget({"h100": "2"}), "spec.limits.h100"),
    "budget, limit key with a control character": (gpu_budget({"h1\x1b00": 1}), "spec.limits"),
    "budget, negative borrowing": (
        {**gpu_budget({"h100": 1}), "spec": {"limits": {"h100": 1}, "borrowing": {"h100": -1}}},
        "spec.borrowing.h100",
    ),
    "budget, negative usage": (gpu_budget({"h100": 1}, {"h100": -2}), "status.used.h100"),
    "wrong apiVersion": ({**gpu(), "apiVersion": "gpuplane.io/v1"}, 'version "v1"'),
}


def demo_objects() -> list[dict[str, Any]]:
    docs = yaml.safe_load_all((DEPLOY / "demo" / "cluster.yaml").read_text())
    return [d for d in docs if d and d.get("kind") in GPUPLANE_KINDS]


def fixture_documents() -> Iterator[tuple[str, Any]]:
    for path in sorted(FIXTURES.iterdir()):
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(path.read_text()):
                yield path.name, doc
        elif path.suffix == ".json":
            yield path.name, json.loads(path.read_text())


def embedded_objects(doc: Any) -> Iterator[dict[str, Any]]:
    """Every Kubernetes object in a document: itself, a List's items, an AdmissionReview's."""
    if not isinstance(doc, dict):
        return
    if "kind" in doc and "apiVersion" in doc:
        yield doc
    for key in ("items",):
        for item in doc.get(key) or []:
            yield from embedded_objects(item)
    request = doc.get("request")
    if isinstance(request, dict):
        for key in ("object", "oldObject"):
            yield from embedded_objects(request.get(key))


@pytest.mark.parametrize("case", sorted(VALID))
def test_the_apiserver_accepts_and_the_loader_reads(apiserver: ControlPlane, case: str) -> None:
    obj = VALID[case]
    assert schema_errors(apiserver, obj) == []
    assert loader_error(obj) is None


@pytest.mark.parametrize("case", sorted(INVALID))
def test_the_apiserver_refuses_naming_the_field(apiserver: ControlPlane, case: str) -> None:
    obj, field = INVALID[case]
    errors = schema_errors(apiserver, obj)
    assert errors, f"{case}: accepted"
    assert any(field in e for e in errors), errors


def test_gpu_phase_running_and_units_zero_fail(apiserver: ControlPlane) -> None:
    """Two refusals spelled out against a valid baseline, in the apiserver's words."""
    assert schema_errors(apiserver, gpu(BOUND)) == []
    running = gpu({**BOUND, "phase": "Running"})
    assert any(
        e.startswith("status.phase:") and '"Running"' in e and '"Pending", "Bound", "Lost"' in e
        for e in schema_errors(apiserver, running)
    ), schema_errors(apiserver, running)
    assert schema_errors(apiserver, gpu_class(unitsPerDevice=1)) == []
    (error,) = schema_errors(apiserver, gpu_class(unitsPerDevice=0))
    assert error.startswith("spec.unitsPerDevice:") and "greater than or equal to 1" in error


LOADER_REFUSES = [
    gpu({"phase": "Running"}),
    gpu({"phase": "Bound"}),
    gpu({"phase": "Lost", "node": "n1"}),
    gpu({"node": "n1"}),
    gpu(className=""),
    {**gpu(), "spec": {"className": "h100"}},
    gpu({**BOUND, "answeredRequest": "r" * 129}),
    gpu({**BOUND, "since": "2026-11-29T10:00:00"}),
    gpu({**BOUND, "node": "n" * 254}),
    gpu(vmName="v" * 254),
    gpu(alternativeClassNames=["a100", "a100"]),
    gpu(alternativeClassNames=[f"c{i}" for i in range(9)]),
    gpu(alternativeClassNames=["a100", 7]),
    gpu(alternativeClassNames=[""]),
    gpu(alternativeClassNames="a100"),
    gpu({**BOUND, "className": "c" * 254}),
    gpu_class(unitsPerDevice=0),
    gpu_class(resourceName="GH100"),
    gpu_class(displayName="d" * 254),
    gpu_class(nodeSelector={"a": 1}),
    gpu_class(tolerations=[{"key": "a", "operator": "Near"}]),
    gpu_class(tolerations=[{"key": "a", "operator": "Exists", "value": "b"}]),
    gpu_class(tolerations=[{"value": "b"}]),
    gpu_class(tolerations=[{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]),
    gpu_class(tolerations=[{"key": "a", "effect": "Sometimes"}]),
    gpu_class(tolerations={"key": "a"}),
    {**gpu_class(), "spec": {"unitsPerDevice": 1}},
    gpu_budget({"h100": -1}),
    gpu_budget({"h100": 1}, {"h100": -1}),
    gpu_budget({"h100": 1.5}),
]


@pytest.mark.parametrize("index", range(len(LOADER_REFUSES)))
def test_what_the_loader_refuses_the_apiserver_refuses(apiserver: ControlPlane, index: int) -> None:
    """Else an object the apiserver let in would be skipped by the sync (the loader refuses it)."""
    obj = LOADER_REFUSES[index]
    assert loader_error(obj) is not None, "the loader accepts it: move the case"
    assert schema_errors(apiserver, obj), f"the CRD accepts what the loader refuses: {loader_error(obj)}"


def test_demo_objects_match_the_crds(apiserver: ControlPlane) -> None:
    objects = demo_objects()
    counts = {kind: sum(1 for o in objects if o["kind"] == kind) for kind in GPUPLANE_KINDS}
    assert all(counts.values()), counts
    errors = [f"{o['kind']} {o['metadata']['name']}: {e}" for o in objects for e in schema_errors(apiserver, o)]
    assert not errors, "\n".join(errors)


def test_real_fixtures_match_the_crds(apiserver: ControlPlane) -> None:
    """Any gpuplane object among the real captures (none today) passes the CRDs."""
    documents = list(fixture_documents())
    assert len(documents) >= 10, f"no fixtures found in {FIXTURES}"
    objects = [o for _, doc in documents for o in embedded_objects(doc)]
    assert any(o["kind"] == "VirtualMachineInstance" for o in objects)  # the walk finds objects
    ours = [o for o in objects if o["kind"] in GPUPLANE_KINDS and o["apiVersion"].startswith(f"{GROUP}/")]
    errors = [f"{o['kind']} {o['metadata'].get('name')}: {e}" for o in ours for e in schema_errors(apiserver, o)]
    assert not errors, "\n".join(errors)

"""Test objects built from several real shapes: AdmissionReview requests for VMIs, and the
two-tenant cluster the tenant API, admin, schema and security tests share.

Like harness/shapes.py (which builds single objects from the captures in
tests/fixtures/kubernetes), everything starts from a real captured object; nothing here
needs Django, so the benches and the engine-only tests use it too.
"""

from __future__ import annotations

from typing import Any

from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    new_uid,
    node_obj,
    plain_pod_obj,
    real,
    vmi_obj,
)

# -- AdmissionReview requests ----------------------------------------------------------------


def new_vmi(namespace: str, name: str, devices: list[str], *, extra_gpus: list[dict[str, Any]] | None = None) -> dict:
    """A VMI as a mutating webhook sees it on CREATE: the captured fedora06 naming
    ``devices``, with the fields the apiserver has not set yet removed."""
    obj = vmi_obj(namespace, name, devices, {}, "")
    for key in ("uid", "resourceVersion", "generation", "finalizers"):
        obj["metadata"].pop(key, None)
    obj["metadata"]["creationTimestamp"] = None
    obj["status"] = {}
    obj["spec"]["domain"]["devices"]["gpus"] += extra_gpus or []
    return obj


def review(vmi: dict[str, Any], *, uid: str | None = None, **request: Any) -> dict[str, Any]:
    """The captured AdmissionReview request, turned into a VMI CREATE of ``vmi``."""
    body = real("admissionreview-v1-request-pod-create.json")
    req = body["request"]
    vmi_kind = {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachineInstance"}
    vmi_resource = {"group": "kubevirt.io", "version": "v1", "resource": "virtualmachineinstances"}
    req.update(
        uid=uid or new_uid(),
        kind=vmi_kind,
        requestKind=dict(vmi_kind),
        resource=vmi_resource,
        requestResource=dict(vmi_resource),
        namespace=vmi["metadata"]["namespace"],
        object=vmi,
        **request,
    )
    return body


# -- two tenants ------------------------------------------------------------------------------

#: GPUs requested by the pod in t1 that forges a launcher's owner reference.
FORGED_UNITS = 3


def two_tenants() -> list[dict[str, Any]]:
    """t1: vm1 (2 h100 on n1, real launcher, a forged launcher with 3 GPUs) and budget;
    t2: vm9 (1 a10 on n2) and a raw training pod."""
    vmi = vmi_obj("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"], {"uid-real": "n1"}, "n1")
    return [
        namespace_obj("t1"),
        namespace_obj("t2"),
        class_obj("h100", H100),
        class_obj("a10", A10),
        node_obj("n1", {H100: 8}),
        node_obj("n2", {A10: 4}),
        node_obj("n3", {H100: 8}),
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1", phase="Bound", node="n1"),
        gpu_obj("t1", "vm1-gpu1", "h100", "vm1", phase="Bound", node="n1"),
        vmi,
        launcher_obj(vmi, H100, 2, "n1", uid="uid-real", name="virt-launcher-vm1-real1"),
        launcher_obj(vmi, H100, FORGED_UNITS, "n1", name="virt-launcher-vm1-fake1"),
        budget_obj("t1", {"h100": 4, H100: 8}),
        gpu_obj("t2", "vm9-gpu0", "a10", "vm9", phase="Bound", node="n2"),
        plain_pod_obj("t2", "trainer", A10, 1, "n2"),
    ]


#: One URL of tenant t2 (of :func:`two_tenants`) per tenant API endpoint: tests/usage/test_usage_api.py
#: checks tenant t1 gets 404 and no token 401 on each, tests/system/test_security.py that every
#: endpoint of the schema is among them.
TENANT_B_URLS = [
    "/api/v1/tenants/t2/usage",
    "/api/v1/tenants/t2/usage-records",
    "/api/v1/tenants/t2/usage-records?format=csv",
    "/api/v1/devices?namespace=t2",
    "/api/v1/devices/t2/vm9-gpu0",
    "/api/v1/devices/t2/vm9-gpu0/decisions",
    "/api/v1/catalog/gpu-options?namespace=t2",
]


# -- an order held as its second choice ---------------------------------------------------------

#: The second choice's resource in :func:`second_choice`.
A100 = "nvidia.com/GA100_A100_SXM4_80GB"


def second_choice(namespace: str = "t1", vm: str = "vm1") -> list[dict[str, Any]]:
    """``namespace``'s ``vm`` orders 2 devices of class h100 that also accept a100; the only
    h100 node has no free unit, the a100 node has 4: a full pass holds the set as a100."""
    order = []
    for index in range(2):
        obj = gpu_obj(namespace, f"{vm}-gpu{index}", "h100", vm)
        obj["spec"]["alternativeClassNames"] = ["a100"]
        order.append(obj)
    return [
        namespace_obj(namespace),
        class_obj("h100", H100),
        class_obj("a100", A100),
        node_obj("nh", {H100: 0}),
        node_obj("na", {A100: 4}),
        *order,
    ]


def checkpointed() -> list[dict[str, Any]]:
    """One tenant's 2-device set with a VMI, a budget, a raw-GPU pod and two nodes: every
    kind of record a worker's state (and so its checkpoint) holds."""
    return [
        namespace_obj("t1"),
        class_obj("h100", H100),
        node_obj("n1", {H100: 4}),
        node_obj("n2", {H100: 8}),
        gpu_obj("t1", "g0", "h100", "vm1"),
        gpu_obj("t1", "g1", "h100", "vm1"),
        budget_obj("t1", {"h100": 8}),
        vmi_obj("t1", "vm1", ["g0", "g1"], {}, ""),
        plain_pod_obj("t1", "raw", H100, 1, "n1"),
    ]

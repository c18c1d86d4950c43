"""What the stateful property tests share: the world's constants, the strategies, the
independent expectations (records, GPU-hours) and the calls both machines make.

The machines themselves, and what they check after every step, are in
tests/system/test_stateful_engine.py (the pure machine) and
tests/system/test_stateful_database.py (the database machine).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

import jsonpatch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from binder.engine.launcher import launcher_of, raw_usage
from binder.engine.types import (
    HELD_PHASES,
    Device,
    GpuClass,
    Phase,
    Pod,
    Vmi,
)
from binder.engine.usage import UsageHolding
from harness import shapes
from harness.engine_invariants import (
    POOL_LABEL,
    device_units_on_nodes,
)
from webhooks.admission import MirrorView, Review, Verdict

H100, A10 = shapes.H100, shapes.A10
RESOURCES = (H100, A10)
TENANTS = ("team-a", "team-b", "team-c")
POOL = {POOL_LABEL: "fast"}
SetKey = tuple[str, str]

#: Steps run per machine, counted by the rules themselves (see the module docstring).
STEPS: Counter[str] = Counter()

ENGINE_EXAMPLES, ENGINE_STEPS = 120, 110
ENGINE_MIN_STEPS = 10_000
#: ``GPUPLANE_DB_EXAMPLES=200`` searches deeper locally (CI keeps the default).
DB_EXAMPLES, DB_STEPS = int(os.environ.get("GPUPLANE_DB_EXAMPLES", "20")), 25
DB_MIN_STEPS = 300
#: A full pass runs at the start of a step when this many steps ran without one (the resync,
#: ``GPUPLANE_RESYNC_SECONDS``): hypothesis turns rules off per example (swarm testing), and an
#: example without its full-pass rules would otherwise never check the usage records.
RESYNC_STEPS = 8

_COMMON = {
    "deadline": None,
    "database": None,  # every CI run searches afresh
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}
ENGINE_SETTINGS = settings(max_examples=ENGINE_EXAMPLES, stateful_step_count=ENGINE_STEPS, **_COMMON)
DB_SETTINGS = settings(max_examples=DB_EXAMPLES, stateful_step_count=DB_STEPS, **_COMMON)

# Strategies. Seconds the clock moves at a step straddle the 300 s node grace period.
DT = st.sampled_from([0, 1, 30, 120, 299, 301, 900, 3600])
IDX = st.integers(0, 7)
NODE = st.integers(-3, 5)  # negative: the node of a Bound set (engine_invariants.node_ref)
SET = st.integers(-4, 7)  # negative: a Bound set (engine_invariants.set_ref)
UNITS = st.sampled_from([0, 1, 2, 4, 4, 8, 8])
CLASS = st.sampled_from([0, 0, 0, 1, 1, 1, 2, 2, 2, -1])  # -1: a class that never exists
LIMIT = st.none() | st.integers(0, 8)


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------
# Independent expectations (no engine Ledger, no binder.engine.usage): the launcher rule
# itself is called, never re-implemented.
# --------------------------------------------------------------------------------------

#: What an open record says is held: kind, namespace, subject, subject uid, key, resource,
#: units, node, phase, vm name.
Held = tuple[str, str, str, str, str, str, int, str, str, str]


def held_of(h: UsageHolding) -> Held:
    return (
        h.subject_kind.value,
        h.namespace,
        h.subject,
        h.subject_uid,
        h.key,
        h.resource_name,
        h.units,
        h.node,
        h.phase.value,
        h.vm_name,
    )


def expected_holdings(
    devices: Iterable[Device], classes: Mapping[str, GpuClass], pods: Iterable[Pod], vmis: Mapping[SetKey, Vmi]
) -> Counter[Held]:
    """What must have an open record: each Bound or Lost device of an existing class
    (a device whose class is gone holds nothing), and each pod's raw
    usage for budgets per resource."""
    devices = list(devices)
    sets: dict[SetKey, list[Device]] = defaultdict(list)
    for device in devices:
        sets[device.set_key].append(device)
    found: Counter[Held] = Counter()
    for d in devices:
        cls = classes.get(d.class_name)
        if d.phase in HELD_PHASES and cls is not None:
            node = d.node if d.phase is Phase.BOUND else ""
            found[("GPU", d.namespace, d.name, "", cls.name, cls.resource_name, cls.units_per_device, node,
                   d.phase.value, d.vm_name)] += 1  # fmt: skip
    for pod in pods:
        launcher = launcher_of(pod, lambda ns, name: vmis.get((ns, name)))
        members = sets.get((launcher.namespace, launcher.name), []) if launcher else []
        for resource, units in raw_usage(pod, launcher, members, classes).budget.items():
            if units > 0:
                found[("Pod", pod.namespace, pod.name, pod.uid, resource, resource, units, pod.node, "Raw", "")] += 1
    return found


def units_by_record_key(held: Counter[Held]) -> Counter[tuple[str, str, str]]:
    """Units held per (namespace, subject kind, record key)."""
    out: Counter[tuple[str, str, str]] = Counter()
    for (kind, ns, _, _, key, _, units, _, _, _), n in held.items():
        out[(ns, kind, key)] += units * n
    return out


def units_by_budget_key(held: Counter[Held]) -> Counter[tuple[str, str]]:
    """Units held per (namespace, budget key): a device counts under its class and its
    resource, a pod under its resource (how ``queries.gpu_hours`` keys hours)."""
    out: Counter[tuple[str, str]] = Counter()
    for (kind, ns, _, _, key, resource, units, _, _, _), n in held.items():
        out[(ns, key)] += units * n
        if kind == "GPU":
            out[(ns, resource)] += units * n
    return out


def split_sets(devices: Iterable[Device]) -> list[str]:
    """Sets whose held members do not share one phase and node."""
    sets: dict[SetKey, set[tuple[Phase, str]]] = defaultdict(set)
    for d in devices:
        if d.phase in HELD_PHASES:
            sets[d.set_key].add((d.phase, d.node if d.phase is Phase.BOUND else ""))
    return [f"split set {key}: {sorted(places)}" for key, places in sorted(sets.items()) if len(places) > 1]


def grown_over_allocatable(
    before: Iterable[Device], after: Iterable[Device], classes: Mapping[str, GpuClass], allocatable: Mapping[str, Any]
) -> list[str]:
    """Nodes over their allocatable whose device units grew (both counted with today's classes)."""
    was = device_units_on_nodes(before, classes)
    now = device_units_on_nodes(after, classes)
    problems = []
    for node, per_resource in sorted(now.items()):
        if node not in allocatable:
            continue
        for resource, units in sorted(per_resource.items()):
            limit = allocatable[node].get(resource, 0)
            if units > limit and units > was[node][resource]:
                problems.append(f"node {node} {resource}: devices {was[node][resource]} -> {units} > {limit}")
    return problems


def budget_problems(
    tenants: Iterable[str],
    before: Mapping[str, Counter[str]],
    after: Mapping[str, Counter[str]],
    limit: Any,
) -> list[str]:
    """A key over its limit after a pass was over before it, and did not grow
    (the binder refuses any bind that adds units to a key beyond its limit)."""
    problems = []
    for ns in sorted(tenants):
        was, now = before.get(ns, Counter()), after.get(ns, Counter())
        for key in sorted(set(was) | set(now)):
            cap = limit(ns, key)
            if cap is None or now[key] <= cap:
                continue
            if was[key] <= cap or now[key] > was[key]:
                problems.append(f"budget: {ns} key {key} went {was[key]} -> {now[key]}, limit {cap}")
    return problems


def whole_bound_node(devices: Iterable[Device]) -> str | None:
    """The node when every device is Bound there, else None."""
    devices = list(devices)
    nodes = {d.node for d in devices}
    if devices and all(d.phase is Phase.BOUND for d in devices) and len(nodes) == 1:
        return nodes.pop()
    return None


# --------------------------------------------------------------------------------------
# Webhook requests, from the captured AdmissionReview and VMI
# --------------------------------------------------------------------------------------


def new_vmi(namespace: str, name: str, devices: list[str]) -> dict[str, Any]:
    """A VMI as the webhook sees it on CREATE: the captured fedora06 naming ``devices``."""
    obj = shapes.vmi_obj(namespace, name, devices, {}, "")
    for key in ("uid", "resourceVersion", "generation", "finalizers"):
        obj["metadata"].pop(key, None)
    obj["metadata"]["creationTimestamp"] = None
    obj["status"] = {}
    return obj


def admission_review(vmi: dict[str, Any], uid: str, *, dry_run: bool = False) -> dict[str, Any]:
    """The captured AdmissionReview request turned into a VMI CREATE of ``vmi``."""
    body = shapes.real("admissionreview-v1-request-pod-create.json")
    kind = {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachineInstance"}
    resource = {"group": "kubevirt.io", "version": "v1", "resource": "virtualmachineinstances"}
    body["request"].update(
        uid=uid,
        kind=kind,
        requestKind=dict(kind),
        resource=resource,
        requestResource=dict(resource),
        namespace=vmi["metadata"]["namespace"],
        object=vmi,
        dryRun=dry_run,
    )
    return body


def patched(vmi: dict[str, Any], verdict: Verdict) -> tuple[str, Counter[str]]:
    """Apply the webhook's patch: the node the VMI is pinned to and its gpus per deviceName."""
    result = jsonpatch.apply_patch(vmi, [dict(op) for op in verdict.patch])
    # The hostname label (equal to the name on these nodes), or, for a node the view did
    # not hold, the required node affinity on metadata.name.
    node = result["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname")
    if node is None:
        terms = result["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (node,) = {f["values"][0] for t in terms["nodeSelectorTerms"] for f in t["matchFields"]}
    return node, Counter(g["deviceName"] for g in result["spec"]["domain"]["devices"]["gpus"])


def expected_devices(members: Iterable[Device], classes: Mapping[str, GpuClass]) -> Counter[str]:
    """One gpus entry per unit of each device, named by its class's raw resource."""
    want: Counter[str] = Counter()
    for d in members:
        want[classes[d.class_name].resource_name] += classes[d.class_name].units_per_device
    return want


def launcher_pod_obj(
    vmi: dict[str, Any], requests: Mapping[str, int], node: str, uid: str, phase: str = "Running"
) -> dict[str, Any]:
    """The captured virt-launcher pod requesting ``requests`` (KubeVirt: 1 per gpus entry)."""
    first, *rest = sorted(requests)
    obj = shapes.launcher_obj(vmi, first, requests[first], node, uid=uid, phase=phase)
    resources = obj["spec"]["containers"][0]["resources"]
    for resource in rest:
        for section in ("limits", "requests"):
            resources[section][resource] = str(requests[resource])
    return obj


class Call(NamedTuple):
    """A webhook call waiting for the binder's answers to its bind request."""

    review: Review
    names: tuple[str, ...]
    request: str
    view: MirrorView
    vmi: dict[str, Any]


def engine_classes() -> dict[str, GpuClass]:
    return {
        "h100": shapes.gpu_class("h100", H100),
        "h100-pair": shapes.gpu_class("h100-pair", H100, units=2, selector=dict(POOL)),
        "a10": shapes.gpu_class("a10", A10),
    }


def vmi_devices(vmi: Mapping[str, Any]) -> list[str]:
    return [g["deviceName"] for g in vmi["spec"]["domain"]["devices"]["gpus"]]

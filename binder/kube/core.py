"""The core Kubernetes and KubeVirt kinds gpuplane mirrors: Namespace, Node (with its
taints), Pod (its GPU requests and the owner that hints at its VMI) and
VirtualMachineInstance, each read into plain row values for the mirror. Tolerations are
read here too: a GPUClass carries them in the core/v1 shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from binder.engine.matching import FIELD_OPERATORS, LABEL_OPERATORS
from binder.kube.fields import (
    KIND_MAX,
    NAME_MAX,
    NAMESPACE_MAX,
    PHASE_MAX,
    UID_MAX,
    Parsed,
    Reader,
    check_api,
    quote,
)

#: Extended resources that are never GPUs: KubeVirt's own device plugins.
NON_GPU_PREFIXES = ("kubernetes.io/", "devices.kubevirt.io/")


def is_gpu_resource(name: str) -> bool:
    """Extended resources worth mirroring: a ``/`` in the name, not KubeVirt's own devices."""
    return "/" in name and not name.startswith(NON_GPU_PREFIXES)


def parse_namespace(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, ("v1",))
    name = r.name(max_length=NAMESPACE_MAX)
    return Parsed(
        "Namespace",
        "",
        name,
        {
            "uid": r.string("metadata.uid", max_length=UID_MAX),
            "labels": r.string_map("metadata.labels"),
            "created": r.timestamp("metadata.creationTimestamp"),
        },
    )


TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
TOLERATION_OPERATORS = ("Equal", "Exists")


def parse_taints(r: Reader, path: str) -> list[dict[str, str]]:
    """A node's ``spec.taints``: key and effect required, value optional (core/v1 Taint)."""
    taints = []
    for index, raw in enumerate(r.listing(path)):
        at = f"{path}[{index}]"
        if not isinstance(raw, Mapping):
            raise r.fail(at, "must be a mapping")
        key = r.limited(f"{at}.key", _field(r, at, "key", raw.get("key")), NAME_MAX + NAMESPACE_MAX)
        if not key:
            raise r.fail(f"{at}.key", "is required")
        effect = _field(r, at, "effect", raw.get("effect"))
        if effect not in TAINT_EFFECTS:
            raise r.fail(f"{at}.effect", f"must be one of {', '.join(TAINT_EFFECTS)}, got {effect!r}")
        value = _field(r, at, "value", raw.get("value"))
        taints.append({"key": key, "value": value, "effect": effect} if value else {"key": key, "effect": effect})
    return taints


def _field(r: Reader, at: str, name: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise r.fail(f"{at}.{name}", f"must be a string, got {type(value).__name__} {value!r}")
    return value


def parse_tolerations(r: Reader, path: str) -> list[dict[str, Any]]:
    """Kubernetes tolerations (core/v1 Toleration), checked as the API server validates them:
    operator Equal (default) or Exists; Exists takes no value; an empty key needs Exists;
    effect empty (every effect) or a taint effect; tolerationSeconds only with NoExecute."""
    tolerations = []
    for index, raw in enumerate(r.listing(path)):
        at = f"{path}[{index}]"
        if not isinstance(raw, Mapping):
            raise r.fail(at, "must be a mapping")
        key = _field(r, at, "key", raw.get("key"))
        operator = _field(r, at, "operator", raw.get("operator")) or "Equal"
        value = _field(r, at, "value", raw.get("value"))
        effect = _field(r, at, "effect", raw.get("effect"))
        if operator not in TOLERATION_OPERATORS:
            raise r.fail(f"{at}.operator", f"must be Equal or Exists, got {operator!r}")
        if operator == "Exists" and value:
            raise r.fail(f"{at}.value", f"must be empty when operator is Exists, got {value!r}")
        if not key and operator != "Exists":
            raise r.fail(f"{at}.operator", "must be Exists when key is empty (a toleration of every taint)")
        if effect and effect not in TAINT_EFFECTS:
            raise r.fail(f"{at}.effect", f"must be empty or one of {', '.join(TAINT_EFFECTS)}, got {effect!r}")
        toleration: dict[str, Any] = {"operator": operator}
        if key:
            toleration["key"] = r.limited(f"{at}.key", key, NAME_MAX + NAMESPACE_MAX)
        if value:
            toleration["value"] = r.limited(f"{at}.value", value, 63)
        if effect:
            toleration["effect"] = effect
        seconds = _toleration_seconds(r, at, raw.get("tolerationSeconds"), effect)
        if seconds is not None:
            toleration["tolerationSeconds"] = seconds
        tolerations.append(toleration)
    return tolerations


def _toleration_seconds(r: Reader, at: str, seconds: Any, effect: str) -> int | None:
    """``tolerationSeconds``: an integer, and only on a NoExecute toleration (as the API server)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise r.fail(f"{at}.tolerationSeconds", f"must be an integer, got {seconds!r}")
    if effect != "NoExecute":
        raise r.fail(f"{at}.tolerationSeconds", "is only valid with effect NoExecute")
    return seconds


def parse_node(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, ("v1",))
    name = r.name()
    allocatable = {
        r.key("status.allocatable", resource): r.count(f"status.allocatable[{resource}]", value, minimum=0)
        for resource, value in r.mapping("status.allocatable").items()
        if isinstance(resource, str) and is_gpu_resource(resource)
    }
    conditions = r.listing("status.conditions")
    ready, ready_since = True, None
    if conditions:
        ready, ready_since = False, None
        for index, condition in enumerate(conditions):
            if not isinstance(condition, Mapping):
                raise r.fail(f"status.conditions[{index}]", "must be a mapping")
            if condition.get("type") == "Ready":
                status = condition.get("status")
                if status not in ("True", "False", "Unknown"):
                    raise r.fail(
                        f"status.conditions[{index}].status", f"must be True, False or Unknown, got {quote(status)}"
                    )
                ready = status == "True"
                ready_since = r.time_value(
                    f"status.conditions[{index}].lastTransitionTime", condition.get("lastTransitionTime")
                )
    return Parsed(
        "Node",
        "",
        name,
        {
            "uid": r.string("metadata.uid", max_length=UID_MAX),
            "labels": r.string_map("metadata.labels"),
            "allocatable": allocatable,
            "unschedulable": r.boolean("spec.unschedulable"),
            "taints": parse_taints(r, "spec.taints"),
            "ready": ready,
            "ready_since": ready_since,
            "created": r.timestamp("metadata.creationTimestamp"),
        },
    )


def parse_vmi(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, ("kubevirt.io/v1", "kubevirt.io/v1alpha3"))
    name, namespace = r.name(), r.namespace()
    device_names = []
    for section in ("gpus", "hostDevices"):
        for index, entry in enumerate(r.listing(f"spec.domain.devices.{section}")):
            if not isinstance(entry, Mapping):
                raise r.fail(f"spec.domain.devices.{section}[{index}]", "must be a mapping")
            device_name = entry.get("deviceName")
            if device_name is not None and not isinstance(device_name, str):
                raise r.fail(f"spec.domain.devices.{section}[{index}].deviceName", "must be a string")
            if device_name:
                path = f"spec.domain.devices.{section}[{index}].deviceName"
                device_names.append(r.limited(path, device_name, NAME_MAX))
    active = {}
    for uid, node in r.mapping("status.activePods").items():
        pod_uid = r.key("status.activePods", uid)
        if node is not None and not isinstance(node, str):
            raise r.fail(f"status.activePods[{pod_uid}]", f"must be a node name, got {quote(node)}")
        active[pod_uid] = r.limited(f"status.activePods[{pod_uid}]", node or "", NAME_MAX)
    return Parsed(
        "VirtualMachineInstance",
        namespace,
        name,
        {
            "uid": r.string("metadata.uid", max_length=UID_MAX),
            "device_names": device_names,
            "active_pods": active,
            "node": r.string("status.nodeName", max_length=NAME_MAX),
            "phase": r.string("status.phase", max_length=PHASE_MAX),
        },
    )


#: The required node affinity's key in ``affinity.nodeAffinity``.
REQUIRED_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"
#: Label keys (a prefix, a slash, a name) and values, as the API server limits them.
LABEL_KEY_MAX = NAME_MAX + 63 + 1
LABEL_VALUE_MAX = 63


def parse_virtual_machine(obj: Mapping[str, Any]) -> Parsed:
    """A KubeVirt VirtualMachine: where its template says the VM may start (the template's
    ``nodeSelector``, required node affinity and ``tolerations``), which making room obeys
    when it moves the stopped VM's set. The rest of the VM is not read."""
    r = Reader(obj)
    check_api(r, ("kubevirt.io/v1",))
    name, namespace = r.name(), r.namespace()
    spec = "spec.template.spec"
    return Parsed(
        "VirtualMachine",
        namespace,
        name,
        {
            "uid": r.string("metadata.uid", max_length=UID_MAX),
            "node_selector": _label_map(r, f"{spec}.nodeSelector"),
            "affinity": parse_required_affinity(r, f"{spec}.affinity.nodeAffinity.{REQUIRED_AFFINITY}"),
            "tolerations": parse_tolerations(r, f"{spec}.tolerations"),
            "created": r.timestamp("metadata.creationTimestamp"),
        },
    )


def _label_map(r: Reader, path: str) -> dict[str, str]:
    selector = r.string_map(path)
    for key, value in selector.items():
        r.limited(f"{path}[{key}]", key, LABEL_KEY_MAX)
        r.limited(f"{path}[{key}]", value, LABEL_VALUE_MAX)
    return selector


def parse_required_affinity(r: Reader, path: str) -> list[dict[str, Any]] | None:
    """A required node affinity's ``nodeSelectorTerms`` as stored (each term's
    ``matchExpressions`` and ``matchFields``: key, operator, values), or None when there is
    none. The operators are the scheduler's (``binder.engine.matching``); anything else is
    refused naming the field."""
    if r.get(path) is None:
        return None
    terms_path = f"{path}.nodeSelectorTerms"
    terms = []
    for index, raw in enumerate(r.listing(terms_path)):
        at = f"{terms_path}[{index}]"
        if not isinstance(raw, Mapping):
            raise r.fail(at, "must be a mapping")
        terms.append(
            {
                "matchExpressions": _requirements(r, f"{at}.matchExpressions", raw.get("matchExpressions"),
                                                  LABEL_OPERATORS),
                "matchFields": _requirements(r, f"{at}.matchFields", raw.get("matchFields"), FIELD_OPERATORS),
            }
        )  # fmt: skip
    return terms


def _requirements(r: Reader, path: str, listed: Any, operators: frozenset[str]) -> list[dict[str, Any]]:
    if listed is None:
        return []
    if not isinstance(listed, list):
        raise r.fail(path, f"must be a list, got {type(listed).__name__}")
    found = []
    for index, raw in enumerate(listed):
        at = f"{path}[{index}]"
        if not isinstance(raw, Mapping):
            raise r.fail(at, "must be a mapping")
        key = _field(r, at, "key", raw.get("key"))
        if not key:
            raise r.fail(f"{at}.key", "is required")
        operator = _field(r, at, "operator", raw.get("operator"))
        if operator not in operators:
            raise r.fail(f"{at}.operator", f"must be one of {', '.join(sorted(operators))}, got {quote(operator)}")
        values = raw.get("values") or []
        if not isinstance(values, list):
            raise r.fail(f"{at}.values", f"must be a list of strings, got {quote(values)}")
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise r.fail(f"{at}.values[{i}]", f"must be a string, got {quote(value)}")
            r.limited(f"{at}.values[{i}]", value, LABEL_KEY_MAX)
        found.append({"key": r.limited(f"{at}.key", key, LABEL_KEY_MAX), "operator": operator, "values": list(values)})
    return found


def pod_requests(r: Reader) -> dict[str, int]:  # noqa: C901 - the Kubernetes rules for containers, init and sidecars
    """Effective extended-resource requests of a pod: per container the request, else the
    limit; summed over containers, and at least the largest init container's."""

    def container_requests(path: str) -> list[dict[str, int]]:
        result = []
        for index, container in enumerate(r.listing(path)):
            if not isinstance(container, Mapping):
                raise r.fail(f"{path}[{index}]", "must be a mapping")
            base = f"{path}[{index}].resources"
            resources = container.get("resources") or {}
            if not isinstance(resources, Mapping):
                raise r.fail(base, "must be a mapping")
            requests = resources.get("requests") or {}
            limits = resources.get("limits") or {}
            for label, section in (("requests", requests), ("limits", limits)):
                if not isinstance(section, Mapping):
                    raise r.fail(f"{base}.{label}", "must be a mapping")
            wanted = {}
            for resource in sorted(set(requests) | set(limits), key=str):
                if not isinstance(resource, str) or not is_gpu_resource(resource):
                    continue
                r.key(f"{base}.requests", resource)
                if resource in requests:
                    wanted[resource] = r.count(f"{base}.requests[{resource}]", requests[resource], minimum=0)
                else:
                    wanted[resource] = r.count(f"{base}.limits[{resource}]", limits[resource], minimum=0)
            result.append(wanted)
        return result

    total: dict[str, int] = {}
    for wanted in container_requests("spec.containers"):
        for resource, units in wanted.items():
            total[resource] = total.get(resource, 0) + units
    for wanted in container_requests("spec.initContainers"):
        for resource, units in wanted.items():
            total[resource] = max(total.get(resource, 0), units)
    return {resource: units for resource, units in total.items() if units > 0}


def _ref_field(r: Reader, base: str, ref: Mapping[str, Any], field: str, max_length: int) -> str:
    value = ref.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise r.fail(f"{base}.{field}", f"must be a string, got {quote(value)}")
    return r.limited(f"{base}.{field}", value, max_length)


def owner_hint(r: Reader) -> tuple[dict[str, str], str]:
    """The pod's controller owner reference and the VMI name it hints at.

    The hint is the name in a *controller* owner reference of kind VirtualMachineInstance, and
    nothing else (no label or annotation). It only says which VMI to look up; the VMI's
    ``activePods`` decides. Why so narrow: KubeVirt's virt-controller lists in ``activePods``
    every ``kubevirt.io``-labelled pod whose controller reference carries the VMI's uid, of
    whatever kind it claims; gpuplane's launcher policy (a ValidatingAdmissionPolicy) lets only
    KubeVirt's controller make pods whose controller is of kind VirtualMachineInstance. A pod
    that names the VMI's uid under another kind, or names the VMI in an annotation, is
    therefore never taken for a launcher: its GPUs count as raw usage in full.
    """
    owner: dict[str, str] = {}
    controller = False
    refs = r.listing("metadata.ownerReferences")
    for index, ref in enumerate(refs):
        if not isinstance(ref, Mapping):
            raise r.fail(f"metadata.ownerReferences[{index}]", "must be a mapping")
        if ref.get("controller") or len(refs) == 1:
            base = f"metadata.ownerReferences[{index}]"
            controller = ref.get("controller") is True
            owner = {
                field: _ref_field(r, base, ref, field, limit)
                for field, limit in (("kind", KIND_MAX), ("name", NAME_MAX), ("uid", UID_MAX))
            }
    hint = owner.get("name", "") if controller and owner.get("kind") == "VirtualMachineInstance" else ""
    return owner, hint


def parse_pod(obj: Mapping[str, Any]) -> Parsed:
    r = Reader(obj)
    check_api(r, ("v1",))
    name, namespace = r.name(), r.namespace()
    owner, hint = owner_hint(r)
    return Parsed(
        "Pod",
        namespace,
        name,
        {
            "uid": r.string("metadata.uid", required=True, max_length=UID_MAX),
            "node": r.string("spec.nodeName", max_length=NAME_MAX),
            "phase": r.string("status.phase", default="Pending", max_length=PHASE_MAX),
            "gpu_requests": pod_requests(r),
            "owner_kind": owner.get("kind", ""),
            "owner_name": owner.get("name", ""),
            "owner_uid": owner.get("uid", ""),
            "owner_vmi_hint": hint,
        },
    )

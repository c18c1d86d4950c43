"""Read Kubernetes and KubeVirt objects (as the API server or ``kubectl get -o yaml`` gives
them) into plain row values for the mirror.

One parser serves ``load_snapshot`` and the cluster sync, so a snapshot of a live
cluster and the live cluster itself land in the mirror the same way. Every problem is
reported as an :class:`ObjectError` that names the object and the field, because an
operator fixing a 5,000-object dump needs to know exactly where to look.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from binder.engine.choices import MAX_ALTERNATIVES

GROUP = "gpuplane.io"
BIND_REQUEST_ANNOTATION = "gpuplane.io/bind-request"
#: The VMI's own nodeSelector, as JSON, written by the webhook with the bind request (SPEC §5 step 4).
BIND_NODE_SELECTOR_ANNOTATION = "gpuplane.io/bind-node-selector"
PHASES = ("Pending", "Bound", "Lost")

#: Kubernetes' length limits, which the mirror's columns are sized for: object names
#: (DNS subdomains), namespace names (DNS labels), UIDs, and the bind request ids.
NAME_MAX = 253
NAMESPACE_MAX = 63
UID_MAX = 64
KIND_MAX = 64
PHASE_MAX = 32
REQUEST_ID_MAX = 128

#: The largest count the mirror's integer columns hold (PostgreSQL ``integer``, and what
#: SQLite and JSON keep exactly): unitsPerDevice, allocatable, limits, requests.
COUNT_MAX = 2**31 - 1
#: How much of a refused value an error message quotes: enough to recognise it, never a
#: tenant's megabyte of text in a log line or an admin page.
QUOTE_MAX = 40
#: Longer quantity strings are refused unparsed (Kubernetes' own quantities are short).
QUANTITY_MAX = 64

#: Extended resources that are never GPUs: KubeVirt's own device plugins.
NON_GPU_PREFIXES = ("kubernetes.io/", "devices.kubevirt.io/")


def quote(value: Any) -> str:
    """``repr(value)`` cut to :data:`QUOTE_MAX` characters: error messages quote a short
    prefix of a refused value (escaped, so a NUL or a lone surrogate is shown, not written)."""
    text = repr(value) if isinstance(value, str) else f"{type(value).__name__} {_short_repr(value)}"
    return text if len(text) <= QUOTE_MAX else text[:QUOTE_MAX] + f"... ({len(text)} characters)"


def _short_repr(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)):
        return f"of {len(value)} items"
    text = repr(value)
    return text if len(text) <= QUOTE_MAX else text[:QUOTE_MAX] + "..."


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text, or None.

    PostgreSQL's text and jsonb refuse NUL, and a lone surrogate (``"\\ud800"`` in JSON)
    is not encodable as UTF-8 on either database: one such character in one tenant's
    field used to fail the whole write, and with it the sync or the pass.
    """
    if "\x00" in value:
        return "must not contain a NUL character"
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        return "must not contain a lone surrogate (not valid Unicode text)"
    return None


def safe_text(value: str) -> str:
    """``value`` with NUL and lone surrogates escaped: safe to log and store in an error text."""
    if text_problem(value) is None:
        return value
    return "".join(repr(ch)[1:-1] if ch == "\x00" or "\ud800" <= ch <= "\udfff" else ch for ch in value)


class ObjectError(ValueError):
    """A problem with one object, naming it and the field."""

    def __init__(self, ref: str, field: str, message: str) -> None:
        self.ref, self.field, self.message = ref, field, message
        super().__init__(f"{ref}: {field}: {message}" if field else f"{ref}: {message}")


@dataclass(frozen=True)
class Parsed:
    """One parsed object: its kind, namespace ("" if cluster-scoped), name and row values."""

    kind: str
    namespace: str
    name: str
    values: dict[str, Any]


def is_gpu_resource(name: str) -> bool:
    """Extended resources worth mirroring: a ``/`` in the name, not KubeVirt's own devices."""
    return "/" in name and not name.startswith(NON_GPU_PREFIXES)


def describe(obj: Mapping[str, Any]) -> str:
    kind = obj.get("kind") or "object"
    raw_meta = obj.get("metadata")
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, Mapping) else {}
    name = meta.get("name") or meta.get("generateName") or "<no name>"
    namespace = meta.get("namespace")
    # A name that is not a string is named by its type, never str()-ed (it may be a
    # mapping of a million items); text is escaped and cut like any quoted value.
    parts = [_ref_part(part) for part in (kind, namespace, name) if part]
    return f"{parts[0]} {'/'.join(parts[1:])}" if len(parts) > 1 else parts[0]


def _ref_part(value: Any) -> str:
    if not isinstance(value, str):
        return f"<{type(value).__name__}>"
    text = safe_text(value)
    return text if len(text) <= NAME_MAX else text[:QUOTE_MAX] + "..."


class _Reader:
    """Typed access to one object's fields, raising ObjectError with the field path."""

    def __init__(self, obj: Mapping[str, Any]) -> None:
        self.obj = obj
        self.ref = describe(obj)

    def fail(self, field: str, message: str) -> ObjectError:
        return ObjectError(self.ref, field, message)

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.obj
        walked: list[str] = []
        for part in path.split("."):
            if node is None:
                return default
            if not isinstance(node, Mapping):
                raise self.fail(".".join(walked), f"must be a mapping, got {type(node).__name__}")
            walked.append(part)
            node = node.get(part)
        return default if node is None else node

    def string(self, path: str, *, required: bool = False, default: str = "", max_length: int | None = None) -> str:
        value = self.get(path)
        if value is None or value == "":
            if required:
                raise self.fail(path, "is required")
            return default
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, got {quote(value)}")
        return self.limited(path, value, max_length)

    def limited(self, path: str, value: str, max_length: int | None) -> str:
        """``value``, if it is storable text and fits the mirror's column (Kubernetes' own limits)."""
        self.text(path, value)
        if max_length is not None and len(value) > max_length:
            raise self.fail(path, f"must be at most {max_length} characters, got {len(value)}")
        return value

    def text(self, path: str, value: str) -> str:
        """``value`` if it is text both databases can store (no NUL, no lone surrogate)."""
        problem = text_problem(value)
        if problem is not None:
            raise self.fail(path, f"{problem}, got {quote(value)}")
        return value

    def key(self, path: str, key: Any) -> str:
        """A map key that becomes a JSON key in the mirror: a string, storable, of sane length."""
        if not isinstance(key, str):
            raise self.fail(path, f"keys must be strings, got {quote(key)}")
        return self.limited(f"{path}[{safe_text(key)[:QUOTE_MAX]}]", key, NAME_MAX)

    def mapping(self, path: str) -> dict[str, Any]:
        value = self.get(path)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)

    def string_map(self, path: str) -> dict[str, str]:
        result = {}
        for key, value in self.mapping(path).items():
            name = self.key(path, key)
            if not isinstance(value, str):
                raise self.fail(f"{path}[{name}]", f"must be a string, got {quote(value)}")
            result[name] = self.text(f"{path}[{name}]", value)
        return result

    def listing(self, path: str) -> list[Any]:
        value = self.get(path)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list, got {type(value).__name__}")
        return value

    def boolean(self, path: str, default: bool = False) -> bool:
        value = self.get(path)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {quote(value)}")
        return value

    def integer(self, path: str, *, default: int | None = None, minimum: int | None = None) -> int:
        value = self.get(path)
        if value is None:
            if default is None:
                raise self.fail(path, "is required")
            return default
        return self.count(path, value, minimum=minimum)

    def count(self, path: str, value: Any, *, minimum: int | None = None) -> int:
        """A whole-number quantity already read (map values whose keys hold dots)."""
        units = self.units(path, value)
        if units > COUNT_MAX:
            raise self.fail(path, f"must be at most {COUNT_MAX}, got {quote(value)}")
        if minimum is not None and units < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {units}")
        return units

    def units(self, path: str, value: Any) -> int:
        """A whole-number quantity (``2``, ``"2"``, ``"1k"``)."""
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise self.fail(path, f"must be a whole number, got {quote(value)}")
        if isinstance(value, str) and len(value) > QUANTITY_MAX:
            raise self.fail(path, f"is not a Kubernetes quantity: {quote(value)}")
        try:
            quantity = parse_quantity(value)
        except (ValueError, ArithmeticError):
            raise self.fail(path, f"is not a Kubernetes quantity: {quote(value)}") from None
        if not quantity.is_finite() or abs(quantity) > COUNT_MAX:
            # before to_integral_value and int(): "1e5000" would become a 5,000-digit int
            raise self.fail(path, f"must be at most {COUNT_MAX}, got {quote(value)}")
        if quantity != quantity.to_integral_value():
            raise self.fail(path, f"must be a whole number of units, got {quote(value)}")
        return int(Decimal(quantity))

    def timestamp(self, path: str) -> datetime | None:
        return self.time_value(path, self.get(path))

    def time_value(self, path: str, value: Any) -> datetime | None:
        if value is None or value == "":
            return None
        if isinstance(value, datetime):  # YAML loaders may already parse timestamps
            parsed = value
        elif isinstance(value, str):
            try:
                parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise self.fail(path, f"is not an RFC 3339 time: {quote(value)}") from None
        else:
            raise self.fail(path, f"is not an RFC 3339 time: {quote(value)}")
        if parsed.tzinfo is None:
            raise self.fail(path, f"needs a time zone (e.g. a trailing Z): {quote(value)}")
        try:
            return parsed.astimezone(UTC)  # PostgreSQL takes offsets only up to ±15:59
        except OverflowError:
            raise self.fail(path, f"is outside the years 1-9999 in UTC: {quote(value)}") from None

    def name(self, max_length: int = NAME_MAX) -> str:
        return self.string("metadata.name", required=True, max_length=max_length)

    def namespace(self) -> str:
        return self.string("metadata.namespace", required=True, max_length=NAMESPACE_MAX)


def _check_api(r: _Reader, expected: tuple[str, ...]) -> None:
    api = r.string("apiVersion", required=True)
    if api not in expected:
        raise r.fail("apiVersion", f"must be {' or '.join(expected)}, got {quote(api)}")


def parse_namespace(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, ("v1",))
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


def parse_taints(r: _Reader, path: str) -> list[dict[str, str]]:
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


def _field(r: _Reader, at: str, name: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise r.fail(f"{at}.{name}", f"must be a string, got {type(value).__name__} {value!r}")
    return value


def parse_tolerations(r: _Reader, path: str) -> list[dict[str, Any]]:
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


def _toleration_seconds(r: _Reader, at: str, seconds: Any, effect: str) -> int | None:
    """``tolerationSeconds``: an integer, and only on a NoExecute toleration (as the API server)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise r.fail(f"{at}.tolerationSeconds", f"must be an integer, got {seconds!r}")
    if effect != "NoExecute":
        raise r.fail(f"{at}.tolerationSeconds", "is only valid with effect NoExecute")
    return seconds


def parse_node(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, ("v1",))
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


def parse_gpu_class(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, (f"{GROUP}/v1alpha1",))
    name = r.name()
    resource = r.string("spec.resourceName", required=True, max_length=NAME_MAX)
    if "/" not in resource:
        raise r.fail("spec.resourceName", f"must be an extended resource name with a '/', got {quote(resource)}")
    return Parsed(
        "GPUClass",
        "",
        name,
        {
            "resource_name": resource,
            "units_per_device": r.integer("spec.unitsPerDevice", default=1, minimum=1),
            "node_selector": r.string_map("spec.nodeSelector"),
            "tolerations": parse_tolerations(r, "spec.tolerations"),
            "display_name": r.string("spec.displayName", max_length=NAME_MAX),
            "created": r.timestamp("metadata.creationTimestamp"),
            "status_allocatable": r.integer("status.allocatable", default=0),
            "status_bound": r.integer("status.bound", default=0),
            "status_lost": r.integer("status.lost", default=0),
        },
    )


def parse_bind_node_selector(r: _Reader, annotations: Mapping[str, str]) -> dict[str, str]:
    """The ``gpuplane.io/bind-node-selector`` annotation: a JSON object of label -> value.

    Anything else is refused naming the annotation: guessing would place the set where
    the VMI's launcher cannot run, or nowhere.
    """
    raw = annotations.get(BIND_NODE_SELECTOR_ANNOTATION, "")
    field = f"metadata.annotations[{BIND_NODE_SELECTOR_ANNOTATION}]"
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise r.fail(field, f"is not JSON: {raw[:80]!r}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise r.fail(field, f"must be a JSON object of label names to string values, got {raw[:80]!r}")
    return value


def parse_alternatives(r: _Reader, class_name: str) -> list[str]:
    """``spec.alternativeClassNames``: further classes, in order of preference, after
    ``spec.className``: distinct names, none repeating ``spec.className``, at most
    ``MAX_ALTERNATIVES``. A list that breaks these is refused, naming the entry: guessing
    which duplicate the tenant meant would change what the order may be placed as."""
    path = "spec.alternativeClassNames"
    entries = r.listing(path)
    if len(entries) > MAX_ALTERNATIVES:
        raise r.fail(path, f"must list at most {MAX_ALTERNATIVES} classes, got {len(entries)}")
    names: list[str] = []
    for index, entry in enumerate(entries):
        at = f"{path}[{index}]"
        if not isinstance(entry, str) or not entry:
            raise r.fail(at, f"must be a class name, got {quote(entry)}")
        name = r.limited(at, entry, NAME_MAX)
        if name == class_name:
            raise r.fail(at, f"repeats spec.className {quote(name)}")
        if name in names:
            raise r.fail(at, f"lists {quote(name)} twice")
        names.append(name)
    return names


def parse_gpu(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, (f"{GROUP}/v1alpha1",))
    name, namespace = r.name(), r.namespace()
    phase = r.string("status.phase", default="Pending")
    if phase not in PHASES:
        raise r.fail("status.phase", f"must be one of {', '.join(PHASES)}, got {quote(phase)}")
    node = r.string("status.node", max_length=NAME_MAX)
    if phase == "Bound" and not node:
        raise r.fail("status.node", "is required when status.phase is Bound")
    if phase != "Bound" and node:
        raise r.fail("status.node", f"must be empty when status.phase is {phase}")
    annotations = r.string_map("metadata.annotations")
    class_name = r.string("spec.className", required=True, max_length=NAME_MAX)
    return Parsed(
        "GPU",
        namespace,
        name,
        {
            "class_name": class_name,
            "alternative_class_names": parse_alternatives(r, class_name),
            "vm_name": r.string("spec.vmName", required=True, max_length=NAME_MAX),
            "phase": phase,
            "node": node,
            "since": r.timestamp("status.since"),
            "reason": r.string("status.reason"),
            "bind_request": r.limited(
                f"metadata.annotations[{BIND_REQUEST_ANNOTATION}]",
                annotations.get(BIND_REQUEST_ANNOTATION, ""),
                REQUEST_ID_MAX,
            ),
            "bind_node_selector": parse_bind_node_selector(r, annotations),
            "answered_request": r.string("status.answeredRequest", max_length=REQUEST_ID_MAX),
            "answer": r.string("status.answer"),
            "created": r.timestamp("metadata.creationTimestamp"),
            "status_class_name": r.string("status.className", max_length=NAME_MAX) if phase != "Pending" else "",
        },
    )


def parse_gpu_budget(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, (f"{GROUP}/v1alpha1",))
    name, namespace = r.name(), r.namespace()
    limits = {
        r.key("spec.limits", k): r.count(f"spec.limits[{k}]", v, minimum=0) for k, v in r.mapping("spec.limits").items()
    }
    used = {
        r.key("status.used", k): r.count(f"status.used[{k}]", v, minimum=0) for k, v in r.mapping("status.used").items()
    }
    return Parsed("GPUBudget", namespace, name, {"limits": limits, "used": used})


def parse_vmi(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, ("kubevirt.io/v1", "kubevirt.io/v1alpha3"))
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


def pod_requests(r: _Reader) -> dict[str, int]:  # noqa: C901 - the Kubernetes rules for containers, init and sidecars
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


def _ref_field(r: _Reader, base: str, ref: Mapping[str, Any], field: str, max_length: int) -> str:
    value = ref.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise r.fail(f"{base}.{field}", f"must be a string, got {quote(value)}")
    return r.limited(f"{base}.{field}", value, max_length)


def owner_hint(r: _Reader) -> tuple[dict[str, str], str]:
    """The pod's controller owner reference and the VMI name it hints at.

    The hint is the owner reference of kind VirtualMachineInstance, else the
    ``kubevirt.io/domain`` annotation. It only says which VMI to look up (SPEC §2).
    """
    owner: dict[str, str] = {}
    refs = r.listing("metadata.ownerReferences")
    for index, ref in enumerate(refs):
        if not isinstance(ref, Mapping):
            raise r.fail(f"metadata.ownerReferences[{index}]", "must be a mapping")
        if ref.get("controller") or len(refs) == 1:
            base = f"metadata.ownerReferences[{index}]"
            owner = {
                field: _ref_field(r, base, ref, field, limit)
                for field, limit in (("kind", KIND_MAX), ("name", NAME_MAX), ("uid", UID_MAX))
            }
    hint = owner.get("name", "") if owner.get("kind") == "VirtualMachineInstance" else ""
    if not hint:
        hint = r.limited(
            "metadata.annotations[kubevirt.io/domain]",
            r.string_map("metadata.annotations").get("kubevirt.io/domain", ""),
            NAME_MAX,
        )
    return owner, hint


def parse_pod(obj: Mapping[str, Any]) -> Parsed:
    r = _Reader(obj)
    _check_api(r, ("v1",))
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


PARSERS = {
    "Namespace": parse_namespace,
    "Node": parse_node,
    "Pod": parse_pod,
    "VirtualMachineInstance": parse_vmi,
    "GPUClass": parse_gpu_class,
    "GPU": parse_gpu,
    "GPUBudget": parse_gpu_budget,
}

#: The API group each mirrored kind belongs to ("" is the core group).
GROUPS = {
    "Namespace": "",
    "Node": "",
    "Pod": "",
    "VirtualMachineInstance": "kubevirt.io",
    "GPUClass": GROUP,
    "GPU": GROUP,
    "GPUBudget": GROUP,
}


def api_group(api_version: Any) -> str | None:
    """``kubevirt.io/v1`` -> ``kubevirt.io``; ``v1`` -> ``""``; None if not a string."""
    if not isinstance(api_version, str) or not api_version:
        return None
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def parse_object(obj: Any, where: str = "") -> Parsed | None:
    """Parse one object; None for kinds gpuplane does not mirror."""
    if not isinstance(obj, Mapping):
        raise ObjectError(where or "document", "", f"must be a Kubernetes object (a mapping), got {type(obj).__name__}")
    kind = obj.get("kind")
    if not kind or not isinstance(kind, str):
        raise ObjectError(describe(obj) + (f" ({where})" if where else ""), "kind", "is required")
    parser = PARSERS.get(kind)
    if parser is None:
        return None
    group = api_group(obj.get("apiVersion"))
    if group is not None and group != GROUPS[kind]:
        return None  # a same-named kind of another API group (e.g. a vendor's "GPU")
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise ObjectError(describe(obj), "metadata", "is required and must be a mapping")
    parsed = parser(obj)
    _check_stored(describe(obj), parsed.values)
    return parsed


def _check_stored(ref: str, values: Mapping[str, Any]) -> None:
    """The last guard before the database: no text the mirror would write holds a NUL or
    a lone surrogate, whichever field a parser forgot (the field named as the mirror's)."""

    def walk(path: str, value: Any) -> None:
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                raise ObjectError(ref, path, f"{problem}, got {quote(value)}")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{path} (a key)", key)
                walk(f"{path}[{safe_text(str(key))[:QUOTE_MAX]}]", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{path}[{index}]", item)

    for field, value in values.items():
        walk(field, value)

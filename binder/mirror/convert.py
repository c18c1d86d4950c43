"""Mirror rows and parsed objects into the engine's dataclasses: pure, no Django.

Rows and parsed Kubernetes objects carry the same field names (the model's), so one
converter per kind serves both, and every consumer (passes, the admin, the catalog, the
webhook, usage records) gets the same engine view. Kept free of Django so that engine
and parser tests import it without settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from sys import intern
from typing import Any

from binder.engine import types as e
from binder.kube.kinds import KINDS
from binder.kube.objects import Parsed

Values = Mapping[str, Any]


def _ints(mapping: Mapping[str, Any] | None) -> dict[str, int]:
    return {intern(str(k)): int(v) for k, v in (mapping or {}).items()}


#: Shared unit maps by content (see :func:`_shared_ints`), at most :data:`_SHARED_AT_MOST`.
_SHARED_INTS: dict[tuple[tuple[str, int], ...], dict[str, int]] = {}
_SHARED_AT_MOST = 4096


def _shared_ints(mapping: Mapping[str, Any] | None) -> dict[str, int]:
    """:func:`_ints`, one dict for every record with the same units (records are never
    mutated): 100k nodes have a few kinds of allocatable and 150k pods a dozen kinds of
    GPU requests, each row read bringing a dict of its own (~200 bytes each)."""
    ints = _ints(mapping)
    content = tuple(ints.items())
    shared = _SHARED_INTS.get(content)
    if shared is not None:
        return shared
    if len(_SHARED_INTS) < _SHARED_AT_MOST:
        _SHARED_INTS[content] = ints
    return ints


def _strings(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy with keys and string values interned: 100k nodes carry the same dozen label
    keys and mostly the same values (each row read brings its own copies: 1.4 KB a node)."""
    return {intern(k): intern(v) if type(v) is str else v for k, v in (mapping or {}).items()}


PHASES = {phase.value: phase for phase in e.Phase}


class _Times:
    """Hands back the datetime it was last given when the next one is equal.

    A set's devices are ordered, bound and moved together, so they carry the same
    ``since`` and ``created``; rows are read in id order, so a set's devices come one
    after another. Each row read brings datetimes of its own (48 bytes each): at 1M
    devices in 385k sets, sharing equal neighbours keeps 380k of them instead of 2M
    (and a checkpoint pickles each once).
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: datetime | None = None

    def __call__(self, at: datetime | None) -> datetime | None:
        if at is None:
            return None
        last = self._last
        if last is not None and at == last and at.tzinfo is last.tzinfo:
            return last
        self._last = at
        return at


_since = _Times()
_created = _Times()

# Converters take the namespace, the name and then the model fields of KINDS in order:
# positional, because building 100k records is a large share of a pass.


def device_from(
    namespace: str,
    name: str,
    class_name: str,
    vm_name: str,
    phase: str,
    node: str,
    since: datetime | None,
    reason: str,
    bind_request: str,
    answered_request: str,
    answer: str,
    created: datetime | None,
    bind_node_selector: Values | None = None,
    alternative_class_names: list[str] | None = None,
    status_class_name: str = "",
    borrowed: bool = False,
    reclaim_for: str = "",
    reason_code: str | None = "",
    admitted: datetime | None = None,
    keep_node: bool = False,
) -> e.Device:
    phase_ = PHASES[phase]
    choices: tuple[str, ...] = ()
    held_as = class_name
    if alternative_class_names:
        # The engine books a device by the class it is held as (status.className while
        # Bound or Lost); without alternatives that is always spec.className.
        choices = tuple(intern(c) for c in (class_name, *alternative_class_names))
        if status_class_name and phase_ is not e.Phase.PENDING:
            held_as = status_class_name
    # Interned: a million devices name a few classes, thousands of nodes and a few dozen
    # reasons; each row read brings its own copy of each string (~200 bytes a device).
    return e.Device(
        namespace,
        name,
        intern(held_as),
        intern(vm_name),
        phase_,
        intern(node),
        _since(since),
        intern(reason),
        bind_request,
        answered_request,
        answer,
        _created(created),
        dict(bind_node_selector) if bind_node_selector else _NO_SELECTOR,
        choices,
        bool(borrowed) and phase_ is not e.Phase.PENDING,
        intern(reclaim_for) if reclaim_for and phase_ is not e.Phase.PENDING else "",
        intern(reason_code) if reason_code else "",
        _since(admitted) if admitted else None,
        bool(keep_node),
    )


#: The nodeSelector of every device without one, shared (records are never mutated).
_NO_SELECTOR: dict[str, str] = {}


def tolerations_from(raw: Any) -> tuple[e.Toleration, ...]:
    """Stored tolerations (the Kubernetes spelling the parser checked) as engine records."""
    return tuple(
        e.Toleration(
            str(t.get("key") or ""),
            str(t.get("operator") or "Equal"),
            str(t.get("value") or ""),
            str(t.get("effect") or ""),
            None if t.get("tolerationSeconds") is None else int(t["tolerationSeconds"]),
        )
        for t in raw or ()
    )


def taints_from(raw: Any) -> tuple[e.Taint, ...]:
    """Stored node taints as engine records."""
    return tuple(e.Taint(str(t["key"]), str(t.get("value") or ""), str(t["effect"])) for t in raw or ())


def class_from(
    namespace: str,
    name: str,
    resource_name: str,
    units: int,
    selector: Values | None,
    display: str,
    tolerations: list[Any] | None = None,
) -> e.GpuClass:
    return e.GpuClass(name, resource_name, int(units), dict(selector or {}), display, tolerations_from(tolerations))


def node_from(
    namespace: str,
    name: str,
    allocatable: Values | None,
    labels: Values | None,
    unschedulable: bool,
    ready: bool,
    ready_since: datetime | None,
    taints: list[Any] | None = None,
) -> e.Node:
    allocatable_ = _shared_ints(allocatable)
    return e.Node(intern(name), allocatable_, _strings(labels), unschedulable, ready, ready_since, taints_from(taints))


def budget_from(namespace: str, name: str, limits: Values | None, borrowing: Values | None = None) -> e.Budget:
    return e.Budget(namespace, name, _ints(limits), _ints(borrowing) if borrowing else _NO_BORROWING)


#: The borrowing of every budget without one, shared (records are never mutated).
_NO_BORROWING: dict[str, int] = {}


def vmi_from(
    namespace: str,
    name: str,
    uid: str,
    active_pods: Values | None,
    node: str,
    phase: str,
    device_names: list[str] | None,
) -> e.Vmi:
    return e.Vmi(
        namespace, intern(name), uid, _strings(active_pods), intern(node), intern(phase), tuple(device_names or ())
    )


def terms_from(raw: Any) -> tuple[e.Term, ...] | None:
    """A stored required node affinity (``parse_required_affinity``) as engine terms; None: none."""
    if raw is None:
        return None
    return tuple(
        e.Term(
            tuple(e.Requirement(str(q["key"]), str(q["operator"]), tuple(q.get("values") or ())) for q in
                  term.get("matchExpressions") or ()),
            tuple(e.Requirement(str(q["key"]), str(q["operator"]), tuple(q.get("values") or ())) for q in
                  term.get("matchFields") or ()),
        )
        for term in raw
    )  # fmt: skip


def vm_from(
    namespace: str, name: str, node_selector: Values | None, affinity: Any, tolerations: list[Any] | None
) -> e.VirtualMachine:
    return e.VirtualMachine(
        namespace, intern(name), _strings(node_selector), terms_from(affinity), tolerations_from(tolerations)
    )


def pod_from(
    namespace: str, name: str, uid: str, node: str, phase: str, requests: Values | None, owner_vmi_hint: str
) -> e.Pod:
    return e.Pod(namespace, name, uid, intern(node), intern(phase), _shared_ints(requests), intern(owner_vmi_hint))


#: kind -> (converter, the model fields the converter takes after namespace and name), from
#: each kind's row of ``binder.kube.kinds.KINDS`` (the converter named there, defined here).
CONVERTERS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    k.kind: (globals()[k.converter], k.row_fields) for k in KINDS if k.converter
}


def from_parsed(parsed: Parsed) -> Any:
    """The engine record of a parsed Kubernetes object (tests and the cluster sync use it)."""
    convert, fields = CONVERTERS[parsed.kind]
    # The lending fields may be missing from an object parser that does not read them:
    # then nothing is borrowed, marked or allowed to borrow.
    values = parsed.values
    return convert(
        parsed.namespace, parsed.name, *(values[f] if f in values or f not in OPTIONAL_FIELDS else None for f in fields)
    )


#: Fields a parsed object may lack, read as nothing: the lending fields (an object parsed
#: before the parsers read them) and the reason's code, which the binder keeps in the
#: mirror beside ``status.reason`` (no parser reads it from an object).
OPTIONAL_FIELDS = frozenset({"borrowing", "borrowed", "reclaim_for", "reason_code", "keep_node"})

"""Plain, immutable records the engine reads and writes.

The binder's rules must be testable without a database or a cluster, and the same
rules must run whether the objects came from PostgreSQL, SQLite or the API server.
So the engine speaks only in these dataclasses: the Django side (``binder.runtime.passes``)
and the Kubernetes side translate to and from them, and nothing here imports Django.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


def quick_records(*classes: type) -> None:
    """Give frozen slotted dataclasses a constructor that costs what a mutable one does.

    A frozen dataclass's generated ``__init__`` sets each field through
    ``object.__setattr__`` (a call per field, to get past the frozen ``__setattr__``):
    about 3.5 µs for a 14-field :class:`Device`, and a worker at 1M devices builds a million
    of them on every start (reading the mirror, or unpickling a checkpoint) and hundreds of
    thousands in a large pass. Instead each class gets a ``__new__`` with the same signature
    that fills an instance of a mutable twin (the same slots, so the same memory layout) by
    plain attribute stores and then makes it an instance of the class: about 0.5 µs. The
    records stay frozen (the class's own ``__setattr__`` still refuses every change),
    ``dataclasses.replace``, equality and hashing are untouched, and mypy reads the
    dataclass's signature as before.

    Each also gets a ``__reduce__`` to that constructor with its fields in order: the
    default for slotted dataclasses calls a Python ``__getstate__``/``__setstate__`` per
    object (and could not call this ``__new__`` without arguments).
    """
    for cls in classes:
        _quicken(cls)


_NO_DEFAULT: Any = object()


def _quicken(cls: Any) -> None:
    fields = dataclasses.fields(cls)
    names = tuple(f.name for f in fields)
    if cls.__slots__ != names or hasattr(cls, "__post_init__") or any(not f.init or f.kw_only for f in fields):
        raise TypeError(f"{cls.__name__}: quick_records needs a slotted dataclass of plain init fields")
    twin = type(f"_{cls.__name__}Fields", (), {"__slots__": names})
    scope: dict[str, Any] = {"_new": object.__new__, "_Twin": twin, "_NO_DEFAULT": _NO_DEFAULT}
    params, lines = [], []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            scope[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
            lines.append(f"    self.{f.name} = {f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"_f_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_NO_DEFAULT")
            lines.append(f"    self.{f.name} = _f_{f.name}() if {f.name} is _NO_DEFAULT else {f.name}")
        else:
            params.append(f.name)
            lines.append(f"    self.{f.name} = {f.name}")
    source = "\n".join(
        [f"def __new__(cls, {', '.join(params)}):", "    self = _new(_Twin)", *lines, "    self.__class__ = cls",
         "    return self"]
    )  # fmt: skip
    exec(source, scope)  # noqa: S102 - generated from the dataclass's own fields, as dataclasses does
    new = scope["__new__"]
    new.__qualname__ = f"{cls.__qualname__}.__new__"
    cls.__new__ = staticmethod(new)
    del cls.__init__  # object.__init__ accepts the arguments once __new__ is overridden
    get = operator.attrgetter(*names)
    if len(names) == 1:
        cls.__reduce__ = lambda self: (cls, (get(self),))
    else:
        cls.__reduce__ = lambda self: (cls, get(self))


#: Label that tells the binder to move every held set off a node: a draining node takes
#: no new set, and the sets on it are moved elsewhere (or become Lost).
DRAIN_LABEL = "gpuplane.io/drain"


def is_draining(labels: Mapping[str, object]) -> bool:
    """A node labelled ``gpuplane.io/drain=true`` (any case) is being drained: the value is
    compared without case, as staff type it."""
    return str(labels.get(DRAIN_LABEL, "")).lower() == "true"


#: Taint effects that keep new pods off a node; PreferNoSchedule is only a preference.
BLOCKING_TAINT_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
#: Taints the node lifecycle controller writes (not-ready, unreachable, unschedulable, ...):
#: the Ready and cordon rules already cover what they mean, so they do not count twice.
NODE_LIFECYCLE_TAINT_PREFIX = "node.kubernetes.io/"

#: Pod phases that hold nothing: KubeVirt leaves finished pods in activePods for a while.
FINISHED_POD_PHASES = frozenset({"Succeeded", "Failed"})


class Phase(enum.StrEnum):
    """Phase of one GPU device: Pending (not placed), Bound (held on a node) or Lost (its
    node went away and no other had room; still held against the budget)."""

    PENDING = "Pending"
    BOUND = "Bound"
    LOST = "Lost"


HELD_PHASES = frozenset({Phase.BOUND, Phase.LOST})


@dataclass(frozen=True, slots=True)
class Taint:
    """One ``spec.taints`` entry of a node."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"

    @property
    def blocks_new(self) -> bool:
        """Keeps new devices off the node unless their class tolerates it: NoSchedule or
        NoExecute, and not one of the lifecycle taints the Ready and cordon rules handle."""
        return self.effect in BLOCKING_TAINT_EFFECTS and not self.key.startswith(NODE_LIFECYCLE_TAINT_PREFIX)


@dataclass(frozen=True, slots=True)
class Toleration:
    """One Kubernetes toleration, as a GPUClass lists it and the webhook adds it to a VMI."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    toleration_seconds: int | None = None

    def tolerates(self, taint: Taint) -> bool:
        """Kubernetes' own rule (core/v1 ``Toleration.ToleratesTaint``): an empty effect
        matches every effect, an empty key (with ``Exists``) every key; ``Exists`` ignores
        the value, ``Equal`` compares it."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator == "Exists":
            return True
        return self.operator in ("", "Equal") and self.value == taint.value

    def as_kubernetes(self) -> dict[str, object]:
        """The toleration as the Kubernetes API spells it (empty fields left out)."""
        out: dict[str, object] = {}
        if self.key:
            out["key"] = self.key
        out["operator"] = self.operator or "Equal"
        if self.value:
            out["value"] = self.value
        if self.effect:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


#: The node field a required node affinity pins by (the only field the scheduler supports).
NAME_FIELD = "metadata.name"


@dataclass(frozen=True, slots=True)
class Requirement:
    """One node selector requirement (``matchExpressions`` on labels, ``matchFields`` on fields)."""

    key: str
    operator: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Term:
    """One ``nodeSelectorTerms`` entry: its requirements are ANDed; terms are ORed."""

    expressions: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuClass:
    """A kind of GPU a tenant may order: which raw node resource it takes and how much,
    where it may go (``node_selector``) and which node taints it tolerates."""

    name: str
    resource_name: str
    units_per_device: int = 1
    node_selector: Mapping[str, str] = field(default_factory=dict)
    display_name: str = ""
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the binder needs it: GPU allocatable, labels, cordon, readiness and taints.

    ``ready_since`` is the Ready condition's lastTransitionTime; with ``ready`` False it
    says since when the node is not Ready (the grace period counts from it).
    """

    name: str
    allocatable: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    ready: bool = True
    ready_since: datetime | None = None
    taints: tuple[Taint, ...] = ()

    @property
    def draining(self) -> bool:
        return is_draining(self.labels)


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU object: a device a tenant ordered for one VM, and where it stands."""

    namespace: str
    name: str
    class_name: str
    vm_name: str
    phase: Phase = Phase.PENDING
    node: str = ""
    since: datetime | None = None
    reason: str = ""
    bind_request: str = ""
    answered_request: str = ""
    answer: str = ""
    created: datetime | None = None
    bind_node_selector: Mapping[str, str] = field(default_factory=dict)
    """The VMI's own ``spec.nodeSelector``, written by the webhook with the bind request:
    while the request is unanswered the set goes only to nodes carrying these labels."""
    choices: tuple[str, ...] = ()
    """The classes the device accepts, in order of preference: ``spec.className`` then
    ``spec.alternativeClassNames``; empty when it lists no alternatives. ``class_name`` is
    the class the engine books the device by: the one it is held as while Bound or Lost
    (``status.className``), ``spec.className`` while Pending."""
    borrowed: bool = False
    """``status.borrowed``: the set is held beyond its tenant's limits on GPUs no entitled
    set was waiting for (lending), so it may be taken back while its VM is not running."""
    reclaim_for: str = ""
    """``status.reclaimFor``: ``<namespace>/<vm>`` of the waiting set this borrowed set's
    GPUs are wanted back for; empty while nobody waits for them."""
    reason_code: str = ""
    """What kind of reason ``reason`` is (a :class:`binder.engine.reasons.Code` value): what
    code switches on, so nothing reads the sentence's words. Empty for a reason written
    before codes were kept."""
    admitted: datetime | None = None
    """The admitted stamp, on a set's first member only: when the webhook last allowed a VMI
    pinned to where the set is Bound (written on the mirror's row; an older release wrote it as
    the ``gpuplane.io/admitted`` annotation, still read). Its write and a pass's move of the
    set exclude each other (``binder.runtime.admissions``), so a record that differs from the
    one a pass decided from makes the pass leave the set where it is."""
    keep_node: bool = False
    """The ``gpuplane.io/keep-node: "true"`` annotation: the VM is tied to its node (node-local
    storage, say), so its set is never moved to make room for another."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def set_key(self) -> tuple[str, str]:
        return (self.namespace, self.vm_name)

    @property
    def held(self) -> bool:
        return self.phase in HELD_PHASES

    @property
    def wants_answer(self) -> bool:
        return bool(self.bind_request) and self.bind_request != self.answered_request

    def placed(
        self,
        class_name: str,
        phase: Phase,
        node: str,
        since: datetime | None,
        reason: str,
        answered_request: str | None = None,
        answer: str | None = None,
        borrowed: bool | None = None,
        reclaim_for: str | None = None,
        reason_code: str | None = None,
    ) -> Device:
        """This device with the fields a pass decides (``answered_request``, ``answer``,
        ``borrowed``, ``reclaim_for`` and ``reason_code`` kept unless given): what ``dataclasses.replace``
        gives, in half its time (a pass binding 10k orders copies some 50k records). Every other field is carried over;
        ``tests/engine/test_engine.py`` holds the two equal for every field."""
        return Device(
            self.namespace,
            self.name,
            class_name,
            self.vm_name,
            phase,
            node,
            since,
            reason,
            self.bind_request,
            self.answered_request if answered_request is None else answered_request,
            self.answer if answer is None else answer,
            self.created,
            self.bind_node_selector,
            self.choices,
            self.borrowed if borrowed is None else borrowed,
            self.reclaim_for if reclaim_for is None else reclaim_for,
            self.reason_code if reason_code is None else reason_code,
            self.admitted,
            self.keep_node,
        )


@dataclass(frozen=True, slots=True)
class Budget:
    """One GPUBudget: limits per key (a class name, or a raw resource name with a ``/``),
    and ``borrowing``: units per key the tenant may hold beyond that key's limit while
    no entitled set waits for the GPUs (lending)."""

    namespace: str
    name: str
    limits: Mapping[str, int] = field(default_factory=dict)
    borrowing: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Vmi:
    """The parts of a VirtualMachineInstance the launcher rule reads.

    ``active_pods`` is ``status.activePods``: pod UID to node name ("" while unbound).
    """

    namespace: str
    name: str
    uid: str = ""
    active_pods: Mapping[str, str] = field(default_factory=dict)
    node: str = ""
    phase: str = ""
    device_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class VirtualMachine:
    """The parts of a KubeVirt VirtualMachine making room reads: where its template says the
    VM may start (the VMI it creates carries these), so a stopped VM's set moves only where
    its next start can follow.

    ``affinity`` is the template's required node affinity terms (ORed), None when it has
    none; an empty tuple is a required affinity no node satisfies."""

    namespace: str
    name: str
    node_selector: Mapping[str, str] = field(default_factory=dict)
    affinity: tuple[Term, ...] | None = None
    tolerations: tuple[Toleration, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Pod:
    """A pod that requests GPU resources.

    ``requests`` holds the effective request per extended resource (request, else limit),
    already parsed to integers. ``owner_vmi`` is only a hint: the name of the VMI the
    pod's owner reference or labels point at. It is never proof: whoever creates the pod
    writes those, and only the VMI's own ``status.activePods`` proves a launcher.
    """

    namespace: str
    name: str
    uid: str
    node: str = ""
    phase: str = "Running"
    requests: Mapping[str, int] = field(default_factory=dict)
    owner_vmi: str = ""

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_POD_PHASES


class DefaultBudget(enum.StrEnum):
    """What a tenant without a GPUBudget may use (``GPUPLANE_DEFAULT_BUDGET``)."""

    UNLIMITED = "unlimited"
    DENY = "deny"


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings (``GPUPLANE_*``) the engine obeys; the rest concern the Django side."""

    enabled: bool = True
    node_grace_seconds: int = 300
    default_budget: DefaultBudget = DefaultBudget.UNLIMITED
    moves_per_pass: int = 16
    """``GPUPLANE_MOVES_PER_PASS``: at most this many sets move in one pass to make room."""
    move_grace_seconds: int = 120
    """``GPUPLANE_MOVE_GRACE_SECONDS``: a set admitted (``Device.admitted``) more recently than
    this does not move to make room (its VM is probably starting); an over-booked node keeps it
    for at most ``pass_state.VMI_MIRRORED_SECONDS`` of that (its VMI may not be mirrored yet, and
    a move would leave it pinned where the set is not)."""


@dataclass(frozen=True, slots=True)
class Cluster:
    """Everything one pass reads, taken at one moment (``now``)."""

    now: datetime
    classes: tuple[GpuClass, ...] = ()
    nodes: tuple[Node, ...] = ()
    devices: tuple[Device, ...] = ()
    budgets: tuple[Budget, ...] = ()
    vmis: tuple[Vmi, ...] = ()
    pods: tuple[Pod, ...] = ()
    settings: Settings = field(default_factory=Settings)
    virtual_machines: tuple[VirtualMachine, ...] = ()


@dataclass(frozen=True, slots=True)
class Change:
    """One device's placement change, as the decision log records it."""

    namespace: str
    name: str
    vm_name: str
    from_phase: Phase
    from_node: str
    to_phase: Phase
    to_node: str
    reason: str
    reason_code: str = ""
    """The reason's :class:`binder.engine.reasons.Code` value (``Device.reason_code``)."""


class Outcome(enum.StrEnum):
    """How a pass treated a set, for counters and metrics."""

    BOUND = "bound"
    MOVED = "moved"
    LOST = "lost"
    REFUSED = "refused"
    RESTORED = "restored"


@dataclass(frozen=True, slots=True)
class ClassStatus:
    """GPUClass status: unit totals."""

    allocatable: int
    bound: int
    lost: int


@dataclass(frozen=True, slots=True)
class PassResult:
    """What a pass decided: the devices as they should now be, and why.

    ``devices`` holds only devices whose stored fields differ from the input, so the
    caller writes only what changed.
    """

    devices: tuple[Device, ...]
    changes: tuple[Change, ...]
    counts: Mapping[str, int]
    class_status: Mapping[str, ClassStatus] = field(default_factory=dict)
    budget_used: Mapping[tuple[str, str], Mapping[str, int]] = field(default_factory=dict)
    answered: tuple[tuple[str, str], ...] = ()
    """(namespace, name) of every device whose bind request this pass answered."""
    budget_borrowed: Mapping[tuple[str, str], Mapping[str, int]] = field(default_factory=dict)
    """GPUBudget ``status.borrowed`` per budget: units of the tenant's borrowed sets per key
    (keys with zero left out), beside ``budget_used``."""
    room_plans: Mapping[tuple[str, str], tuple[tuple[str, str], ...]] = field(default_factory=dict)
    """Making room: each waiting set (namespace, VM) room was made for, with the sets moved for
    it in the order taken. A move that does not land leaves the sets after it where they are,
    and the waiting set unplaced (``binder.runtime.admissions``)."""
    wake_at: datetime | None = None
    """The earliest moment a set this pass left in place only because the webhook admitted a VMI
    to it within ``GPUPLANE_MOVE_GRACE_SECONDS`` may move to make room: a later pass may decide
    otherwise with nothing changed (the "nothing changed" rule reads it)."""


quick_records(Taint, Toleration, GpuClass, Node, Device, Budget, Vmi, Pod, Change, VirtualMachine)

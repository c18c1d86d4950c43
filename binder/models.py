"""The cluster mirror: namespaces, nodes, pods, VMIs, GPU classes, GPUs and budgets as
database rows, plus the pass history.

In standalone mode these rows are the source of truth; in cluster mode they mirror
the API server so the admin, the catalog and the usage API can answer without calling
it. The binder engine never sees these classes: ``binder.mirror.read`` turns rows into the
engine's plain dataclasses and back.
"""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models

from binder.engine import types as engine

# Models of this app kept in modules of their own; imported here so Django registers them
# with the rest, and so ``binder.models`` names every model of the app.
from binder.feed_models import Change as Change
from binder.feed_models import ChangeOp as ChangeOp
from binder.feed_models import Checkpoint as Checkpoint
from binder.feed_models import FeedReader as FeedReader
from binder.querysets import TenantQuerySet
from binder.usage_record import CLOSING_FIELDS as CLOSING_FIELDS
from binder.usage_record import ClosedRecordError as ClosedRecordError
from binder.usage_record import RecordPhase as RecordPhase
from binder.usage_record import SubjectKind as SubjectKind
from binder.usage_record import UsageRecord as UsageRecord
from binder.usage_record import UsageRecordQuerySet as UsageRecordQuerySet

# -- the mirror: one model per mirrored kind ----------------------------------------------------
#
# Every mirrored row keeps why its object stopped parsing (``parse_error``); the GPU, class and
# budget rows keep the resourceVersion they hold (cluster mode). Those fields are made by the
# two functions below rather than inherited from an abstract model: a field inherited from an
# abstract base comes first in the model's field order (the admin's forms), so each model
# places them itself. What the namespaced kinds share besides (their tenant scoping, order and
# name) is the abstract :class:`NamespacedMirror`.


def parse_error_field() -> models.TextField[str, str]:
    return models.TextField(
        blank=True, help_text="why the cluster's object stopped parsing; the row keeps its last good state"
    )


def resource_version_field() -> models.CharField[str, str]:
    return models.CharField(
        max_length=64, blank=True, help_text="cluster mode: the object's resourceVersion this row holds"
    )


class Namespace(models.Model):
    """A Kubernetes namespace: one tenant. Devices, budgets, VMIs and pods live in one."""

    NAMESPACE_LOOKUP = "name"

    name = models.CharField(max_length=63, unique=True)
    uid = models.CharField(max_length=64, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    created = models.DateTimeField(null=True, blank=True)

    parse_error = parse_error_field()

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class NamespacedMirror(models.Model):
    """A mirrored object that lives in a namespace (a tenant's): scoped per tenant
    (``for_tenant``), ordered and named by namespace and name. Each kind declares its own
    ``namespace`` and ``name`` (their reverse names and indexes differ)."""

    NAMESPACE_LOOKUP = "namespace__name"

    namespace: models.ForeignKey[Namespace, Namespace]
    name: models.CharField[str, str]

    objects = TenantQuerySet.as_manager()

    class Meta:
        abstract = True
        ordering = ["namespace__name", "name"]

    def __str__(self) -> str:
        return f"{self.namespace.name}/{self.name}"


class Node(models.Model):
    """A Kubernetes node: what GPU resources it offers and whether it may hold sets.

    ``allocatable`` keeps only extended resources (name with a ``/``), as integers.
    ``ready_since`` is the Ready condition's lastTransitionTime: with ``ready`` False it
    is when the node went NotReady, which starts the grace period after which its sets move.
    """

    name = models.CharField(max_length=253, unique=True)
    uid = models.CharField(max_length=64, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    allocatable = models.JSONField(default=dict, blank=True, help_text="resource name -> units")
    unschedulable = models.BooleanField(default=False, help_text="cordoned: keeps its sets, takes nothing new")
    taints = models.JSONField(
        default=list, blank=True, help_text="spec.taints: [{key, value, effect}]; untolerated ones take nothing new"
    )
    ready = models.BooleanField(default=True)
    ready_since = models.DateTimeField(null=True, blank=True)
    created = models.DateTimeField(null=True, blank=True)

    parse_error = parse_error_field()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def draining(self) -> bool:
        return engine.is_draining(self.labels or {})


class GpuClass(models.Model):
    """A GPUClass: what tenants order, mapped to the raw node resource it consumes."""

    name = models.CharField(max_length=253, unique=True)
    resource_name = models.CharField(max_length=253, help_text="raw node resource, e.g. nvidia.com/GA102GL_A10")
    units_per_device = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    node_selector = models.JSONField(default=dict, blank=True)
    tolerations = models.JSONField(
        default=list, blank=True, help_text="Kubernetes tolerations of node taints; the webhook adds them to the VMI"
    )
    display_name = models.CharField(max_length=253, blank=True)
    created = models.DateTimeField(null=True, blank=True)
    status_allocatable = models.IntegerField(default=0)
    status_bound = models.IntegerField(default=0)
    status_lost = models.IntegerField(default=0)
    resource_version = resource_version_field()

    parse_error = parse_error_field()

    class Meta:
        ordering = ["name"]
        verbose_name = "GPU class"
        verbose_name_plural = "GPU classes"

    def __str__(self) -> str:
        return self.name


class Phase(models.TextChoices):
    PENDING = engine.Phase.PENDING.value
    BOUND = engine.Phase.BOUND.value
    LOST = engine.Phase.LOST.value


class GpuDevice(NamespacedMirror):
    """A GPU object: one device a tenant ordered for one VM, and where the binder put it.

    Placement fields (``phase``, ``node``, ``since``, ``reason``, ``answered_request``,
    ``answer``) are written by the binder only; ``bind_request`` by the webhook only.
    ``class_name`` is a name, not a foreign key: a device may name a class that does
    not exist (yet), and then stays Pending saying so. ``alternative_class_names`` are
    further classes the order accepts; ``status_class_name`` (written by the binder) is
    the one of them the device is held as while Bound or Lost.
    """

    #: No index of its own: ``uniq_device_per_namespace`` and ``device_set_idx`` begin with it.
    namespace = models.ForeignKey(Namespace, on_delete=models.CASCADE, related_name="devices", db_index=False)
    name = models.CharField(max_length=253)
    class_name = models.CharField(max_length=253)
    alternative_class_names = models.JSONField(
        default=list, blank=True, help_text="further classes the device accepts, in order of preference"
    )
    vm_name = models.CharField(max_length=253)
    phase = models.CharField(max_length=16, choices=Phase.choices, default=Phase.PENDING)
    status_class_name = models.CharField(
        max_length=253, blank=True, default="", help_text="the class the device is held as (empty while Pending)"
    )
    node = models.CharField(max_length=253, blank=True)
    since = models.DateTimeField(null=True, blank=True)
    reason = models.TextField(blank=True)
    reason_code = models.CharField(
        max_length=32,
        blank=True,
        default="",
        help_text="what kind of reason it is (binder.engine.reasons.Code): what code switches on, never the words",
    )
    bind_request = models.CharField(max_length=128, blank=True)
    bind_node_selector = models.JSONField(
        default=dict,
        blank=True,
        help_text="the VMI's spec.nodeSelector, written with bind_request: an unanswered request is placed only there",
    )
    bind_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="when the webhook wrote bind_request (for answer latency)"
    )
    answered_request = models.CharField(max_length=128, blank=True)
    answer = models.TextField(blank=True)
    borrowed = models.BooleanField(
        default=False, help_text="status.borrowed: held beyond the tenant's limits on idle GPUs (lending)"
    )
    reclaim_for = models.CharField(
        max_length=507,
        blank=True,
        default="",
        help_text="status.reclaimFor: <namespace>/<vm> of the waiting set this borrowed set's GPUs are wanted for",
    )
    admitted = models.DateTimeField(
        null=True,
        blank=True,
        help_text="gpuplane.io/admitted: when the webhook last pinned a VMI to this set (its first member only)",
    )
    keep_node = models.BooleanField(
        default=False, help_text='gpuplane.io/keep-node: "true": making room never moves this set off its node'
    )
    created = models.DateTimeField(null=True, blank=True)
    resource_version = resource_version_field()

    parse_error = parse_error_field()

    class Meta(NamespacedMirror.Meta):
        verbose_name = "GPU device"
        constraints = [models.UniqueConstraint(fields=["namespace", "name"], name="uniq_device_per_namespace")]
        indexes = [
            models.Index(fields=["namespace", "vm_name"], name="device_set_idx"),
            # Pending and Lost devices only: binding a device (the bulk of a pass's writes)
            # then adds no entry to it, and what is looked up by phase is Lost or Pending.
            models.Index(fields=["phase"], name="device_unbound_idx", condition=~models.Q(phase=Phase.BOUND)),
            models.Index(fields=["node"], name="device_node_idx"),
            # The mirror's writes find rows by name (``binder.mirror.write``: the sync's batches,
            # a pass's status writes, the webhook's annotations); without it each of those
            # reads scanned the table (30 ms at 110k devices, per query, idle).
            models.Index(fields=["name"], name="device_name_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.namespace_id and self.namespace.name}/{self.name}"


class LostSet(GpuDevice):
    """The admin's Lost sets view: Lost devices grouped by set (a proxy, no table of its own)."""

    class Meta:
        proxy = True
        verbose_name = "Lost set"


class GpuBudget(NamespacedMirror):
    """A GPUBudget: a tenant's limits per class key or raw key, what it may borrow beyond
    them while GPUs stand idle, and the usage (and borrowed units) the binder saw."""

    namespace = models.ForeignKey(Namespace, on_delete=models.CASCADE, related_name="budgets")
    name = models.CharField(max_length=253)
    limits = models.JSONField(default=dict, help_text="key -> units; a key with / is a raw resource name")
    borrowing = models.JSONField(
        default=dict, blank=True, help_text="key -> units the tenant may hold beyond the key's limit on idle GPUs"
    )
    used = models.JSONField(default=dict, blank=True)
    borrowed = models.JSONField(default=dict, blank=True, help_text="status.borrowed: key -> units of borrowed sets")
    resource_version = resource_version_field()

    parse_error = parse_error_field()

    class Meta(NamespacedMirror.Meta):
        verbose_name = "GPU budget"
        constraints = [models.UniqueConstraint(fields=["namespace", "name"], name="uniq_budget_per_namespace")]


class VirtualMachine(NamespacedMirror):
    """A KubeVirt VirtualMachine: where its template says the VM may start. A stopped VM's set
    may move to make room (``binder.engine.making_room``) only where its next start can follow."""

    namespace = models.ForeignKey(Namespace, on_delete=models.CASCADE, related_name="virtual_machines")
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, blank=True)
    node_selector = models.JSONField(default=dict, blank=True, help_text="spec.template.spec.nodeSelector")
    affinity = models.JSONField(
        null=True,
        blank=True,
        help_text="the template's required node affinity: its nodeSelectorTerms (null: none)",
    )
    tolerations = models.JSONField(default=list, blank=True, help_text="spec.template.spec.tolerations")
    created = models.DateTimeField(null=True, blank=True)

    parse_error = parse_error_field()

    class Meta(NamespacedMirror.Meta):
        verbose_name = "VirtualMachine"
        constraints = [models.UniqueConstraint(fields=["namespace", "name"], name="uniq_vm_per_namespace")]
        indexes = [models.Index(fields=["name"], name="vm_name_idx")]  # as GpuDevice's device_name_idx


class VirtualMachineInstance(NamespacedMirror):
    """A KubeVirt VMI: the devices it names and, in ``active_pods``, its real launchers.

    ``active_pods`` (pod UID -> node) is the only proof that a pod is this VMI's launcher;
    it is written by virt-controller, not by whoever creates the pod.
    """

    namespace = models.ForeignKey(Namespace, on_delete=models.CASCADE, related_name="vmis")
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, blank=True)
    device_names = models.JSONField(default=list, blank=True, help_text="spec gpus/hostDevices deviceNames")
    active_pods = models.JSONField(default=dict, blank=True, help_text="status.activePods: pod uid -> node")
    node = models.CharField(max_length=253, blank=True)
    phase = models.CharField(max_length=32, blank=True)

    parse_error = parse_error_field()

    class Meta(NamespacedMirror.Meta):
        verbose_name = "VMI"
        constraints = [models.UniqueConstraint(fields=["namespace", "name"], name="uniq_vmi_per_namespace")]
        indexes = [models.Index(fields=["name"], name="vmi_name_idx")]  # as GpuDevice's device_name_idx


class Pod(NamespacedMirror):
    """A pod that requests GPU resources: raw usage unless it is a VMI's proven launcher.

    The owner fields are hints only (which VMI to look up); they are written by the
    pod's creator and prove nothing.
    """

    namespace = models.ForeignKey(Namespace, on_delete=models.CASCADE, related_name="pods")
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64)
    node = models.CharField(max_length=253, blank=True)
    phase = models.CharField(max_length=32, blank=True)
    gpu_requests = models.JSONField(default=dict, blank=True, help_text="resource -> units (request, else limit)")
    owner_kind = models.CharField(max_length=64, blank=True)
    owner_name = models.CharField(max_length=253, blank=True)
    owner_uid = models.CharField(max_length=64, blank=True)
    owner_vmi_hint = models.CharField(max_length=253, blank=True)

    parse_error = parse_error_field()

    class Meta(NamespacedMirror.Meta):
        constraints = [models.UniqueConstraint(fields=["namespace", "name"], name="uniq_pod_per_namespace")]
        indexes = [models.Index(fields=["name"], name="pod_name_idx")]  # as GpuDevice's device_name_idx


class PassKind(models.TextChoices):
    FULL = "full"
    ANSWER = "answer"


class PassRun(models.Model):
    """One binder pass: when it ran, how long it took and what it did (for staff and metrics)."""

    kind = models.CharField(max_length=8, choices=PassKind.choices)
    triggered_by = models.CharField(
        max_length=160,
        blank=True,
        help_text=(
            "what asked for the pass: event, resync, answer, overdue, webhook, command, direct or staff:<user>;"
            " a request collapsed into a pass already queued leaves the first one's (blank: before this was kept)"
        ),
    )
    started = models.DateTimeField()
    finished = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    devices_seen = models.IntegerField(default=0)
    devices_written = models.IntegerField(default=0)
    bound = models.IntegerField(default=0)
    moved = models.IntegerField(default=0)
    lost = models.IntegerField(default=0)
    refused = models.IntegerField(default=0)
    restored = models.IntegerField(default=0)
    made_room = models.IntegerField(default=0, help_text="sets moved to make room for a waiting set (full passes)")
    room_refused = models.IntegerField(
        default=0, help_text="waiting sets whose plan to make room GPUPLANE_MOVES_PER_PASS refused (full passes)"
    )
    skipped = models.CharField(max_length=128, blank=True, help_text="why the pass placed nothing")
    records_opened = models.IntegerField(default=0, help_text="usage records opened (full passes only)")
    records_closed = models.IntegerField(default=0, help_text="usage records closed (full passes only)")
    writes_failed = models.IntegerField(
        default=0, help_text="cluster mode: status writes the API server refused (left for the next pass)"
    )
    finalizers_released = models.IntegerField(default=0, help_text="cluster mode: finalizers removed after release")
    worker = models.CharField(
        max_length=128, blank=True, help_text="the worker incarnation that ran the pass (host:pid:token)"
    )
    feed_position = models.BigIntegerField(
        null=True, blank=True, help_text="the change-feed position the pass's view was current to"
    )
    view = models.CharField(
        max_length=16, blank=True, help_text="how the view was brought current: rebuilt, incremental or full-read"
    )
    rows_read = models.IntegerField(default=0, help_text="mirror rows read from the database for the view")
    dirty_sets = models.IntegerField(default=0, help_text="sets whose inputs changed since the previous pass")
    verify_mismatches = models.IntegerField(
        null=True, blank=True, help_text="verification: differences found (None: the pass did not verify)"
    )

    class Meta:
        ordering = ["-started"]
        verbose_name = "pass"
        verbose_name_plural = "passes"

    def __str__(self) -> str:
        return f"{self.kind} pass #{self.pk}"


class Decision(models.Model):
    """The decision log: one row per device placement change, with the pass and the reason.

    Namespace and names are copied, not linked, so the history outlives the objects and
    answers "why is (or was) my GPU here" after a device or namespace is gone.
    """

    NAMESPACE_LOOKUP = "namespace"

    #: No constraint in the database: only a pass writes decisions, with the PassRun it
    #: inserted in the same transaction, and checking 26k rows of a large pass at commit
    #: cost more than writing them. Deleting a PassRun still deletes its decisions (the ORM).
    pass_run = models.ForeignKey(PassRun, on_delete=models.CASCADE, related_name="decisions", db_constraint=False)
    namespace = models.CharField(max_length=63)
    vm_name = models.CharField(max_length=253)
    device_name = models.CharField(max_length=253)
    from_phase = models.CharField(max_length=16, choices=Phase.choices)
    from_node = models.CharField(max_length=253, blank=True)
    to_phase = models.CharField(max_length=16, choices=Phase.choices)
    to_node = models.CharField(max_length=253, blank=True)
    reason = models.TextField(blank=True)
    reason_code = models.CharField(max_length=32, blank=True, default="", help_text="the reason's code")
    created = models.DateTimeField()

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created", "-id"]
        indexes = [
            models.Index(fields=["namespace", "device_name"], name="decision_device_idx"),
            models.Index(fields=["namespace", "vm_name"], name="decision_set_idx"),
        ]

    def __str__(self) -> str:
        return (
            f"{self.namespace}/{self.device_name}: {self.from_phase} {self.from_node} -> {self.to_phase} {self.to_node}"
        )


class BindAnswer(models.Model):
    """One answered bind request: what the webhook was told and how long it waited.

    The device keeps only its latest request; this history feeds the answer-latency
    metric and answers "why was my VM refused at 10:02" after later requests.
    """

    NAMESPACE_LOOKUP = "namespace"

    pass_run = models.ForeignKey(PassRun, on_delete=models.CASCADE, related_name="answers")
    namespace = models.CharField(max_length=63)
    device_name = models.CharField(max_length=253)
    request = models.CharField(max_length=128)
    allowed = models.BooleanField()
    answer = models.TextField()
    requested_at = models.DateTimeField(null=True, blank=True)
    answered_at = models.DateTimeField()
    latency_ms = models.FloatField(null=True, blank=True, help_text="answered_at - requested_at")

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-answered_at", "-id"]
        indexes = [models.Index(fields=["namespace", "device_name"], name="answer_device_idx")]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.device_name} {self.request}: {'allowed' if self.allowed else 'refused'}"


class SyncStatus(models.Model):
    """How ``sync_cluster`` is doing for one kind (cluster mode), for staff and ``/metrics``.

    The sync runs in its own process; this row is how the web processes learn the
    version it follows, how fresh the mirror is (the last batch's lag from its first event's receipt to
    commit), and how often it had to list again or failed.
    """

    kind = models.CharField(max_length=64, unique=True)
    resource_version = models.CharField(max_length=64, blank=True)
    listed = models.IntegerField(default=0, help_text="objects in the last list")
    listed_at = models.DateTimeField(null=True, blank=True)
    last_event_at = models.DateTimeField(null=True, blank=True)
    lag_seconds = models.FloatField(null=True, blank=True, help_text="last event: received -> mirror row committed")
    events = models.BigIntegerField(default=0)
    relists = models.IntegerField(default=0)
    gone = models.IntegerField(default=0, help_text="watches that expired with 410 Gone")
    invalid = models.IntegerField(default=0, help_text="objects skipped because they did not parse")
    stale = models.BigIntegerField(
        default=0, help_text="events and listed objects ignored: older than the row (the binder's own write)"
    )
    errors = models.IntegerField(default=0)
    last_error = models.TextField(blank=True)
    last_invalid = models.TextField(blank=True, help_text="the last object refused: which one and why")
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["kind"]
        verbose_name = "sync status"
        verbose_name_plural = "sync status"

    def __str__(self) -> str:
        return f"{self.kind} at {self.resource_version or '-'}"


class FinalizerRelease(models.Model):
    """Cluster mode: a GPU or GPUClass being deleted that still carries gpuplane's finalizer.

    The mirror drops an object's row once it is being deleted (its units count as gone),
    so the sync notes the object here, in the same transaction: the next full pass sees
    the row gone (its units released, its usage records closed) and this note, and after
    its commit removes the finalizer, with the version noted as the precondition. Not a
    mirrored table: nothing the engine reads, so it leaves no change-feed entry.
    """

    kind = models.CharField(max_length=32)
    namespace = models.CharField(max_length=63, blank=True)
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, blank=True)
    resource_version = models.CharField(max_length=64, blank=True)
    finalizers = models.JSONField(default=list, blank=True, help_text="the object's finalizers when noted")
    noted = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["kind", "namespace", "name"]
        constraints = [models.UniqueConstraint(fields=["kind", "namespace", "name"], name="uniq_finalizer_release")]

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name} at {self.resource_version or '-'}"

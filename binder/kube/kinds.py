"""The kinds gpuplane mirrors: one record per kind, everything every layer needs to know of it.

Where a kind lives in the API (group, version, plural, namespaced), which parser reads it,
which model mirrors it and which converter turns a row into an engine record, whether the
binder writes its status or holds a finalizer on it, whether the usage records read it:
all of it is one :class:`Kind` row of :data:`KINDS`, in the order the sync lists them
(namespaces before what lives in them). The API client, the parsers' entry point, the
mirror's readers and writers, the sync, the pass worker's state and the read model derive
their tables from here, so a kind cannot be known to one of them and not to another
(``tests/project/test_kinds.py`` checks the names here resolve, and the CRDs, RBAC and
change feed agree).

Django-free (the API client needs it): the model and the converter are named, and
``binder.mirror`` resolves the names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from binder.kube.core import parse_namespace, parse_node, parse_pod, parse_virtual_machine, parse_vmi
from binder.kube.fields import Parsed
from binder.kube.resources import GROUP, parse_gpu, parse_gpu_budget, parse_gpu_class

#: The version of gpuplane's own API group.
VERSION = "v1alpha1"


@dataclass(frozen=True, slots=True)
class Kind:
    """One mirrored kind."""

    kind: str
    group: str
    """The API group ("" is the core group); an object of the same kind name in another
    group (a vendor's ``GPU``) is not this kind."""
    version: str
    plural: str
    namespaced: bool
    parser: Callable[[Mapping[str, Any]], Parsed]
    model: str
    """The class in ``binder.models`` whose rows mirror it."""
    converter: str = ""
    """The function in ``binder.mirror.convert`` that makes a row's engine record (empty:
    the engine keeps no record of the kind, as of namespaces)."""
    row_fields: tuple[str, ...] = ()
    """The model fields the converter takes, in order, after namespace and name."""
    cluster_field: str = ""
    """The ``binder.engine.types.Cluster`` field its records fill."""
    status_written: bool = False
    """The binder writes its status: its rows keep the object's resourceVersion, and an
    event older than the row is ignored (``binder.mirror.write``)."""
    finalizer: bool = False
    """Its deletion waits on gpuplane's finalizer until a pass released its units."""
    recorded: bool = False
    """The usage records read it (a row of it gone may close records)."""
    optional: bool = False
    """The API server may not serve it (a cluster without its CRD): a list answered 404 is an
    empty list, and the sync lists again at its next relist instead of watching."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        """The API path of the kind's objects (of one namespace, one object, a subresource)."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if namespace and self.namespaced:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if sub:
            base += f"/{sub}"
        return base


_DEVICE_FIELDS = (
    "class_name",
    "vm_name",
    "phase",
    "node",
    "since",
    "reason",
    "bind_request",
    "answered_request",
    "answer",
    "created",
    "bind_node_selector",
    "alternative_class_names",
    "status_class_name",
    "borrowed",
    "reclaim_for",
    "reason_code",
    "admitted",
    "keep_node",
)

#: Every mirrored kind, in the order the sync lists them: namespaces first, then what the
#: rest refer to (nodes, classes, budgets, VirtualMachines, VMIs, pods), GPUs last.
KINDS: tuple[Kind, ...] = (
    Kind("Namespace", "", "v1", "namespaces", False, parse_namespace, "Namespace"),
    Kind(
        "Node", "", "v1", "nodes", False, parse_node, "Node", "node_from",
        ("allocatable", "labels", "unschedulable", "ready", "ready_since", "taints"), "nodes",
    ),
    Kind(
        "GPUClass", GROUP, VERSION, "gpuclasses", False, parse_gpu_class, "GpuClass", "class_from",
        ("resource_name", "units_per_device", "node_selector", "display_name", "tolerations"), "classes",
        status_written=True, finalizer=True, recorded=True,
    ),
    Kind(
        "GPUBudget", GROUP, VERSION, "gpubudgets", True, parse_gpu_budget, "GpuBudget", "budget_from",
        ("limits", "borrowing"), "budgets", status_written=True,
    ),
    Kind(
        "VirtualMachine", "kubevirt.io", "v1", "virtualmachines", True, parse_virtual_machine, "VirtualMachine",
        "vm_from", ("node_selector", "affinity", "tolerations"), "virtual_machines", optional=True,
    ),
    Kind(
        "VirtualMachineInstance", "kubevirt.io", "v1", "virtualmachineinstances", True, parse_vmi,
        "VirtualMachineInstance", "vmi_from", ("uid", "active_pods", "node", "phase", "device_names"), "vmis",
        recorded=True,
    ),
    Kind(
        "Pod", "", "v1", "pods", True, parse_pod, "Pod", "pod_from",
        ("uid", "node", "phase", "gpu_requests", "owner_vmi_hint"), "pods", recorded=True,
    ),
    Kind(
        "GPU", GROUP, VERSION, "gpus", True, parse_gpu, "GpuDevice", "device_from", _DEVICE_FIELDS, "devices",
        status_written=True, finalizer=True, recorded=True,
    ),
)  # fmt: skip

#: :data:`KINDS` by kind name.
BY_KIND: dict[str, Kind] = {k.kind: k for k in KINDS}
#: The kinds the engine keeps records of (all but namespaces), in :data:`KINDS` order.
ENGINE_KINDS: tuple[str, ...] = tuple(k.kind for k in KINDS if k.converter)
#: The kinds whose objects belong to a namespace.
NAMESPACED: frozenset[str] = frozenset(k.kind for k in KINDS if k.namespaced)
#: The kinds whose status the binder writes (their rows keep the resourceVersion).
STATUS_WRITTEN: frozenset[str] = frozenset(k.kind for k in KINDS if k.status_written)
#: The kinds whose deletion waits on gpuplane's finalizer: while deleting they count as gone.
FINALIZED: frozenset[str] = frozenset(k.kind for k in KINDS if k.finalizer)
#: The kinds the usage records read.
RECORDED: frozenset[str] = frozenset(k.kind for k in KINDS if k.recorded)

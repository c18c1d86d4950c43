"""The shared reader: is this pod a VMI's launcher, and how much raw GPU does it use.

A launcher pod requests the same GPU units its VMI's devices already hold, so those
units must not be counted twice. Owner references and labels are written by whoever
creates the pod, so a tenant could forge them to hide GPUs from capacity, budgets and
usage records. Only the VMI's own ``status.activePods`` (written by virt-controller)
is proof. Every consumer (binder, webhook, catalog, usage records, usage API) calls
the functions here; they differ only in where they read the VMI and its set from.
There must be no second copy of this rule anywhere in the project.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from binder.engine.types import Device, GpuClass, Phase, Pod, Vmi, quick_records

#: Looks up a VMI by (namespace, name); returns None when there is none.
VmiLookup = Callable[[str, str], Vmi | None]
#: Lists the devices of a set by (namespace, vm name).
SetLookup = Callable[[str, str], Iterable[Device]]


def is_launcher(pod: Pod, vmi: Vmi | None) -> bool:
    """True only when ``vmi`` lists the pod's UID in ``status.activePods``."""
    return vmi is not None and bool(pod.uid) and pod.namespace == vmi.namespace and pod.uid in vmi.active_pods


def launcher_of(pod: Pod, find_vmi: VmiLookup) -> Vmi | None:
    """The VMI this pod is the launcher of, or None.

    The owner hint only says which VMI to look up; the VMI's activePods decides.
    """
    if not pod.owner_vmi:
        return None
    vmi = find_vmi(pod.namespace, pod.owner_vmi)
    return vmi if is_launcher(pod, vmi) else None


def held_units(
    set_devices: Iterable[Device],
    classes: Mapping[str, GpuClass],
    resource: str,
    node: str | None = None,
) -> int:
    """Units of ``resource`` a set holds: Bound or Lost, or only Bound on ``node`` when given.

    ``held(P, R)`` is ``held_units(set, classes, R)``; ``held_here(P, R)`` passes P's node
    (Lost devices hold no units on any node).
    """
    total = 0
    for device in set_devices:
        cls = classes.get(device.class_name)
        if cls is None or cls.resource_name != resource:
            continue
        if node is None:
            if device.held:
                total += cls.units_per_device
        elif device.phase is Phase.BOUND and device.node == node:
            total += cls.units_per_device
    return total


@dataclass(frozen=True, slots=True)
class RawUsage:
    """A pod's raw-name GPU usage.

    ``budget``: per resource, what counts in tenant budgets and usage records.
    ``capacity``: per resource, what the pod books on its node (empty when unbound).
    """

    budget: Mapping[str, int] = field(default_factory=dict)
    capacity: Mapping[str, int] = field(default_factory=dict)


quick_records(RawUsage)
NO_USAGE = RawUsage()


def raw_usage(
    pod: Pod,
    launcher: Vmi | None,
    set_devices: Iterable[Device],
    classes: Mapping[str, GpuClass],
) -> RawUsage:
    """Raw usage of ``pod`` given the VMI it launches (or None) and that VMI's set.

    ``set_devices`` is ignored unless ``launcher`` is given, in which case it must be the
    devices of the launcher's set (same namespace, ``vm_name`` = VMI name).
    """
    if pod.finished:
        return NO_USAGE
    members = tuple(set_devices) if launcher is not None else ()
    budget: dict[str, int] = {}
    capacity: dict[str, int] = {}
    for resource, requested in pod.requests.items():
        if requested <= 0:
            continue
        held = held_units(members, classes, resource) if launcher else 0
        if requested - held > 0:
            budget[resource] = requested - held
        if pod.node:
            held_here = held_units(members, classes, resource, node=pod.node) if launcher else 0
            if requested - held_here > 0:
                capacity[resource] = requested - held_here
    return RawUsage(budget=budget, capacity=capacity)


def raw_usage_of(
    pod: Pod,
    find_vmi: VmiLookup,
    find_set: SetLookup,
    classes: Mapping[str, GpuClass],
) -> RawUsage:
    """Raw usage of ``pod``, looking its VMI and set up through the caller's sources."""
    launcher = launcher_of(pod, find_vmi)
    members: Iterable[Device] = find_set(launcher.namespace, launcher.name) if launcher else ()
    return raw_usage(pod, launcher, members, classes)

"""The decision log of one set or one device: "why is this GPU here (or Lost)?".

Decisions copy namespace, VM and device names rather than linking to rows, so the log
answers for devices and sets that no longer exist; the devices' current placement is
shown beside it for the ones that still do.
"""

from __future__ import annotations

from dataclasses import dataclass

from binder import models

#: The newest decisions shown on one page; older ones are counted, not listed.
LIMIT = 500


class HistoryQueryError(ValueError):
    """The request does not say which set or device (a message for staff, never a 500)."""


@dataclass(slots=True)
class DecisionGroup:
    """One pass's change of some devices of one set, alike in every other respect."""

    first: models.Decision
    devices: list[str]

    def same_change(self, other: models.Decision) -> bool:
        mine = self.first
        return (
            mine.pass_run_id,
            mine.vm_name,
            mine.from_phase,
            mine.from_node,
            mine.to_phase,
            mine.to_node,
            mine.reason,
        ) == (
            other.pass_run_id,
            other.vm_name,
            other.from_phase,
            other.from_node,
            other.to_phase,
            other.to_node,
            other.reason,
        )


@dataclass(frozen=True, slots=True)
class DecisionLog:
    """Every placement change of a set (or one of its devices), newest first."""

    namespace: str
    vm: str
    device: str
    decisions: list[models.Decision]
    total: int
    devices: list[models.GpuDevice]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.decisions)

    @property
    def groups(self) -> list[DecisionGroup]:
        """The decisions as staff read them: the rows one pass wrote for one set that moved
        its devices alike (same from, same to, same reason) as one row naming the devices.
        A set of 8 moved by a pass is one line, not eight identical ones."""
        groups: list[DecisionGroup] = []
        for decision in self.decisions:
            last = groups[-1] if groups else None
            if last is not None and last.same_change(decision):
                last.devices.append(decision.device_name)
            else:
                groups.append(DecisionGroup(decision, [decision.device_name]))
        return groups

    @property
    def subject(self) -> str:
        if self.device:
            return f"device {self.namespace}/{self.device}"
        return f"set {self.namespace}/{self.vm}"


def decision_log(namespace: str, vm: str = "", device: str = "", limit: int = LIMIT) -> DecisionLog:
    """The log of set ``namespace``/``vm``, or of one device when ``device`` is given."""
    if not namespace:
        raise HistoryQueryError("say whose decisions: the namespace parameter is missing")
    if not vm and not device:
        raise HistoryQueryError("say which set or device: give vm=<VM name> or device=<GPU name>")
    decisions = models.Decision.objects.filter(namespace=namespace)
    current = models.GpuDevice.objects.filter(namespace__name=namespace).select_related("namespace")
    if device:
        decisions = decisions.filter(device_name=device)
        current = current.filter(name=device)
    if vm:
        decisions = decisions.filter(vm_name=vm)
        current = current.filter(vm_name=vm)
    rows = list(decisions.select_related("pass_run")[:limit])
    total = len(rows) if len(rows) < limit else decisions.count()
    devices = list(current.order_by("name"))
    if not vm:
        vm = devices[0].vm_name if devices else (rows[0].vm_name if rows else "")
    return DecisionLog(namespace=namespace, vm=vm, device=device, decisions=rows, total=total, devices=devices)

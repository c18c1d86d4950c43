"""Staff actions: run a full pass now, retry a Lost set, and tell staff what came of it.

Both go through the binder queue (``binder.queue.queue_full_pass``) like every other
event, never by calling ``run_pass`` inline: passes stay serialized and collapsed, and
a staff click cannot jump the queue ahead of a webhook's answer pass. What staff see
depends on where the pass runs: without a broker Celery runs it in-process when the
request's transaction commits (in autocommit mode: at once), so its result can be
shown; with a broker a worker runs it later, and staff are told it is queued.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from binder import models
from binder.queue import queue_full_pass

log = logging.getLogger(__name__)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def sets(count: int) -> str:
    return plural(count, "set")


@dataclass(frozen=True, slots=True)
class PassOutcome:
    """What asking for a full pass led to, as far as this request can know."""

    run: models.PassRun | None = None
    queued: bool = False
    """A broker is configured: a worker runs the pass; nothing more is known here."""
    deferred: bool = False
    """The caller is inside a transaction: the pass runs when it commits."""
    error: str = ""

    @property
    def message(self) -> str:
        if self.error:
            return f"The full pass failed: {self.error}"
        if self.run is not None:
            run = self.run
            # A pass counts sets (and refused orders), the board counts devices: say which.
            text = (
                f"Full pass #{run.pk} ran: bound {sets(run.bound)}, moved {sets(run.moved)}, lost {sets(run.lost)}, "
                f"refused {plural(run.refused, 'order')}, restored {sets(run.restored)}; "
                f"{plural(run.devices_written, 'device')} written"
            )
            return text + (f" (skipped: {run.skipped})" if run.skipped else "") + "."
        if self.deferred:
            return "Queued a full pass; it runs when this request's transaction commits."
        return "Queued a full pass on the binder queue; a worker runs it (see Passes for its result)."


def staff_trigger(username: str) -> str:
    """The ``PassRun.triggered_by`` of a staff action: who clicked."""
    return f"staff:{username}"


def full_pass_now(triggered_by: str = "staff") -> PassOutcome:
    """Queue a full pass and, when it ran in-process, return its record."""
    before = models.PassRun.objects.filter(kind=models.PassKind.FULL).order_by("-pk").values_list("pk", flat=True)
    last = before.first() or 0
    deferred = transaction.get_connection().in_atomic_block
    try:
        queue_full_pass(triggered_by=triggered_by)
    except Exception as exc:  # an in-process pass that failed must reach staff, not a 500 page
        log.exception("full pass requested by staff failed")
        return PassOutcome(error=f"{type(exc).__name__}: {exc}")
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        return PassOutcome(queued=True)
    if deferred:
        return PassOutcome(deferred=True)
    run = models.PassRun.objects.filter(kind=models.PassKind.FULL, pk__gt=last).order_by("pk").first()
    return PassOutcome(run=run, queued=run is None)


@dataclass(frozen=True, slots=True)
class RetryOutcome:
    """A Lost set's retry: the pass outcome and where the set stands afterwards."""

    namespace: str
    vm: str
    outcome: PassOutcome
    phases: dict[str, int]
    nodes: tuple[str, ...]
    reason: str

    @property
    def message(self) -> str:
        name = f"{self.namespace}/{self.vm}"
        if self.outcome.error:
            return f"Retry of {name}: {self.outcome.message}"
        if self.outcome.deferred:
            return f"Queued a full pass to retry {name}; it runs when this request's transaction commits."
        if self.outcome.run is None:
            return f"Queued a full pass to retry {name} on the binder queue; a worker runs it (see Passes)."
        if self.phases.get(models.Phase.LOST):
            return f"{self.outcome.message} {name} is still Lost: {self.reason}"
        if set(self.phases) == {models.Phase.BOUND}:
            return f"{self.outcome.message} {name} is now Bound on {', '.join(self.nodes)}."
        state = ", ".join(f"{n} {p}" for p, n in sorted(self.phases.items())) or "no devices any more"
        return f"{self.outcome.message} {name} now has {state}."

    @property
    def bound(self) -> bool:
        return set(self.phases) == {models.Phase.BOUND}


def retry_lost_set(namespace: str, vm: str, triggered_by: str = "staff") -> RetryOutcome:
    """Ask for a full pass to rebind a Lost set (step 3 of the pass rebinds Lost sets
    first, oldest first), then read where the set stands if the pass already ran."""
    outcome = full_pass_now(triggered_by)
    devices = list(
        models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm).values_list("phase", "node", "reason")
    )
    phases: dict[str, int] = {}
    for phase, _, _ in devices:
        phases[phase] = phases.get(phase, 0) + 1
    lost_reason = next((r for p, _, r in devices if p == models.Phase.LOST), "")
    return RetryOutcome(
        namespace=namespace,
        vm=vm,
        outcome=outcome,
        phases=phases,
        nodes=tuple(sorted({n for _, n, _ in devices if n})),
        reason=lost_reason,
    )

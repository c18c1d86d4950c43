"""Run a binder pass against the database: read fresh, decide, write what changed.

A pass is one transaction under the cluster-wide pass lock (``binder.locking``): it
reads every device inside the transaction, after taking the lock, so units booked by
the previous pass are always seen; it writes only the devices whose fields changed
(never ``bind_request``, which belongs to the webhook), one decision row per
placement change, and the class and budget status. If anything fails the whole pass
rolls back and the next one starts from the same state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from . import models
from .engine import ANSWER_BOUND, PassResult, answer_pass, full_pass
from .engine import types as e
from .locking import pass_lock
from .mirror import read_cluster

log = logging.getLogger(__name__)

#: The fields a pass may write on a device.
PLACEMENT_FIELDS = ("phase", "node", "since", "reason", "answered_request", "answer")

ENGINES: dict[str, Callable[[e.Cluster], PassResult]] = {
    models.PassKind.FULL: full_pass,
    models.PassKind.ANSWER: answer_pass,
}


def run_pass(kind: str = models.PassKind.FULL) -> models.PassRun:
    """Run one pass of ``kind`` (``full`` or ``answer``) and return its record."""
    engine = ENGINES[kind]
    clock = time.perf_counter()
    with transaction.atomic(), pass_lock():
        now = timezone.now()
        cluster, ids = read_cluster(now)
        result = engine(cluster)
        if settings.GPUPLANE_FAULT_PASS_DELAY_SECONDS:
            time.sleep(settings.GPUPLANE_FAULT_PASS_DELAY_SECONDS)
        run = models.PassRun.objects.create(kind=kind, started=now, devices_seen=len(cluster.devices))
        if not cluster.settings.enabled:
            run.skipped = "GPUPLANE_ENABLED is false: nothing placed, moved or answered"
        write_result(run, result, ids)
        run.finished = timezone.now()
        run.duration_ms = (time.perf_counter() - clock) * 1000
        run.save()
    log.info(
        "%s pass %s: %d devices, %d written, bound=%d moved=%d lost=%d refused=%d restored=%d in %.1f ms",
        kind,
        run.pk,
        run.devices_seen,
        run.devices_written,
        run.bound,
        run.moved,
        run.lost,
        run.refused,
        run.restored,
        run.duration_ms,
    )
    return run


def write_result(run: models.PassRun, result: PassResult, ids: dict[tuple[str, str], int]) -> None:
    """Write the changed devices, the decisions and the status of classes and budgets."""
    rows = []
    for device in result.devices:
        row_id = ids.get(device.key)
        if row_id is None:
            continue
        rows.append(
            models.GpuDevice(
                id=row_id,
                phase=device.phase.value,
                node=device.node,
                since=device.since,
                reason=device.reason,
                answered_request=device.answered_request,
                answer=device.answer,
            )
        )
    models.GpuDevice.objects.bulk_update(rows, PLACEMENT_FIELDS, batch_size=1000)
    models.Decision.objects.bulk_create(
        [
            models.Decision(
                pass_run=run,
                namespace=c.namespace,
                vm_name=c.vm_name,
                device_name=c.name,
                from_phase=c.from_phase.value,
                from_node=c.from_node,
                to_phase=c.to_phase.value,
                to_node=c.to_node,
                reason=c.reason,
                created=run.started,
            )
            for c in result.changes
        ],
        batch_size=1000,
    )
    for name, status in result.class_status.items():
        models.GpuClass.objects.filter(name=name).exclude(
            status_allocatable=status.allocatable, status_bound=status.bound, status_lost=status.lost
        ).update(status_allocatable=status.allocatable, status_bound=status.bound, status_lost=status.lost)
    if result.budget_used:
        budgets = models.GpuBudget.objects.select_related("namespace")
        for budget in budgets:
            used = result.budget_used.get((budget.namespace.name, budget.name))
            if used is not None and budget.used != dict(used):
                models.GpuBudget.objects.filter(pk=budget.pk).update(used=dict(used))
    _record_answers(run, result, ids)
    run.devices_written = len(rows)
    for outcome in e.Outcome:
        setattr(run, outcome.value, result.counts.get(outcome.value, 0))


def _record_answers(run: models.PassRun, result: PassResult, ids: dict[tuple[str, str], int]) -> None:
    """One BindAnswer per request this pass answered, with its latency when known."""
    keys = set(result.answered)
    answered = [d for d in result.devices if d.key in keys and d.key in ids]
    if not answered:
        return
    requested = dict(
        models.GpuDevice.objects.filter(id__in=[ids[d.key] for d in answered]).values_list("id", "bind_requested_at")
    )
    now = timezone.now()
    rows = []
    for device in answered:
        at = requested.get(ids[device.key])
        rows.append(
            models.BindAnswer(
                pass_run=run,
                namespace=device.namespace,
                device_name=device.name,
                request=device.answered_request,
                allowed=device.answer.startswith(ANSWER_BOUND),
                answer=device.answer,
                requested_at=at,
                answered_at=now,
                latency_ms=(now - at).total_seconds() * 1000 if at else None,
            )
        )
    models.BindAnswer.objects.bulk_create(rows, batch_size=1000)

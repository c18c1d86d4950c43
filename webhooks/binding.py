"""Bind and wait: the webhook's on-demand bind (SPEC §5 step 4) and its reads of the mirror.

When the set is not placed yet the webhook asks the binder:

1. write a new bind request id on every device of the set (one transaction, only the
   ``bind_request`` columns, which belong to the webhook) and queue an answer pass at
   commit (``binder.queue.queue_answer_pass``; in the embedded default it runs in
   process at commit, so the answer is already there when the commit returns);
2. wait up to ``GPUPLANE_BIND_WAIT_SECONDS`` until every device's ``answered_request``
   is that id. The database is the truth; on PostgreSQL the process's ``LISTEN``
   connection (``binder.runtime.answers``) says when to look again, instead of Celery's
   0.5 s result polling; elsewhere it polls every 50 ms.

Database failures (a dropped connection, a restart) end in a clear denial the caller
can retry; every denial's wording is in ``webhooks.admission``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from kubernetes.client import ApiException

from binder import apiserver, models, queue
from binder.engine import ANSWER_BOUND, Node
from binder.errors import describe
from binder.mirror.read import engine_settings, read_rows
from binder.runtime.answers import listening
from webhooks import admission
from webhooks.admission import Action, MirrorView, Review, Verdict, conclude, timed_out

log = logging.getLogger(__name__)

#: Polling interval where there is no notification (SQLite, or LISTEN unavailable).
POLL_SECONDS = 0.05
#: With LISTEN, the database is still re-read this often in case a notification is lost
#: (e.g. the listening connection broke); notifications normally wake the wait at once.
RECHECK_SECONDS = 1.0


def read_nodes(names: Iterable[str]) -> tuple[Node, ...]:
    """The mirrored nodes of ``names`` (missing ones are left out): the pin needs each
    node's own ``kubernetes.io/hostname`` label, which may differ from its name."""
    wanted = sorted({n for n in names if n})
    if not wanted:
        return ()
    return tuple(read_rows("Node", queryset=models.Node.objects.filter(name__in=wanted)))


def with_nodes(view: MirrorView, names: Iterable[str]) -> MirrorView:
    """``view`` with the nodes of ``names`` read fresh (after the binder answered with a
    node the view, read before the bind, may not hold)."""
    return dataclasses.replace(view, nodes=read_nodes(names))


def mirror_view(namespace: str) -> MirrorView:
    """The mirror slice of one namespace that :func:`webhooks.admission.decide` reads:
    its devices, the nodes they are on, all classes, and its budgets, pods and VMIs."""
    scope = [namespace]
    engine = engine_settings()
    devices = tuple(read_rows("GPU", scope))
    return MirrorView(
        namespace=namespace,
        enabled=engine.enabled,
        devices=devices,
        nodes=read_nodes(d.node for d in devices),
        classes=tuple(read_rows("GPUClass")),
        budgets=tuple(read_rows("GPUBudget", scope)),
        pods=tuple(read_rows("Pod", scope)),
        vmis=tuple(read_rows("VirtualMachineInstance", scope)),
        default_budget=engine.default_budget,
    )


class _SetChanged(Exception):
    """The set's rows changed between the decision and the bind-request write."""


def bind_and_wait(review: Review, view: MirrorView, verdict: Verdict, started: float) -> Verdict:  # noqa: C901 - write, then one wait loop with its failure cases
    """Write the bind requests, queue an answer pass and wait for its answers.

    The wait counts from the request's arrival (``started``), so the whole call stays
    within ``GPUPLANE_BIND_WAIT_SECONDS`` plus a final read, below the webhook timeout.
    Every device of the set gets the same new request id: a pass answers a set as a
    whole, and an answer to an earlier request (a retried call) is not taken for ours.
    """
    wait = float(settings.GPUPLANE_BIND_WAIT_SECONDS)
    deadline = started + wait
    request_id = uuid.uuid4().hex
    names = verdict.bind
    listener = listening()
    # Noted before the requests are written: a notification after this moves it.
    seen = listener.count if listener is not None else 0
    committed = False

    def mark_committed() -> None:
        nonlocal committed
        committed = True

    if apiserver.cluster_mode():
        refused = annotate_in_cluster(review, names, request_id)
        if refused is not None:
            return refused
    try:
        with transaction.atomic():
            written = models.GpuDevice.objects.filter(
                namespace__name=review.namespace, vm_name=review.name, name__in=names
            ).update(
                bind_request=request_id,
                bind_requested_at=timezone.now(),
                bind_node_selector=dict(review.scheduling.node_selector),
            )
            if written != len(names):
                raise _SetChanged
            transaction.on_commit(mark_committed)
            queue.queue_answer_pass()
    except _SetChanged:
        return admission.set_changed(review)
    except Exception:
        if not committed:
            raise
        # The requests are written; running (embedded) or publishing the answer pass
        # failed. The next full pass answers them; this call cannot wait for that.
        log.exception("answer pass for %s/%s failed", review.namespace, review.name)
        return Verdict(
            Action.DENY,
            review.uid,
            message=f"VMI {review.namespace}/{review.name}: the binder could not run an answer pass; try again",
        )
    lost: Exception | None = None
    while True:
        try:
            answers = answers_of(review, names, request_id)
            lost = None
        except (OperationalError, InterfaceError) as exc:
            # The connection dropped while waiting: reconnect on the next read; the
            # deadline still holds, and a pass that answered meanwhile is still found.
            _close_connection()
            answers, lost = None, exc
        if isinstance(answers, Verdict):
            return answers
        if answers is not None:
            answered = (a.removeprefix(ANSWER_BOUND) for a in answers.values() if a.startswith(ANSWER_BOUND))
            return conclude(review, with_nodes(view, answered), answers)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return database_unavailable(review, lost) if lost is not None else timed_out(review, wait)
        if listener is not None:
            seen = listener.wait(seen, min(remaining, RECHECK_SECONDS))
        else:
            time.sleep(min(remaining, POLL_SECONDS))


def annotate_in_cluster(review: Review, names: tuple[str, ...], request_id: str) -> Verdict | None:
    """Cluster mode: the bind request is the ``gpuplane.io/bind-request`` annotation on
    each GPU object (SPEC §1), with the VMI's nodeSelector beside it as
    ``gpuplane.io/bind-node-selector`` (SPEC §5 step 4), where the binder's fresh read finds them."""
    api = apiserver.api()
    for name in names:
        try:
            api.annotate_bind_request(review.namespace, name, request_id, review.scheduling.node_selector)
        except Exception as exc:  # noqa: BLE001 - any failure: a clear denial within the timeout, never a 500
            if isinstance(exc, ApiException) and exc.status == 404:
                return admission.set_changed(review)
            log.warning("bind request on GPU %s/%s not written: %s", review.namespace, name, describe(exc))
            return admission.bind_request_refused(review, describe(exc))
    return None


def reconnecting(read: Callable[[str], MirrorView], namespace: str) -> MirrorView:
    """``read(namespace)``, once more on a new connection if the pooled one turned out dead.

    With ``CONN_MAX_AGE`` each server thread keeps its connection between requests; after
    PostgreSQL dropped it (a restart, a failover, ``pg_terminate_backend``) the first query
    fails although the database is back. One reconnect saves that call a needless denial.
    """
    try:
        return read(namespace)
    except (OperationalError, InterfaceError):
        if connection.in_atomic_block:
            raise
        log.warning("database connection lost before the mirror read; reconnecting once", exc_info=True)
        _close_connection()
        return read(namespace)


def _close_connection() -> None:
    """Drop this thread's (broken) connection so the next query opens a new one."""
    if not connection.in_atomic_block:
        with contextlib.suppress(DatabaseError, InterfaceError):
            connection.close()


def database_unavailable(review: Review, exc: BaseException) -> Verdict:
    log.warning("VMI %s/%s denied: database unavailable: %s", review.namespace, review.name, describe(exc))
    _close_connection()
    return admission.database_unavailable(review)


def answers_of(review: Review, names: tuple[str, ...], request_id: str) -> dict[str, str] | Verdict | None:
    """The answers when every device answered ``request_id``; None while some have not.

    A device deleted meanwhile ends the wait with a denial (it will never answer).
    """
    found = models.GpuDevice.objects.filter(namespace__name=review.namespace, name__in=names).values_list(
        "name", "vm_name", "answered_request", "answer"
    )
    rows = {name: (answered, answer) for name, vm, answered, answer in found if vm == review.name}
    gone = sorted(set(names) - set(rows))
    if gone:
        # Deleted, or moved to another VM (spec.vmName edited) while this call waited.
        return admission.device_gone(review, gone[0])
    if any(answered != request_id for answered, _ in rows.values()):
        return None
    return {name: answer for name, (_, answer) in rows.items()}

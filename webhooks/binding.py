"""Bind and wait: the webhook's on-demand bind and its reads of the mirror.

When the set is not placed yet the webhook asks the binder:

1. write a new bind request id on every device of the set (one transaction, only the
   ``bind_request`` columns, which belong to the webhook) and queue an answer pass at
   commit (``binder.queue.queue_answer_pass``; in the embedded default it runs in
   process at commit, so the answer is already there when the commit returns);
2. wait up to ``GPUPLANE_BIND_WAIT_SECONDS`` until every device's ``answered_request``
   is that id. The database is the truth; on PostgreSQL the process's ``LISTEN``
   connection (``binder.runtime.answers``) says when to look again (a wait costs no
   query while nothing happens); elsewhere it polls every 50 ms.

Database failures (a dropped connection, a restart) end in a clear denial the caller
can retry; every denial's wording is in ``webhooks.admission``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from kubernetes.client import ApiException

from binder import apiserver, models, queue
from binder.engine import ANSWER_BOUND, Node
from binder.errors import describe
from binder.mirror.read import engine_settings
from binder.mirror.write import mirror_objects
from binder.runtime.answers import listening
from binder.runtime.readmodel import Slice, read_model
from webhooks import admission
from webhooks.admission import MirrorView, Review, Verdict, conclude, timed_out

log = logging.getLogger(__name__)

#: Polling interval where there is no notification (SQLite, or LISTEN unavailable).
POLL_SECONDS = 0.05
#: With a healthy LISTEN connection a wait re-reads the database only when woken: by a
#: pass's notification, or by the listener itself when its connection broke and again
#: when it listens anew (a notification sent in between is lost, so every waiter looks
#: once more). Nothing is read on a timer while nothing happens, until the deadline's
#: final read.
RECHECK_SECONDS = math.inf
#: The wait ends this long before the apiserver's own deadline, leaving time to answer.
TIMEOUT_MARGIN = 1.5


def read_nodes(names: Iterable[str]) -> tuple[Node, ...]:
    """The nodes of ``names`` from this process's read model, brought current first
    (missing ones are left out): the pin needs each node's own ``kubernetes.io/hostname``
    label, which may differ from its name."""
    wanted = {n for n in names if n}
    if not wanted:
        return ()
    return read_model().nodes(wanted)


def answered_view(view: MirrorView, names: Iterable[str]) -> MirrorView:
    """The namespace's view read again after the binder answered, with the nodes of ``names``.

    The view read before the bind holds the set as it was then: Pending, under its first
    choice. The answer pass may have bound it as a later choice, and the patch must name
    the class the set is held as (its raw resource and tolerations), so the view is read
    again; the answer pass committed before its answer was read, so a follow that starts
    now holds it.
    """
    fresh = mirror_view(view.namespace)
    held = {n.name for n in fresh.nodes}
    missing = {n for n in names if n and n not in held}
    return dataclasses.replace(fresh, nodes=(*fresh.nodes, *read_nodes(missing))) if missing else fresh


#: namespace -> (the model's slice it was made from, the view): a view is reused while its
#: slice is (so its device index is built once per change of the namespace, not per call).
_views: dict[str, tuple[Slice, MirrorView]] = {}
_views_lock = threading.Lock()


def mirror_view(namespace: str) -> MirrorView:
    """The mirror slice of one namespace that :func:`webhooks.admission.decide` reads:
    its devices, the nodes they are on, all classes, and its budgets, pods and VMIs.

    From this process's read model, after a follow of the change feed that began after
    this call arrived (``binder.runtime.readmodel``): every change committed before the
    call is in it, and normally the follow found nothing, so the call read one row.
    """
    engine = engine_settings()
    part = read_model().slice(namespace)
    with _views_lock:
        kept = _views.get(namespace)
    if kept is not None and kept[0] is part:
        view = kept[1]
    else:
        view = MirrorView(
            namespace=namespace,
            enabled=engine.enabled,
            devices=part.devices,
            nodes=part.nodes,
            classes=part.classes,
            budgets=part.budgets,
            pods=part.pods,
            vmis=part.vmis,
            default_budget=engine.default_budget,
        )
        with _views_lock:
            _views[namespace] = (part, view)
    if view.enabled != engine.enabled or view.default_budget != engine.default_budget:
        view = dataclasses.replace(view, enabled=engine.enabled, default_budget=engine.default_budget)
    return view


class _SetChanged(Exception):
    """The set's rows changed between the decision and the bind-request write."""


class _Joined(Exception):
    """This call joins the request in flight: nothing to write."""


def inflight_request(review: Review, names: tuple[str, ...], wait: float) -> str | None:
    """The set's bind request still waiting for its answer, if one was written within the
    last ``wait`` seconds (an older unanswered one belongs to a call that gave up: replace it)."""
    rows = list(
        models.GpuDevice.objects.filter(
            namespace__name=review.namespace, vm_name=review.name, name__in=names
        ).values_list("bind_request", "answered_request", "bind_requested_at")
    )
    if len(rows) != len(names):
        return None
    requests = {request for request, _, _ in rows}
    (request,) = requests if len(requests) == 1 else ("",)
    fresh_after = timezone.now() - timedelta(seconds=wait)
    if not request or any(answered == request or at is None or at < fresh_after for _, answered, at in rows):
        return None
    return request


def wait_budget(timeout: str | None) -> float:
    """How long a call may wait for its answer: ``GPUPLANE_BIND_WAIT_SECONDS``, and never past
    the caller. The kube-apiserver appends its own deadline to the webhook URL
    (``?timeout=10s``); an answer after that reaches no one (and a set bound for a VMI whose
    creation already failed is booked for nothing), so the wait ends ``TIMEOUT_MARGIN``
    seconds before it."""
    wait = float(settings.GPUPLANE_BIND_WAIT_SECONDS)
    match = re.fullmatch(r"(\d{1,4})s", timeout or "")
    if match is None:
        return wait
    return max(0.0, min(wait, int(match.group(1)) - TIMEOUT_MARGIN))


def bind_and_wait(  # noqa: C901 - write (or join), then one wait loop with its failure cases
    review: Review, view: MirrorView, verdict: Verdict, started: float, wait: float | None = None
) -> Verdict:
    """Write the bind requests (or join the one in flight), queue an answer pass and wait.

    The wait counts from the request's arrival (``started``), so the whole call stays
    within ``wait`` (:func:`wait_budget`) plus a final read, below the webhook timeout.
    Every device of the set gets the same request id: a pass answers a set as a whole, and
    an answer to an earlier request (a retried call) is not taken for ours. Several calls
    for one VM at once (the apiserver retrying, two replicas) share one request: a call
    that finds the set's request unanswered joins it instead of replacing it, and a call
    whose request was replaced follows the newer one, so every call gets the same answer.
    """
    wait = float(settings.GPUPLANE_BIND_WAIT_SECONDS) if wait is None else wait
    deadline = started + wait
    names = verdict.bind
    if wait <= 0:
        # No time left to wait for anything: write nothing, answer at once.
        return timed_out(review, 0.0)
    joined = inflight_request(review, names, wait)
    request_id = joined or uuid.uuid4().hex
    listener = listening()
    # Noted before the requests are written: a notification after this moves it.
    seen = listener.count if listener is not None else 0
    committed = False

    def mark_committed() -> None:
        nonlocal committed
        committed = True

    annotated: list[dict[str, Any]] = []
    if joined is None and apiserver.cluster_mode():
        refused = annotate_in_cluster(review, names, request_id, annotated)
        if refused is not None:
            return refused
    try:
        with transaction.atomic():
            if annotated:
                # The objects as the API server stored them: the rows get the version the
                # binder's status write must name (else it meets a 409 until the watch
                # brings the annotation).
                mirror_objects("GPU", annotated, queue=False)
            if joined is not None:
                # The request in flight has its answer pass queued; asking again is collapsed.
                transaction.on_commit(mark_committed)
                queue.queue_answer_pass()
                raise _Joined
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
    except _Joined:
        pass
    except _SetChanged:
        return admission.set_changed(review)
    except Exception:
        if not committed:
            raise
        # The requests are written; running (embedded) or publishing the answer pass
        # failed. The next full pass answers them; this call cannot wait for that.
        log.exception("answer pass for %s/%s failed", review.namespace, review.name)
        return admission.answer_pass_failed(review)
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
        if isinstance(answers, str):
            request_id = answers  # replaced by a newer call's request: its answer is ours
            continue
        if isinstance(answers, Verdict):
            return answers
        if answers is not None:
            answered = (a.removeprefix(ANSWER_BOUND) for a in answers.values() if a.startswith(ANSWER_BOUND))
            return conclude(review, answered_view(view, answered), answers)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return database_unavailable(review, lost) if lost is not None else timed_out(review, wait)
        if listener is not None:
            seen = listener.wait(seen, min(remaining, RECHECK_SECONDS))
        else:
            time.sleep(min(remaining, POLL_SECONDS))


def annotate_in_cluster(
    review: Review, names: tuple[str, ...], request_id: str, annotated: list[dict[str, Any]]
) -> Verdict | None:
    """Cluster mode: the bind request is the ``gpuplane.io/bind-request`` annotation on
    each GPU object, with the VMI's nodeSelector beside it as
    ``gpuplane.io/bind-node-selector``; the objects the API server
    returned go to ``annotated`` (the caller mirrors them)."""
    api = apiserver.api()
    for name in names:
        try:
            annotated.append(
                api.annotate_bind_request(review.namespace, name, request_id, review.scheduling.node_selector)
            )
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


def answers_of(review: Review, names: tuple[str, ...], request_id: str) -> dict[str, str] | Verdict | str | None:
    """The answers when every device answered ``request_id``; None while some have not; the
    newer request id when another call replaced ``request_id`` on every device (follow it).

    A device deleted meanwhile ends the wait with a denial (it will never answer).
    """
    found = models.GpuDevice.objects.filter(namespace__name=review.namespace, name__in=names).values_list(
        "name", "vm_name", "bind_request", "answered_request", "answer"
    )
    rows = {name: (request, answered, answer) for name, vm, request, answered, answer in found if vm == review.name}
    gone = sorted(set(names) - set(rows))
    if gone:
        # Deleted, or moved to another VM (spec.vmName edited) while this call waited.
        return admission.device_gone(review, gone[0])
    if all(answered == request_id for _, answered, _ in rows.values()):
        return {name: answer for name, (_, _, answer) in rows.items()}
    latest = {request for request, _, _ in rows.values()}
    if len(latest) == 1 and request_id not in latest and "" not in latest:
        # Superseded on every device: the newer request's answer answers this call too.
        return latest.pop()
    return None

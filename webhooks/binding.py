"""Bind and wait, and pin: the webhook's writes and its reads of the mirror.

When the set is Bound the webhook pins the VMI to it, but first stamps the set's first member
admitted (its row, in both modes), conditioned on the placement it decided from (:func:`pin`;
both ends of that protocol are in ``binder.runtime.admissions``): a pass moving the set at the
same moment then leaves it where it is, or the webhook's stamp matches nothing and it decides
afresh.

When the set is not placed yet the webhook asks the binder:

1. write a new bind request id on every device of the set (standalone: one statement, only
   the ``bind_request`` columns, which belong to the webhook; cluster mode: the
   ``gpuplane.io/bind-request`` annotation on each GPU through the API server,
   :func:`annotate_in_cluster`, mirrored at once) and queue an answer pass at commit
   (``binder.queue.queue_answer_pass``; in the embedded default it runs in process at
   commit, so the answer is already there when the commit returns);
2. wait up to ``GPUPLANE_BIND_WAIT_SECONDS`` until every device's ``answered_request``
   is that id. The database is the truth; on PostgreSQL the process's ``LISTEN``
   connection (``binder.runtime.answers``) says when to look again (a wait costs no
   query while nothing happens); elsewhere it polls every 50 ms. The answer is then
   pinned as above.

Database failures (a dropped connection, a restart) end in a clear denial the caller
can retry; every denial's wording is in ``webhooks.admission``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from kubernetes.client import ApiException

from binder import apiserver, queue
from binder.engine import ANSWER_BOUND, Device, Node
from binder.errors import describe
from binder.kube import client as kube_client
from binder.mirror.read import engine_settings
from binder.mirror.write import mirror_objects
from binder.runtime import admissions, bind_requests, readmodel
from binder.runtime.answers import ANSWERS, AnswerListener, listening
from binder.runtime.flight import SingleFlight
from binder.runtime.readmodel import Slice, read_model
from webhooks import admission
from webhooks.admission import Action, MirrorView, Review, Verdict, conclude, decide, timed_out

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


def answered_view(view: MirrorView, names: Iterable[str], rows: Iterable[Device] = ()) -> MirrorView:
    """The view the patch is built from once the binder answered, with the nodes of ``names``.

    The view read before the bind holds the set as it was then: Pending, under its first
    choice. The answer pass may have bound it as a later choice, and the patch must name
    the class the set is held as (its raw resource and tolerations). ``rows`` are the set's
    devices as the answer read found them (whole rows, converted as the mirror converts
    them): that read began after the answer pass committed, and everything else the view
    holds was committed before the call arrived, which is all a decision needs (a decision
    reads what was committed before the call, never less).
    A node the view does not hold comes from the read model as it stands (it followed at
    least once since the call arrived). When a class or node is not there, or without
    ``rows``, the namespace is read again from a follow that starts now.
    """
    wanted = {n for n in names if n}
    records = {d.name: d for d in rows}
    if records:
        quick = _with_set_rows(view, records, wanted)
        if quick is not None:
            return quick
    fresh = mirror_view(view.namespace)
    held = {n.name for n in fresh.nodes}
    missing = {n for n in wanted if n not in held}
    return dataclasses.replace(fresh, nodes=(*fresh.nodes, *read_nodes(missing))) if missing else fresh


def _with_set_rows(view: MirrorView, records: dict[str, Device], nodes: set[str]) -> MirrorView | None:
    """``view`` with the set's ``records`` and the nodes ``nodes`` added; None when the view
    and the model as it stands lack a class or node they need."""
    classes = {c.name for c in view.classes}
    if any(d.class_name not in classes for d in records.values()):
        return None
    missing = nodes - {n.name for n in view.nodes}
    added = readmodel.MODEL.nodes(missing) if missing else ()
    if len(added) != len(missing):
        return None
    records = dict(records)
    devices = tuple(records.pop(d.name, d) for d in view.devices)
    return dataclasses.replace(view, devices=(*devices, *records.values()), nodes=(*view.nodes, *added))


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


#: Admissions in a row a call tries while passes keep moving its set, before it asks for a retry.
PIN_TRIES = 3


def pin(review: Review, view: MirrorView, verdict: Verdict) -> Verdict:
    """Before allowing a VMI pinned to its Bound set (``verdict`` a patch), stamp the set's first
    member admitted, conditioned on the placement the decision read
    (``binder.runtime.admissions``): a pass moving or releasing the set at the same time then
    leaves it instead. When the stamp matches nothing (a pass moved the set first), read again
    and decide afresh: the new pin, a bind request, or a refusal. Dry runs write nothing.
    """
    for _ in range(PIN_TRIES):
        if verdict.action is not Action.PATCH or review.dry_run:
            return verdict
        members = view.index().by_vm.get(review.name, ())
        if not members:
            return verdict
        first = min(members, key=lambda d: d.name)
        if admissions.admit(first):
            return verdict
        view = mirror_view(review.namespace)
        verdict = decide(review, view)
    return verdict if verdict.action is not Action.PATCH else admission.set_kept_moving(review, PIN_TRIES)


class _SetChanged(Exception):
    """The set's rows changed between the decision and the bind-request write."""


def _write(
    review: Review, names: tuple[str, ...], request_id: str, joined: str | None, cluster: bool, wait: float
) -> str:
    """Write ``request_id`` on the set's devices, or join the request in flight (``joined``,
    or one the write finds); the request the call then waits for. :class:`_SetChanged`
    when the set changed under the check."""
    if joined is not None:
        return joined
    selector = review.scheduling.node_selector
    if not cluster:
        found = bind_requests.write_or_join(review.namespace, review.name, names, request_id, selector, wait)
        if found is None:
            raise _SetChanged
        return found
    if bind_requests.write_requests(review.namespace, review.name, names, request_id, selector) != len(names):
        raise _SetChanged
    return request_id


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


def bind_and_wait(
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
    if wait <= 0 or deadline <= time.monotonic():
        # No time left to wait for anything (the budget is spent, or the call spent it
        # queued for a thread): write nothing, answer at once.
        return admission.no_time_to_bind(review, TIMEOUT_MARGIN)
    limit = settings.GPUPLANE_WEBHOOK_MAX_WAITING
    if not ANSWER_READS.enter(limit):
        # Every call from here on holds a thread until the binder answers: shed at once, write nothing.
        return admission.too_many_waiting(review, limit)
    try:
        return _bind(review, view, names, deadline, wait)
    finally:
        ANSWER_READS.leave()


def _bind(review: Review, view: MirrorView, names: tuple[str, ...], deadline: float, wait: float) -> Verdict:
    """:func:`bind_and_wait` once the call holds a place among the waiting ones."""
    cluster = apiserver.cluster_mode()
    # Cluster mode asks first (a request in flight needs no annotation); standalone, the
    # write itself finds a request in flight (``bind_requests.write_or_join``).
    joined = bind_requests.inflight_request(review.namespace, review.name, names, wait) if cluster else None
    request_id = joined or uuid.uuid4().hex
    listener = listening()
    # Noted before the requests are written: a notification after this moves it.
    seen = listener.count if listener is not None else 0
    committed = False

    def mark_committed() -> None:
        nonlocal committed
        committed = True

    annotated: list[dict[str, Any]] = []
    if joined is None and cluster:
        refused = annotate_in_cluster(review, names, request_id, annotated)
        if refused is not None:
            return refused
    try:
        # Cluster mode mirrors the annotated objects with the write, in one transaction;
        # standalone, the write is one statement, committed as it runs.
        with transaction.atomic() if annotated else contextlib.nullcontext():
            if annotated:
                # The objects as the API server stored them: the rows get the version the
                # binder's status write must name (else it meets a 409 until the watch
                # brings the annotation).
                mirror_objects("GPU", annotated, queue=False)
            request_id = _write(review, names, request_id, joined, cluster, wait)
            transaction.on_commit(mark_committed)
            # Joining a request in flight: its answer pass is queued; asking again is collapsed.
            queue.queue_answer_pass()
    except _SetChanged:
        return admission.set_changed(review)
    except Exception:
        if not committed:
            raise
        # The requests are written; running (embedded) or publishing the answer pass
        # failed. The next full pass answers them; this call cannot wait for that.
        log.exception("answer pass for %s/%s failed", review.namespace, review.name)
        return admission.answer_pass_failed(review)
    with ANSWER_READS.waiting(review.namespace, names):
        return _wait(review, view, names, request_id, listener, seen, deadline, wait)


def _wait(
    review: Review,
    view: MirrorView,
    names: tuple[str, ...],
    request_id: str,
    listener: AnswerListener | None,
    seen: int,
    deadline: float,
    wait: float,
) -> Verdict:
    """Read the answers until every device answered ``request_id`` (or a newer request), or
    the deadline: first at once, then each time the listener wakes this call (or every
    :data:`POLL_SECONDS` without one)."""
    lost: Exception | None = None
    woken: int | None = None
    while True:
        try:
            answers = answers_of(review, names, request_id, woken)
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
            return conclude(review, answered_view(view, answered, answers.rows), answers)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return database_lost(review, lost) if lost is not None else timed_out(review, wait)
        if listener is not None:
            seen = woken = listener.wait(seen, min(remaining, RECHECK_SECONDS))
        else:
            time.sleep(min(remaining, POLL_SECONDS))


def annotate_in_cluster(
    review: Review, names: tuple[str, ...], request_id: str, annotated: list[dict[str, Any]]
) -> Verdict | None:
    """Cluster mode: the bind request is the ``gpuplane.io/bind-request`` annotation on
    each GPU object, with the VMI's nodeSelector beside it as
    ``gpuplane.io/bind-node-selector``; the objects the API server
    returned go to ``annotated`` (the caller mirrors them). The writes go out several at
    once (``kube_client.each_in_flight``): an 8-GPU VM waits for about one round trip, not
    eight in a row, out of the apiserver's timeout."""
    api = apiserver.api()
    selector = review.scheduling.node_selector

    def write(name: str) -> dict[str, Any]:
        return api.annotate_bind_request(review.namespace, name, request_id, selector)

    # Any failure comes back in its place: a clear denial within the timeout, never a 500.
    outcomes = kube_client.each_in_flight(write, names)
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, ApiException) and outcome.status == 404:
            return admission.set_changed(review)
        if isinstance(outcome, Exception):
            log.warning("bind request on GPU %s/%s not written: %s", review.namespace, name, describe(outcome))
            return admission.bind_request_refused(review, describe(outcome))
        annotated.append(outcome)
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


def database_lost(review: Review, exc: BaseException) -> Verdict:
    """The database failed under this call: log it, drop the broken connection, and deny
    (the denial itself is ``admission.database_unavailable``)."""
    log.warning("VMI %s/%s denied: database unavailable: %s", review.namespace, review.name, describe(exc))
    _close_connection()
    return admission.database_unavailable(review)


#: One device's row as an engine record: its answer columns (``vm_name``, ``bind_request``,
#: ``answered_request``, ``answer``), and the whole record :func:`answered_view` builds the
#: patch from.
Row = Device


class AnswerReads:
    """One query for the answers of every call waiting in this process, shared.

    Each pass that answers wakes every waiting call (the notification does not say whose
    request it answered), and each used to read its own devices: with 25 calls waiting in
    a process that was 25 queries per pass, most of them finding nothing new. A waiting
    call registers its devices (:meth:`waiting`, once its bind request is committed); a
    read takes the rows of every registered call in one statement, and serves every call
    it may (single flight, as the read model's follow). A call uses a read that included
    its own registration (so began after its request was committed) and that began after
    the call asked, or, when the listener woke the call, once the listener had counted that
    wake (the pass that sent the notification had committed before it was delivered). A
    read that fails serves no one; each call then tries its own.
    """

    def __init__(self) -> None:
        self._flight: SingleFlight[_AnswerRead] = SingleFlight()
        #: token -> (namespace, device names) of each registered call.
        self._waiting: dict[int, tuple[str, tuple[str, ...]]] = {}
        self._tokens = itertools.count(1)
        self._mine = threading.local()
        self._calls = 0

    def enter(self, limit: int) -> bool:
        """Count one more call waiting for the binder, unless ``limit`` (0: none) are already."""
        with self._flight.lock:
            if limit and self._calls >= limit:
                return False
            self._calls += 1
            return True

    def leave(self) -> None:
        with self._flight.lock:
            self._calls -= 1

    @contextlib.contextmanager
    def waiting(self, namespace: str, names: tuple[str, ...]) -> Iterator[None]:
        """Include these devices in every read while the block runs (this thread's call)."""
        token = next(self._tokens)
        with self._flight.lock:
            self._waiting[token] = (namespace, names)
        outer = getattr(self._mine, "call", None)
        self._mine.call = (token, namespace, names)
        try:
            yield
        finally:
            self._mine.call = outer
            with self._flight.lock:
                del self._waiting[token]

    def rows(self, namespace: str, names: tuple[str, ...], woken: int | None = None) -> dict[str, Row]:
        """The rows of ``names`` in ``namespace``, from a read that began after this call,
        or after the listener's count reached ``woken``."""
        call = getattr(self._mine, "call", None)
        if call is None or call[1:] != (namespace, names):
            with self.waiting(namespace, names):
                return self.rows(namespace, names, woken)
        token = call[0]

        def served(read: _AnswerRead, fresh: bool) -> bool:
            return token in read.included and (fresh or (woken is not None and read.epoch >= woken))

        def begin() -> Callable[[], _AnswerRead]:
            wanted = dict(self._waiting)

            def read() -> _AnswerRead:
                listener = ANSWERS if ANSWERS.listening.is_set() else None
                epoch = listener.count if listener is not None else -1
                return _AnswerRead(frozenset(wanted), epoch, bind_requests.read_rows(wanted.values()))

            return read

        found = self._flight.run(begin, served).rows
        return {name: found[(namespace, name)] for name in names if (namespace, name) in found}


@dataclasses.dataclass(frozen=True, slots=True)
class _AnswerRead:
    """One shared read: the calls it included, the listener's count before it, the rows."""

    included: frozenset[int]
    epoch: int
    rows: dict[tuple[str, str], Row]


#: This process's shared answer reads.
ANSWER_READS = AnswerReads()


class Answers(dict[str, str]):
    """Each device's answer, and the set's rows as the answer read found them (``rows``)."""

    rows: tuple[Device, ...] = ()


def answers_of(
    review: Review, names: tuple[str, ...], request_id: str, woken: int | None = None
) -> Answers | Verdict | str | None:
    """The answers when every device answered ``request_id``; None while some have not; the
    newer request id when another call replaced ``request_id`` on every device (follow it).

    A device deleted meanwhile ends the wait with a denial (it will never answer). The rows
    come from a read shared with the other waiting calls (:class:`AnswerReads`; ``woken``:
    the listener's count when it woke this call).
    """
    found = ANSWER_READS.rows(review.namespace, names, woken)
    rows = {name: device for name, device in found.items() if device.vm_name == review.name}
    gone = sorted(set(names) - set(rows))
    if gone:
        # Deleted, or moved to another VM (spec.vmName edited) while this call waited.
        return admission.device_gone(review, gone[0])
    if all(device.answered_request == request_id for device in rows.values()):
        done = Answers({name: device.answer for name, device in rows.items()})
        done.rows = tuple(rows.values())
        return done
    latest = {device.bind_request for device in rows.values()}
    if len(latest) == 1 and request_id not in latest and "" not in latest:
        # Superseded on every device: the newer request's answer answers this call too.
        return latest.pop()
    return None

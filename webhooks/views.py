"""``POST /webhooks/vmi``: the VMI admission webhook's HTTP side (SPEC §5).

The decision itself is pure (``webhooks.admission``); this view only parses, reads the
mirror slice the decision needs, and, when the set is not placed yet, asks the binder:

1. write a new bind request id on every device of the set (one transaction, only the
   ``bind_request`` columns, which belong to the webhook) and queue an answer pass at
   commit (``binder.tasks.queue_answer_pass``; in the embedded default it runs in
   process at commit, so the answer is already there when the commit returns);
2. wait up to ``GPUPLANE_BIND_WAIT_SECONDS`` until every device's ``answered_request``
   is that id. The database is the truth; on PostgreSQL a ``LISTEN gpuplane_answers``
   connection (the pass sends ``NOTIFY`` at commit when it answered something) says
   when to look again, instead of Celery's 0.5 s result polling; elsewhere it polls
   every 50 ms.

The kube-apiserver authenticates the webhook by TLS (added with the serving
certificate), so there is no DRF authentication here, and CSRF does not apply.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from kubernetes.client import ApiException
from rest_framework.exceptions import APIException
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from binder import kubeapi, models, tasks
from binder.errors import describe
from binder.mirror import engine_settings, read_rows
from binder.passes import ANSWERS_CHANNEL

from .admission import (
    Action,
    MirrorView,
    Review,
    ReviewError,
    Verdict,
    conclude,
    decide,
    error_body,
    parse_review,
    response,
    timed_out,
)

log = logging.getLogger(__name__)

#: Polling interval where there is no notification (SQLite, or LISTEN unavailable).
POLL_SECONDS = 0.05
#: With LISTEN, the database is still re-read this often in case a notification is lost
#: (e.g. the listening connection broke); notifications normally wake the wait at once.
RECHECK_SECONDS = 1.0


def mirror_view(namespace: str) -> MirrorView:
    """The mirror slice of one namespace that :func:`webhooks.admission.decide` reads."""
    scope = [namespace]
    engine = engine_settings()
    return MirrorView(
        namespace=namespace,
        enabled=engine.enabled,
        devices=tuple(read_rows("GPU", scope)),
        classes=tuple(read_rows("GPUClass")),
        budgets=tuple(read_rows("GPUBudget", scope)),
        pods=tuple(read_rows("Pod", scope)),
        vmis=tuple(read_rows("VirtualMachineInstance", scope)),
        default_budget=engine.default_budget,
    )


class _AlwaysJson(DefaultContentNegotiation):
    """Answer JSON whatever the Accept header says: the caller is the kube-apiserver, and a
    406 would count as a failed call (and fall under failurePolicy)."""

    def select_renderer(self, request: Request, renderers: list[Any], format_suffix: str | None = None) -> Any:
        return renderers[0], renderers[0].media_type


#: The OpenAPI shape of an AdmissionReview (only what the schema needs to say; the
#: strict checks are in ``webhooks.admission.parse_review``).
ADMISSION_REVIEW = {
    "type": "object",
    "required": ["apiVersion", "kind"],
    "properties": {
        "apiVersion": {"type": "string", "example": "admission.k8s.io/v1"},
        "kind": {"type": "string", "example": "AdmissionReview"},
        "request": {"type": "object", "additionalProperties": True},
        "response": {"type": "object", "additionalProperties": True},
    },
}
WEBHOOK_ERROR = {
    "type": "object",
    "required": ["error", "field"],
    "properties": {"error": {"type": "string"}, "field": {"type": "string"}},
}


class _SetChanged(Exception):
    """The set's rows changed between the decision and the bind-request write."""


class VmiAdmissionView(APIView):
    """AdmissionReview v1 in, AdmissionReview v1 out (HTTP 400 with a JSON error if malformed)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    parser_classes = [JSONParser]
    #: JSON whatever the Accept header says (no browsable-API HTML for a machine caller).
    renderer_classes = [JSONRenderer]
    content_negotiation_class = _AlwaysJson

    @extend_schema(
        operation_id="webhook_vmi",
        summary="VMI admission webhook (called by the kube-apiserver)",
        description=(
            "AdmissionReview v1 for a VirtualMachineInstance CREATE. Allows a VMI naming no gpuplane.io "
            "devices untouched; otherwise pins it to the node holding its GPU set (JSONPatch) or denies "
            "with the binder's reason. Malformed reviews get 400 naming the field; bodies over "
            "GPUPLANE_WEBHOOK_MAX_BYTES get 413. No authentication: serve it over TLS to the apiserver only."
        ),
        auth=[],
        request={"application/json": ADMISSION_REVIEW},
        responses={
            200: OpenApiResponse(ADMISSION_REVIEW, description="the AdmissionReview with its response"),
            400: OpenApiResponse(WEBHOOK_ERROR, description="malformed review: the field and why"),
            413: OpenApiResponse(WEBHOOK_ERROR, description="body too large"),
        },
    )
    def post(self, request: Request) -> Response:
        started = time.monotonic()
        length = request.META.get("CONTENT_LENGTH") or "0"
        limit = settings.GPUPLANE_WEBHOOK_MAX_BYTES
        if not length.isdigit() or int(length) > limit:
            # Refused before reading: DRF's parser would read any size into memory.
            message = f"the body is {length} bytes; at most {limit} are accepted"
            return Response({"error": message, "field": "(body)"}, status=413)
        try:
            body = request.data
        except (APIException, RecursionError, ValueError) as exc:
            # A parse error, an unsupported media type or a body nested too deep for the
            # JSON decoder: the caller's fault, always a 400 with a JSON body.
            detail = getattr(exc, "detail", None) or "the body is not valid JSON"
            return Response({"error": str(detail), "field": "(body)"}, status=400)
        try:
            review = parse_review(body)
        except ReviewError as exc:
            return Response(error_body(exc), status=400)
        try:
            if review.needs_mirror:
                view = _reconnecting(mirror_view, review.namespace)
            else:
                view = MirrorView(namespace=review.namespace)
            verdict = decide(review, view)
            if verdict.action is Action.BIND:
                verdict = bind_and_wait(review, view, verdict, started)
        except (DatabaseError, InterfaceError) as exc:
            # The database went away (dropped connection, restart, failover): a clear denial
            # the caller can retry, never a 500 (which failurePolicy would turn into a
            # less obvious refusal, or an admission without the node pin).
            verdict = _database_unavailable(review, exc)
        return Response(response(verdict))


def bind_and_wait(review: Review, view: MirrorView, verdict: Verdict, started: float) -> Verdict:
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
    with _listener() as listener:
        # Noted before the requests are written: a notification after this moves it.
        seen = listener.count if listener is not None else 0
        committed = False

        def mark_committed() -> None:
            nonlocal committed
            committed = True

        if kubeapi.cluster_mode():
            refused = annotate_in_cluster(review, names, request_id)
            if refused is not None:
                return refused
        try:
            with transaction.atomic():
                written = models.GpuDevice.objects.filter(
                    namespace__name=review.namespace, vm_name=review.name, name__in=names
                ).update(bind_request=request_id, bind_requested_at=timezone.now())
                if written != len(names):
                    raise _SetChanged
                transaction.on_commit(mark_committed)
                tasks.queue_answer_pass()
        except _SetChanged:
            return _changed(review)
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
                answers = _answers(review, names, request_id)
                lost = None
            except (OperationalError, InterfaceError) as exc:
                # The connection dropped while waiting: reconnect on the next read; the
                # deadline still holds, and a pass that answered meanwhile is still found.
                _close_connection()
                answers, lost = None, exc
            if isinstance(answers, Verdict):
                return answers
            if answers is not None:
                return conclude(review, view, answers)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _database_unavailable(review, lost) if lost is not None else timed_out(review, wait)
            if listener is not None:
                seen = listener.wait(seen, min(remaining, RECHECK_SECONDS))
            else:
                time.sleep(min(remaining, POLL_SECONDS))


def annotate_in_cluster(review: Review, names: tuple[str, ...], request_id: str) -> Verdict | None:
    """Cluster mode: the bind request is the ``gpuplane.io/bind-request`` annotation on
    each GPU object (SPEC §1), where the binder's fresh read finds it."""
    api = kubeapi.api()
    for name in names:
        try:
            api.annotate_bind_request(review.namespace, name, request_id)
        except Exception as exc:  # any failure: a clear denial within the timeout, never a 500
            if isinstance(exc, ApiException) and exc.status == 404:
                return _changed(review)
            log.warning("bind request on GPU %s/%s not written: %s", review.namespace, name, describe(exc))
            return Verdict(
                Action.DENY,
                review.uid,
                message=f"VMI {review.namespace}/{review.name}: the API server refused the bind request "
                f"({describe(exc)}); try again",
            )
    return None


def _reconnecting(read: Callable[[str], MirrorView], namespace: str) -> MirrorView:
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


def _database_unavailable(review: Review, exc: BaseException) -> Verdict:
    log.warning("VMI %s/%s denied: database unavailable: %s", review.namespace, review.name, describe(exc))
    _close_connection()
    return Verdict(
        Action.DENY,
        review.uid,
        message=f"VMI {review.namespace}/{review.name}: the gpuplane database is unavailable; try again",
    )


def _changed(review: Review) -> Verdict:
    return Verdict(
        Action.DENY,
        review.uid,
        message=f"VMI {review.namespace}/{review.name}: its set of GPU devices changed while it was checked; try again",
    )


def _answers(review: Review, names: tuple[str, ...], request_id: str) -> dict[str, str] | Verdict | None:
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
        return Verdict(
            Action.DENY,
            review.uid,
            message=f"VMI {review.namespace}/{review.name}: device gpuplane.io/{gone[0]} was deleted "
            f"or no longer belongs to VM {review.name}; try again",
        )
    if any(answered != request_id for answered, _ in rows.values()):
        return None
    return {name: answer for name, (_, answer) in rows.items()}


class AnswerListener:
    """One ``LISTEN gpuplane_answers`` connection per process, shared by every waiting call.

    A connection per waiting call would not scale: under 50 concurrent calls gunicorn's
    own connections plus one listener each went past PostgreSQL's default of 100
    connections. Here a daemon thread holds the only listener and counts notifications;
    a caller notes the count before writing its bind requests and waits for it to move,
    then reads the database (the truth). If the connection drops, the thread reconnects;
    callers re-read the database every ``RECHECK_SECONDS`` anyway, so a notification
    lost in the gap delays an answer, never loses it.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0
        self._thread: threading.Thread | None = None
        self._params: dict[str, Any] = {}
        self.listening = threading.Event()
        self._stop = threading.Event()

    def start(self) -> bool:
        """Start the thread once per process (PostgreSQL only); True while it listens."""
        if connection.vendor != "postgresql":
            return False
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._params = {**connection.get_connection_params(), "connect_timeout": 2}
                self._thread = threading.Thread(target=self._run, name="gpuplane-answer-listener", daemon=True)
                self._thread.start()
        return self.listening.wait(timeout=2)

    @property
    def count(self) -> int:
        with self._changed:
            return self._count

    def wait(self, seen: int, timeout: float) -> int:
        """Until the count passes ``seen`` or ``timeout`` seconds went by; the new count."""
        with self._changed:
            self._changed.wait_for(lambda: self._count > seen, timeout=timeout)
            return self._count

    def stop(self) -> None:
        """Close the listener (tests, and before a database is dropped); start() reopens it."""
        thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join(timeout=5)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(**self._params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {ANSWERS_CHANNEL}")
                    self.listening.set()
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=0.5):
                            with self._changed:
                                self._count += 1
                                self._changed.notify_all()
            except psycopg.Error:
                log.warning("LISTEN %s failed; retrying in 1 s", ANSWERS_CHANNEL, exc_info=True)
            self.listening.clear()
            with self._changed:  # wake waiters: they re-read the database
                self._count += 1
                self._changed.notify_all()
            self._stop.wait(1)


ANSWERS = AnswerListener()


@contextlib.contextmanager
def _listener() -> Iterator[AnswerListener | None]:
    """The process's answer listener when it is listening (PostgreSQL), else None: poll."""
    yield ANSWERS if ANSWERS.start() else None

"""``POST /webhooks/vmi``: the VMI admission webhook's HTTP side.

HTTP only, and lean: the webhook is on the path of every VMI the cluster creates, so a
call is a plain Django view (no DRF content negotiation, parsing or rendering: that was
a large part of a Bound call's CPU), decoded and encoded with orjson. In order: the
caller check (before the body is read: an unauthenticated caller learns nothing and
writes nothing), the size limit (before reading: 413), the JSON decode and the strict
review parser (400 naming the field), the decision from the process's read model
(``webhooks.binding.mirror_view``), and, when the set is not placed yet, the
bind-and-wait. Every answer is JSON, whatever the Accept header says: the caller is the
kube-apiserver, and a 406 would count as a failed call.

The kube-apiserver authenticates the webhook by TLS (added with the serving
certificate) or a bearer token (``webhooks.callers``); CSRF does not apply.

The OpenAPI schema still describes the endpoint: drf-spectacular documents DRF views
only, so the URL's view carries :class:`VmiAdmissionSchema` (a DRF view that is never
routed to, holding the schema) as its ``cls``.

The webhook server (``deploy/webhook_server.py``) serves the application through
:class:`Front`, at the end of this module: it admits a bounded number of calls per process
and answers the rest "try again" from granian's event loop (why: the comment above it).
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import orjson
from django.conf import settings
from django.db import DatabaseError, InterfaceError
from django.http import HttpRequest, HttpResponse
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from webhooks.admission import (
    Action,
    MirrorView,
    Review,
    ReviewError,
    decide,
    error_body,
    overloaded,
    parse_review,
    response,
)
from webhooks.binding import bind_and_wait, database_unavailable, mirror_view, reconnecting, wait_budget
from webhooks.callers import CallerPolicy, refusal

#: The one media type a review may come as (the kube-apiserver sends it).
JSON_MEDIA_TYPE = "application/json"
#: The environ key holding a call's arrival (``time.monotonic()``) in the webhook server's
#: event loop (:class:`Front`).
ARRIVED = "gpuplane.arrived"


def caller_policy() -> CallerPolicy:
    return CallerPolicy(
        enabled=settings.GPUPLANE_WEBHOOK_ENABLED,
        auth=settings.GPUPLANE_WEBHOOK_AUTH,
        token=settings.GPUPLANE_WEBHOOK_TOKEN,
        serving=settings.GPUPLANE_SERVE,
        cluster_mode=settings.GPUPLANE_CLUSTER == "kubernetes",
    )


def _json(body: Mapping[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> HttpResponse:
    return HttpResponse(orjson.dumps(body), status=status, content_type=JSON_MEDIA_TYPE, headers=headers)


def _error(message: str, field: str, status: int) -> HttpResponse:
    return _json({"error": message, "field": field}, status)


class BodyError(ValueError):
    """The body is not a JSON document this endpoint reads (HTTP 400 naming ``(body)``)."""


def _reject_constant(value: str) -> Any:
    raise BodyError(f"JSON parse error - {value} is not valid JSON")


def decode_body(raw: bytes, content_type: str) -> Any:
    """The JSON document of a review body; :class:`BodyError` saying why not.

    orjson decodes the common case. What it refuses is decoded again by the standard
    library, strictly (no NaN or Infinity), so what was accepted before is still: a lone
    surrogate escape such as ``"\\ud800"`` decodes there and the review parser then names
    the field it is in.
    """
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise BodyError(f'Unsupported media type "{content_type[:100]}" in request.')
    if not raw:
        raise BodyError("JSON parse error - the body is empty")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as fast:
        try:
            text = raw.decode("utf-8")
            return json.loads(text, parse_constant=_reject_constant)
        except BodyError:
            raise
        except (ValueError, RecursionError):
            raise BodyError(f"JSON parse error - {fast}") from None


#: The OpenAPI shape of an AdmissionReview (only what the schema needs to say; the
#: strict checks are in ``webhooks.review.parse_review``).
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


class Refused(NamedTuple):
    """An answer given without a decision: the status, the JSON body and any extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] | None = None


def _refused_error(message: str, field: str, status: int) -> Refused:
    return Refused(status, {"error": message, "field": field})


def gate(authorization: str, content_length: str) -> Refused | None:
    """The checks made before the body is read: who calls, and how much they send.

    Shared by the view and the webhook server's admission step (:class:`Front`), which
    makes them before it reads a body it is about to shed.
    """
    refused = refusal(caller_policy(), {"Authorization": authorization})
    if refused is not None:
        # Before the body is read: an unauthenticated caller learns nothing and writes nothing.
        status, message = refused
        headers = {"WWW-Authenticate": 'Bearer realm="gpuplane-webhook"'} if status == 401 else None
        return Refused(status, {"error": message, "field": "(caller)"}, headers)
    length = content_length or "0"
    limit = settings.GPUPLANE_WEBHOOK_MAX_BYTES
    if not length.isdigit() or int(length) > limit:
        # Refused before reading: nothing of an oversized body is held in memory.
        return _refused_error(f"the body is {length} bytes; at most {limit} are accepted", "(body)", 413)
    return None


def review_of(raw: bytes, content_type: str) -> Review | Refused:
    """The parsed review of a body that passed :func:`gate`, or the 400 naming what is wrong."""
    try:
        body = decode_body(raw, content_type)
    except BodyError as exc:
        return _refused_error(str(exc), "(body)", 400)
    try:
        return parse_review(body)
    except ReviewError as exc:
        return Refused(400, error_body(exc))


def admit(request: HttpRequest) -> HttpResponse:
    """One AdmissionReview v1 in, one out (HTTP 400 with a JSON error if malformed)."""
    # Its arrival in the webhook server's event loop (:class:`Front`), so time spent
    # queued for a thread counts against the caller's deadline; now, served any other way.
    started = request.META.get(ARRIVED) or time.monotonic()
    # The one header the check reads, without building ``request.headers`` from every header.
    refused = gate(request.META.get("HTTP_AUTHORIZATION", ""), request.META.get("CONTENT_LENGTH") or "")
    if refused is not None:
        return _json(refused.body, refused.status, refused.headers)
    try:
        raw = request.read()
    except OSError:
        return _error("the body could not be read", "(body)", 400)
    review = review_of(raw, request.META.get("CONTENT_TYPE") or "")
    if isinstance(review, Refused):
        return _json(review.body, review.status, review.headers)
    try:
        if review.needs_mirror:
            view = reconnecting(mirror_view, review.namespace)
        else:
            view = MirrorView(namespace=review.namespace)
        verdict = decide(review, view)
        if verdict.action is Action.BIND:
            budget = wait_budget(request.GET.get("timeout"))
            verdict = bind_and_wait(review, view, verdict, started, budget)
    except (DatabaseError, InterfaceError) as exc:
        # The database went away (dropped connection, restart, failover): a clear denial
        # the caller can retry, never a 500 (which failurePolicy would turn into a
        # less obvious refusal, or an admission without the node pin).
        verdict = database_unavailable(review, exc)
    return _json(response(verdict))


class VmiAdmissionSchema(APIView):
    """The endpoint as the OpenAPI schema describes it (never routed to: :func:`admit` serves it)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="webhook_vmi",
        summary="VMI admission webhook (called by the kube-apiserver)",
        description=(
            "AdmissionReview v1 for a VirtualMachineInstance CREATE. Allows a VMI naming no gpuplane.io "
            "devices untouched; otherwise pins it to the node holding its GPU set (JSONPatch) or denies "
            "with the binder's reason. Malformed reviews get 400 naming the field; bodies over "
            "GPUPLANE_WEBHOOK_MAX_BYTES get 413. Only the kube-apiserver may call it (a verified TLS "
            "client certificate or the configured bearer token); others get 401."
        ),
        auth=[],
        request={"application/json": ADMISSION_REVIEW},
        responses={
            200: OpenApiResponse(ADMISSION_REVIEW, description="the AdmissionReview with its response"),
            400: OpenApiResponse(WEBHOOK_ERROR, description="malformed review: the field and why"),
            401: OpenApiResponse(WEBHOOK_ERROR, description="the caller is not the kube-apiserver"),
            404: OpenApiResponse(WEBHOOK_ERROR, description="the webhook is off, or not served on this port"),
            413: OpenApiResponse(WEBHOOK_ERROR, description="body too large"),
        },
    )
    def post(self, request: Request) -> Response:  # pragma: no cover - documentation only
        raise NotImplementedError("served by webhooks.views.admit")


class VmiAdmissionView(View):
    """``POST /webhooks/vmi`` (any other method: 405)."""

    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> HttpResponse:
        return admit(request)

    def http_method_not_allowed(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return _json({"error": f'method "{request.method}" not allowed', "field": "(method)"}, 405, {"Allow": "POST"})

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Callable[..., HttpResponse]:
        """The view, CSRF-exempt, carrying the schema's DRF view for drf-spectacular."""
        view: Any = csrf_exempt(super().as_view(**initkwargs))
        view.cls = VmiAdmissionSchema
        view.initkwargs = {}
        return view  # type: ignore[no-any-return]


# -- the webhook server's admission step: shed in the event loop, decide in a bounded pool ---
#
# Why this exists (issue 23): served through granian's WSGI interface, a call reached Python
# only when one of the process's blocking threads took it, and granian queued every call
# beyond them (up to ``backpressure``, 1024 per process) in front of the threads. In a 3,000
# calls/s burst thousands queued there, the app's own shedding saw each call only seconds
# later, and "try again" took 4.7 s at p99 (13 s to recover). Here granian hands each call
# to this object in its event loop (the RSGI interface) the moment its header is in, and the
# loop counts the calls it has admitted: below ``limit`` (the pool's threads plus a short
# queue) the call goes to the pool, where the Django application runs it unchanged (a WSGI
# environ is built for it); at the limit a review is answered "try again" from the loop at
# once, in the AdmissionReview shape the view gives every other denial, after the same
# caller and size checks, made before the body is read. A review naming no gpuplane device
# needs no read model and is still allowed from the loop: shedding it would fail a VMI
# CREATE for nothing. Anything else (the probes, a wrong path or method) always goes to the
# pool: a liveness probe shed under load would get the pod restarted.
#
# The arrival time travels with the call (``gpuplane.arrived`` in the environ), so a call
# that waits for the binder counts its time in the queue against the apiserver's deadline.

WEBHOOK_PATH = "/webhooks/vmi"
JSON_HEADERS = [("content-type", JSON_MEDIA_TYPE)]

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
Answer = tuple[int, list[tuple[str, str]], bytes]


class Headers(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...
    def items(self) -> list[tuple[str, str]]: ...


class Scope(Protocol):
    """What this module reads of granian's RSGI scope."""

    proto: str
    http_version: str
    server: str
    client: str
    scheme: str
    method: str
    path: str
    query_string: str

    @property
    def headers(self) -> Headers: ...


class HttpProtocol(Protocol):
    """What this module uses of granian's RSGI HTTP protocol object."""

    async def __call__(self) -> bytes: ...
    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None: ...


def environ_of(scope: Scope, body: bytes, arrived: float) -> dict[str, Any]:
    """The WSGI environ of one call, as granian's WSGI interface builds it."""
    server, _, port = scope.server.rpartition(":")
    client = scope.client.rpartition(":")[0]
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope.method,
        "SCRIPT_NAME": "",
        "PATH_INFO": scope.path,
        "QUERY_STRING": scope.query_string,
        "SERVER_NAME": server,
        "SERVER_PORT": port,
        "SERVER_PROTOCOL": f"HTTP/{scope.http_version}",
        "REMOTE_ADDR": client,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.scheme,
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        ARRIVED: arrived,
    }
    for name, value in scope.headers.items():
        key = name.upper().replace("-", "_")
        if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            key = f"HTTP_{key}"
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def run_wsgi(app: WsgiApp, environ: dict[str, Any]) -> Answer:
    """Run the WSGI application on one call (in a pool thread); its status, headers and body."""
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        started[:] = [status, headers]
        return written.append

    written: list[bytes] = []
    result = app(environ, start_response)
    try:
        written.extend(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    status, headers = started
    return int(status.split(" ", 1)[0]), list(headers), b"".join(written)


def _refused_answer(refused: Refused) -> Answer:
    headers = JSON_HEADERS + list((refused.headers or {}).items())
    return refused.status, headers, orjson.dumps(refused.body)


class Front:
    """The RSGI application granian serves the webhook with (``gpuplane.wsgi.webhook``).

    ``threads`` run the WSGI application; at most ``threads + queue`` calls are admitted at
    once, the rest of the reviews are answered from the loop.
    """

    def __init__(self, app: WsgiApp, threads: int, queue: int) -> None:
        self.app = app
        self.threads = threads
        self.limit = threads + queue
        self.admitted = 0
        self.shed = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="webhook")
        return self._pool

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pool()

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def __rsgi__(self, scope: Scope, protocol: HttpProtocol) -> None:
        arrived = time.monotonic()
        if scope.path == WEBHOOK_PATH and scope.method == "POST":
            answer = await self.review(scope, protocol, arrived)
        else:
            answer = await self.run(scope, await protocol(), arrived)
        protocol.response_bytes(*answer)

    async def review(self, scope: Scope, protocol: HttpProtocol, arrived: float) -> Answer:
        """A review: the view's checks before its body is read; then the pool, or at the limit
        "try again" from here (naming no gpuplane device, the decision, which needs nothing
        but the review)."""
        headers = scope.headers
        refused = gate(headers.get("authorization") or "", headers.get("content-length") or "")
        if refused is not None:
            return _refused_answer(refused)
        body = await protocol()
        if self.admitted < self.limit:
            return await self.run(scope, body, arrived)
        review = review_of(body, headers.get("content-type") or "")
        if isinstance(review, Refused):
            return _refused_answer(review)
        if review.needs_mirror:
            self.shed += 1
            verdict = overloaded(review, self.admitted)
        else:
            verdict = decide(review, MirrorView(namespace=review.namespace))
        return 200, JSON_HEADERS, orjson.dumps(response(verdict))

    async def run(self, scope: Scope, body: bytes, arrived: float) -> Answer:
        """Run the call in the pool; the admitted count covers it until it is answered."""
        self.admitted += 1
        try:
            environ = environ_of(scope, body, arrived)
            return await asyncio.get_running_loop().run_in_executor(self.pool(), run_wsgi, self.app, environ)
        finally:
            self.admitted -= 1

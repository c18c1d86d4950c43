"""The webhook server's admission step: shed in the event loop, decide in a bounded pool.

:class:`Front` is the RSGI application granian serves when ``GPUPLANE_WEBHOOK_SHED`` is
true: ``deploy/webhook_server.py`` builds it around the WSGI application
(``gpuplane.wsgi.application``) as ``deploy.webhook_server:webhook``, granian's target.

Why it exists: served through granian's WSGI interface, a call reached Python
only when one of the process's blocking threads took it, and granian queued every call
beyond them (up to ``backpressure``, 1024 per process) in front of the threads. In a 3,000
calls/s burst thousands queued there, the app's own shedding saw each call only seconds
later, and "try again" took 4.7 s at p99 (13 s to recover). Here granian hands each call
to this object in its event loop (the RSGI interface) the moment its header is in, and the
loop counts the calls it has admitted: below ``limit`` (the pool's threads plus a short
queue) the call goes to the pool, where the Django application runs it unchanged (a WSGI
environ is built for it); at the limit a review is answered "try again" from the loop at
once, in the AdmissionReview shape the view gives every other denial, after the same
caller and size checks, made before the body is read. A review naming no gpuplane device
needs no read model and is still allowed from the loop: shedding it would fail a VMI
CREATE for nothing. Anything else (the probes, a wrong path or method) always goes to the
pool: a liveness probe shed under load would get the pod restarted.

The arrival time travels with the call (``gpuplane.arrived`` in the environ), so a call
that waits for the binder counts its time in the queue against the apiserver's deadline.
"""

from __future__ import annotations

import asyncio
import io
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import orjson

from webhooks import metrics
from webhooks.admission import MirrorView, decide, overloaded, response
from webhooks.views import ARRIVED, JSON_MEDIA_TYPE, Refused, gate, review_of

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
    """The RSGI application granian serves the webhook with (``deploy.webhook_server:webhook``,
    around ``gpuplane.wsgi.application``).

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
            metrics.observe(metrics.outcome_of_status(refused.status), arrived)
            return _refused_answer(refused)
        body = await protocol()
        if self.admitted < self.limit:
            return await self.run(scope, body, arrived)
        review = review_of(body, headers.get("content-type") or "")
        if isinstance(review, Refused):
            metrics.observe(metrics.outcome_of_status(review.status), arrived)
            return _refused_answer(review)
        if review.needs_mirror:
            self.shed += 1
            verdict = overloaded(review, self.admitted)
            metrics.observe("shed", arrived)
        else:
            verdict = decide(review, MirrorView(namespace=review.namespace))
            metrics.observe("allowed", arrived)
        return 200, JSON_HEADERS, orjson.dumps(response(verdict))

    async def run(self, scope: Scope, body: bytes, arrived: float) -> Answer:
        """Run the call in the pool; the admitted count covers it until it is answered."""
        self.admitted += 1
        try:
            environ = environ_of(scope, body, arrived)
            return await asyncio.get_running_loop().run_in_executor(self.pool(), run_wsgi, self.app, environ)
        finally:
            self.admitted -= 1

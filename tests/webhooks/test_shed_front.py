"""The webhook server's admission step (``webhooks.front.Front``), in process.

The front admits at most ``threads + queue`` calls per process into its pool; past that a
review is answered from the event loop: "try again" in the AdmissionReview shape of every
other denial, after the caller and size checks (made before the body is read); a review
naming no gpuplane device is still allowed; the probes are never shed. Below the limit the
call reaches the WSGI application with the environ granian's WSGI interface gave it, and
the arrival time. The real server, over a socket, is in ``tests/webhooks/test_shed_serving.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from harness.factories import new_vmi, review
from webhooks.front import Front
from webhooks.views import ARRIVED

TOKEN = "apiserver-token-for-tests-" + "y" * 16


class Headers:
    def __init__(self, pairs: dict[str, str]) -> None:
        self.pairs = {k.lower(): v for k, v in pairs.items()}

    def get(self, key: str, default: Any = None) -> Any:
        return self.pairs.get(key, default)

    def items(self) -> list[tuple[str, str]]:
        return list(self.pairs.items())


class Scope:
    proto = "http"
    http_version = "1.1"
    server = "127.0.0.1:8001"
    client = "127.0.0.1:50000"
    scheme = "http"

    def __init__(self, method: str, path: str, headers: dict[str, str], query_string: str = "") -> None:
        self.method, self.path, self.query_string = method, path, query_string
        self.headers = Headers(headers)


class Protocol:
    """One call's body and, once given, its answer; ``read`` says whether the body was asked for."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.read = False
        self.answer: tuple[int, dict[str, str], bytes] | None = None

    async def __call__(self) -> bytes:
        self.read = True
        return self.body

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.answer = (status, dict(headers), body)


class Held:
    """A WSGI application whose calls wait until released: it fills the pool on demand."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.environs: list[dict[str, Any]] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        self.environs.append({**environ, "body": environ["wsgi.input"].read()})
        self.entered.release()
        self.release.wait(10)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"from": ', b'"the app"}']


def _call(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[Scope, Protocol]:
    raw = b"" if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", "Content-Length": str(len(raw)), **(headers or {})}
    return Scope(method, path, sent, "timeout=10s"), Protocol(raw)


async def _at_the_limit(front: Front, app: Held, calls: list[tuple[Scope, Protocol]]) -> None:
    """``calls`` made while the front's only admitted call is held in the application."""
    loop = asyncio.get_running_loop()
    scope, protocol = _call("POST", "/webhooks/vmi", review(new_vmi("t1", "holder", ["gpu0"])), AUTH)
    holder = asyncio.ensure_future(front.__rsgi__(scope, protocol))
    await loop.run_in_executor(None, app.entered.acquire)
    assert front.admitted == front.limit
    try:
        for scope, protocol in calls:
            await asyncio.wait_for(front.__rsgi__(scope, protocol), 5)
    finally:
        app.release.set()
        await holder
    assert protocol.answer is not None and front.admitted == 0


def _run(front: Front, app: Held, calls: list[tuple[Scope, Protocol]]) -> None:
    try:
        asyncio.run(_at_the_limit(front, app, calls))
    finally:
        front.__rsgi_del__(asyncio.new_event_loop())


@pytest.fixture
def open_webhook(settings: Any) -> None:
    settings.GPUPLANE_WEBHOOK_ENABLED = True
    settings.GPUPLANE_WEBHOOK_AUTH = "token"
    settings.GPUPLANE_WEBHOOK_TOKEN = TOKEN


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_at_the_limit_a_review_is_told_to_try_again_at_once_in_the_admission_review_shape(open_webhook: None) -> None:
    app = Held()
    front = Front(app, threads=1, queue=0)
    sent = review(new_vmi("t1", "vm2", ["gpu1", "gpu2"]), uid="uid-shed")
    shed = _call("POST", "/webhooks/vmi", sent, AUTH)
    _run(front, app, [shed])
    assert shed[1].answer is not None
    status, headers, body = shed[1].answer
    answer = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "uid-shed" and answer["response"]["allowed"] is False
    assert answer["response"]["status"]["code"] == 403
    message = answer["response"]["status"]["message"]
    assert message.startswith("VMI t1/vm2: the webhook is busy with 1 calls") and message.endswith("try again")
    assert len(app.environs) == 1 and front.shed == 1  # the application saw only the held call


def test_at_the_limit_a_review_naming_no_gpuplane_device_is_still_allowed(open_webhook: None) -> None:
    app = Held()
    front = Front(app, threads=1, queue=0)
    plain = _call("POST", "/webhooks/vmi", review(new_vmi("t1", "plain", []), uid="uid-plain"), AUTH)
    _run(front, app, [plain])
    assert plain[1].answer is not None
    answer = json.loads(plain[1].answer[2])["response"]
    assert answer == {"uid": "uid-plain", "allowed": True}
    assert front.shed == 0 and len(app.environs) == 1


def test_at_the_limit_a_caller_without_the_token_is_refused_before_its_body_is_read(open_webhook: None) -> None:
    app = Held()
    front = Front(app, threads=1, queue=0)
    stranger = _call("POST", "/webhooks/vmi", review(new_vmi("t1", "vm2", ["gpu1"])))
    oversized = _call("POST", "/webhooks/vmi", review(new_vmi("t1", "vm3", ["gpu1"])), AUTH)
    oversized[0].headers.pairs["content-length"] = str(10**9)
    malformed = _call("POST", "/webhooks/vmi", {"apiVersion": "admission.k8s.io/v1"}, AUTH)
    _run(front, app, [stranger, oversized, malformed])
    assert stranger[1].answer is not None and oversized[1].answer is not None and malformed[1].answer is not None
    assert stranger[1].answer[0] == 401 and not stranger[1].read
    assert stranger[1].answer[1]["WWW-Authenticate"] == 'Bearer realm="gpuplane-webhook"'
    assert json.loads(stranger[1].answer[2]) == {"error": "authentication required", "field": "(caller)"}
    assert oversized[1].answer[0] == 413 and not oversized[1].read
    assert malformed[1].answer[0] == 400 and json.loads(malformed[1].answer[2])["field"] == "kind"
    assert front.shed == 0


def test_the_probes_are_never_shed() -> None:
    app = Held()
    front = Front(app, threads=1, queue=0)
    probe = _call("GET", "/healthz")

    async def probe_while_full() -> None:
        loop = asyncio.get_running_loop()
        holder = asyncio.ensure_future(front.__rsgi__(*_call("GET", "/readyz")))
        await loop.run_in_executor(None, app.entered.acquire)
        queued = asyncio.ensure_future(front.__rsgi__(*probe))
        await asyncio.sleep(0.05)
        assert probe[1].answer is None and front.admitted == 2  # queued for the thread, not answered from the loop
        app.release.set()
        await asyncio.gather(holder, queued)

    try:
        asyncio.run(probe_while_full())
    finally:
        front.__rsgi_del__(asyncio.new_event_loop())
    assert probe[1].answer == (200, {"Content-Type": "application/json"}, b'{"from": "the app"}')
    assert [e["PATH_INFO"] for e in app.environs] == ["/readyz", "/healthz"]


def test_below_the_limit_the_application_gets_the_call_as_wsgi_with_its_arrival(open_webhook: None) -> None:
    app = Held()
    app.release.set()
    front = Front(app, threads=2, queue=3)
    assert front.limit == 5
    sent = review(new_vmi("t1", "vm2", ["gpu1"]))
    scope, protocol = _call("POST", "/webhooks/vmi", sent, AUTH | {"X-Extra": "a"})
    try:
        asyncio.run(front.__rsgi__(scope, protocol))
    finally:
        front.__rsgi_del__(asyncio.new_event_loop())
    assert protocol.answer == (200, {"Content-Type": "application/json"}, b'{"from": "the app"}')
    (environ,) = app.environs
    assert environ["REQUEST_METHOD"] == "POST" and environ["PATH_INFO"] == "/webhooks/vmi"
    assert environ["QUERY_STRING"] == "timeout=10s" and environ["SERVER_PORT"] == "8001"
    assert environ["CONTENT_TYPE"] == "application/json" and environ["CONTENT_LENGTH"] == str(len(protocol.body))
    assert environ["HTTP_AUTHORIZATION"] == f"Bearer {TOKEN}" and environ["HTTP_X_EXTRA"] == "a"
    assert environ["body"] == protocol.body and environ["REMOTE_ADDR"] == "127.0.0.1"
    assert isinstance(environ[ARRIVED], float)
    assert front.admitted == 0 and front.shed == 0


@pytest.mark.django_db(transaction=True)  # the answer pass runs at commit
def test_a_call_that_spent_its_time_queued_for_a_thread_writes_nothing(client: Any, settings: Any) -> None:
    from binder import models
    from binder.mirror.snapshot import load_objects
    from harness.shapes import H100, class_obj, gpu_obj, node_obj

    settings.GPUPLANE_WEBHOOK_ENABLED, settings.GPUPLANE_WEBHOOK_AUTH = True, "none"
    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 8}), gpu_obj("train", "gpu0", "h100", "vm1")])
    body = json.dumps(review(new_vmi("train", "vm1", ["gpu0"])))
    # Arrived in the server's event loop 9 s ago: of the apiserver's 10 s, less than the
    # 1.5 s margin is left, so it must not write a bind request it cannot wait for.
    aged = {ARRIVED: time.monotonic() - 9}
    resp = client.post("/webhooks/vmi?timeout=10s", data=body, content_type="application/json", **aged)
    answer = resp.json()["response"]
    assert answer["allowed"] is False and "no time is left in this call" in answer["status"]["message"]
    assert set(models.GpuDevice.objects.values_list("bind_request", flat=True)) == {""}
    # Arrived just now, the same call binds.
    resp = client.post(
        "/webhooks/vmi?timeout=10s", data=body, content_type="application/json", **{ARRIVED: time.monotonic()}
    )
    assert resp.json()["response"]["allowed"] is True, resp.json()["response"]

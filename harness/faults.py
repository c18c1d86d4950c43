"""Faults on a real control plane, each standing for something a production cluster does.

- :class:`FaultWebhook`: a validating admission webhook served by the test process and
  registered with the real kube-apiserver (``failurePolicy: Fail``) for gpuplane's writes
  (every request not made by the test's admin). A test sets ``decide(verb, kind, namespace,
  target)`` to refuse chosen writes with the status code it returns: the apiserver answers
  that code with the webhook's message, exactly as it does for any admission refusal. It
  stands for conflicts with other writers (409), a flaky apiserver or etcd (500, 503), a
  policy engine (OPA, Kyverno) or a missing RBAC grant (403) refusing a write.
- :class:`WatchProxy`: an HTTP proxy in front of the apiserver that forwards every request
  and, on watch streams, may hold an event back (delivered at :meth:`WatchProxy.release_held`,
  after the events sent since, with its own resourceVersion) or drop it. Reads (GET, LIST)
  pass straight through and already return the write. It stands for the watch cache trailing
  etcd (a write's response, and a consistent LIST, arrive before its event, by seconds under
  load) and, for a dropped event, one the client never applies (its watch broke after the
  event was sent; only a relist repairs that). :meth:`WatchProxy.cut_watches` ends every open
  watch stream at once, as a load balancer's idle timeout or a network partition does.
- ``ControlPlane.compact`` (etcd compaction: 410 Gone) and ``ControlPlane.restart_apiserver``
  (an outage: every connection breaks) are on the control plane itself.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import queue
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.controlplane import ADMIN_USER, ControlPlane


@dataclass(frozen=True)
class Kind:
    """What a fault decider is told about the kind written."""

    plural: str
    group: str


Decider = Callable[[str, Kind, str, str], int | None]

REASONS = {
    403: "Forbidden",
    409: "Conflict",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


class FaultWebhook:
    """The admission webhook the faults go through (see the module docstring)."""

    NAME = "faults.gpuplane-tests.io"

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.decide: Decider | None = None
        #: Every write the webhook saw while ``decide`` was set: (verb, plural, ns, target, code or 200).
        self.writes: list[tuple[str, str, str, str, int]] = []
        self._lock = threading.Lock()
        handler = self._handler()
        self.server = _Server(("127.0.0.1", 0), handler)
        crt, key = plane.pki.serving("webhook")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(crt), str(key))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-webhook", daemon=True)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        webhook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                review = json.loads(self.rfile.read(length))
                response = webhook.answer(review["request"])
                body = json.dumps(
                    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
                )
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        resource = request.get("resource", {})
        kind = Kind(resource.get("resource", ""), resource.get("group", ""))
        # Admission sees a PATCH as an UPDATE (with UpdateOptions); gpuplane never PUTs
        # (tests/project/test_deploy.py checks the client makes only GETs and PATCHes), so an UPDATE
        # is told to the decider by the RBAC verb it needed: patch.
        verb = {"CREATE": "create", "DELETE": "delete"}.get(request.get("operation", ""), "patch")
        name = request.get("name", "") or (request.get("object") or {}).get("metadata", {}).get("name", "")
        target = name + (f"/{request['subResource']}" if request.get("subResource") else "")
        namespace = request.get("namespace", "") or ""
        decide = self.decide
        code = decide(verb, kind, namespace, target) if decide is not None else None
        if decide is not None:
            with self._lock:
                self.writes.append((verb, kind.plural, namespace, target, code or 200))
        allowed = {"uid": request["uid"], "allowed": True}
        if code is None:
            return allowed
        message = f"injected fault on {verb} {kind.plural} {namespace}/{target}"
        return {
            "uid": request["uid"],
            "allowed": False,
            "status": {"code": code, "reason": REASONS.get(code, "Failure"), "message": message},
        }

    def start(self) -> FaultWebhook:
        self.thread.start()
        ca = self.plane.pki.ca_file.read_bytes()

        rules = [
            {
                "apiGroups": ["gpuplane.io"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE", "DELETE"],
                "resources": [f"{r}{sub}" for r in ("gpus", "gpuclasses", "gpubudgets") for sub in ("", "/status")],
            },
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]},
        ]  # fmt: skip
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "gpuplane-test-faults"},
            "webhooks": [
                {
                    "name": self.NAME,
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{self.port}/faults",
                        "caBundle": base64.b64encode(ca).decode(),
                    },
                    "rules": rules,
                    # The test's own set-up and the controllers never meet a fault.
                    "matchConditions": [
                        {
                            "name": "not-the-tests-admin",
                            "expression": f"request.userInfo.username != '{ADMIN_USER}' && "
                            "request.userInfo.username != 'kube-controller-manager'",
                        }
                    ],
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 10,
                }
            ],
        }
        self.plane.apply(config)
        self._wait_registered()
        return self

    def _wait_registered(self) -> None:
        """The apiserver picks a new webhook configuration up within a second or so: probe
        with a dry-run write as a gpuplane identity until the webhook refuses it."""
        probe = {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GPUClass", "metadata": {"name": "fault-probe"},
                 "spec": {"resourceName": "example.com/probe"}}  # fmt: skip
        self.decide = lambda verb, kind, ns, target: 503 if target == "fault-probe" else None
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    self.plane.request(
                        "POST", "/apis/gpuplane.io/v1alpha1/gpuclasses?dryRun=All", probe, identity="fault-probe"
                    )
                except Exception as exc:  # noqa: BLE001 - any refusal but ours means "not yet"
                    if "injected fault" in str(exc):
                        return
                time.sleep(0.1)
            raise RuntimeError("the fault webhook was never called by the apiserver")
        finally:
            self.decide = None
            self.writes.clear()

    def reset(self) -> None:
        self.decide = None
        with self._lock:
            self.writes.clear()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Event:
    """One watch event as the proxy saw it."""

    kind: Kind
    type: str
    obj: dict[str, Any]
    line: bytes = b""


@dataclass
class _Stream:
    plural: str
    inject: queue.Queue[bytes] = field(default_factory=queue.Queue)
    closed: threading.Event = field(default_factory=threading.Event)


class WatchProxy:
    """The proxy in front of the apiserver (see the module docstring); serves plain HTTP
    on loopback and forwards over TLS, passing the caller's own credentials on."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.withhold: Callable[[Event], str | None] | None = None
        self.held: list[Event] = []
        self._released: dict[str, list[bytes]] = {}
        self._streams: list[_Stream] = []
        self._lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="watch-proxy", daemon=True)

    def start(self) -> WatchProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.cut_watches()
        self.server.shutdown()
        self.server.server_close()

    def release_held(self) -> int:
        """Deliver the held events now: into each open watch of their kind, else at the
        start of the next one, after every event already sent."""
        with self._lock:
            held, self.held = self.held, []
            for event in held:
                self._released.setdefault(event.kind.plural, []).append(event.line)
            for stream in self._streams:
                for line in self._released.pop(stream.plural, []):
                    stream.inject.put(line)
        return len(held)

    def cut_watches(self) -> int:
        """End every open watch stream now (the client sees its connection close)."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.closed.set()
        return len(streams)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPSConnection(
                    "127.0.0.1", proxy.plane.port, context=proxy.plane.ssl_context(), timeout=330
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                watching = query.get("watch", [""])[0].lower() in ("true", "1") and answer.status == 200
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                if not watching:
                    data = answer.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    upstream.close()
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    proxy._stream(self, upstream, answer, self.path)
                finally:
                    upstream.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        return Handler

    def _verdict(self, kind: Kind, line: bytes) -> str | None:
        """What ``withhold`` says of one watch event line ("hold" keeps it for later)."""
        withhold = self.withhold
        if withhold is None:
            return None
        try:
            raw = json.loads(line)
        except ValueError:
            return None
        event = Event(kind, raw.get("type", ""), raw.get("object") or {}, line)
        if event.type not in ("ADDED", "MODIFIED", "DELETED"):
            return None
        verdict = withhold(event)
        if verdict == "hold":
            with self._lock:
                self.held.append(event)
        return verdict

    def _stream(self, handler: Any, upstream: Any, answer: Any, path: str) -> None:
        plural = urllib.parse.urlsplit(path).path.rstrip("/").rsplit("/", 1)[-1]
        group = path.split("/")[2] if path.startswith("/apis/") else ""
        stream = _Stream(plural)
        lines: queue.Queue[bytes | None] = queue.Queue()

        def read() -> None:
            with contextlib.suppress(Exception):
                while True:
                    line = answer.readline()
                    if not line:
                        break
                    lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        with self._lock:
            self._streams.append(stream)
            for line in self._released.pop(plural, []):
                stream.inject.put(line)

        def send(line: bytes) -> None:
            handler.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            handler.wfile.flush()

        try:
            while not stream.closed.is_set():
                with contextlib.suppress(queue.Empty):
                    while True:
                        send(stream.inject.get_nowait())
                try:
                    got = lines.get(timeout=0.05)
                except queue.Empty:
                    continue
                if got is None:
                    break
                line = got
                if self._verdict(Kind(plural, group), line) is None:
                    send(line)
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        finally:
            with self._lock:
                self._streams.remove(stream)
            with contextlib.suppress(Exception):
                upstream.sock.shutdown(2)

"""The VMI webhook server: its own process and port, built so slow clients cannot exhaust it.

Run it with ``python deploy/webhook_server.py`` (the web Deployment's webhook container,
``make serve-webhook``). It serves ``gpuplane.wsgi`` with ``GPUPLANE_SERVE=webhook``, so
only ``/webhooks/vmi`` and ``/healthz`` exist on this port (``gpuplane.webhook_urls``).

Why granian and not the API's gunicorn: the webhook has ``failurePolicy: Fail``, so while
it does not answer no VMI in the cluster can be created. gunicorn's threaded workers give
each connection a thread from the moment it is accepted: 20 sockets that trickle one header
line every 2 s held all 2 × 8 threads, and ``/healthz`` timed out (``bench/slow_clients.py``;
docs/webhook.md has the figures). granian reads requests in its Rust
event loop and hands Python only complete ones, with a deadline for the whole header
(``GPUPLANE_WEBHOOK_HEADER_TIMEOUT_MS``, default 5 s, after which it closes the socket) and
a bound on connections in progress per worker (``GPUPLANE_WEBHOOK_BACKPRESSURE``); 200 such
sockets left ordinary calls at a p99 of milliseconds.

Everything comes from the environment:

``GPUPLANE_TLS_CERT_FILE`` / ``GPUPLANE_TLS_KEY_FILE``
    The serving certificate and key (PKCS#8, as ``manage.py webhook_cert`` writes it).
    Required in cluster mode: the kube-apiserver calls webhooks over HTTPS only.
``GPUPLANE_WEBHOOK_AUTH=client-cert`` with ``GPUPLANE_WEBHOOK_CLIENT_CA``
    Verify the caller's TLS client certificate against that CA during the handshake (the
    kube-apiserver's, from its AdmissionConfiguration kubeconfig); nobody else connects.
``GPUPLANE_WEBHOOK_BIND``
    Address, default ``0.0.0.0:8443`` with TLS, ``127.0.0.1:8001`` without.
``GPUPLANE_WEBHOOK_WORKERS`` / ``GPUPLANE_WEBHOOK_THREADS``
    Processes (default 2) and the threads per process that run the Django application
    (default 16).
``GPUPLANE_WEBHOOK_SHED`` / ``GPUPLANE_WEBHOOK_QUEUE``
    ``true``: serve through granian's RSGI interface and ``webhooks.front.Front``, which
    admits at most threads + queue calls per process (queue default 16, may be 0) and answers
    a review beyond them "try again" at once from the event loop instead of queueing it behind
    the rest. Default ``false``: granian's WSGI interface, as before (on the 2-core bench
    machine the front cost Bound calls throughput and CPU; docs/webhook.md).
``GPUPLANE_WEBHOOK_HEADER_TIMEOUT_MS`` / ``GPUPLANE_WEBHOOK_BACKPRESSURE``
    The header deadline (default 5000) and the connections a process serves at once (default
    1024; granian counts a connection still sending its header), past which new ones wait.
``GPUPLANE_WEBHOOK_ACCESS_LOG``
    ``true`` logs one line per request (granian's access log); default ``false``: every
    VMI CREATE in the cluster passes here, and the line was a large share of a call's CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # the repository root: gpuplane.wsgi and deploy.serving

from deploy.serving import TLS_PORT, ServingError, boolean, existing_file, positive_int, tls_files  # noqa: E402

PLAIN_PORT = 8001


def options() -> dict[str, object]:
    """Granian's keyword arguments from the environment (raises ServingError naming the variable)."""
    from granian.constants import HTTPModes, Interfaces, SSLProtocols
    from granian.http import HTTP1Settings

    tls_pair = tls_files()
    cert, key = tls_pair if tls_pair is not None else (None, None)
    auth = os.environ.get("GPUPLANE_WEBHOOK_AUTH", "")
    client_ca = existing_file("GPUPLANE_WEBHOOK_CLIENT_CA")
    if auth == "client-cert" and (client_ca is None or cert is None):
        raise ServingError(
            "GPUPLANE_WEBHOOK_AUTH=client-cert needs TLS and GPUPLANE_WEBHOOK_CLIENT_CA (the apiserver's CA)"
        )
    bind = os.environ.get("GPUPLANE_WEBHOOK_BIND") or (f"0.0.0.0:{TLS_PORT}" if cert else f"127.0.0.1:{PLAIN_PORT}")
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise ServingError(f"GPUPLANE_WEBHOOK_BIND={bind!r} is not host:port")
    tls: dict[str, object] = {}
    if cert is not None:
        tls = {"ssl_cert": cert, "ssl_key": key, "ssl_protocol_min": SSLProtocols.tls12}
        if auth == "client-cert":
            tls |= {"ssl_ca": client_ca, "ssl_client_verify": True}
    threads, _ = pool_sizes()
    if shedding():
        # granian's RSGI interface: each call reaches webhooks.front.Front in the event loop
        # as soon as its header is in, so a call past the limit is shed at once rather than
        # queued by granian in front of blocking threads.
        served: dict[str, object] = {
            "target": "deploy.webhook_server:webhook",
            "interface": Interfaces.RSGI,
            "websockets": False,
        }
    else:
        served = {"target": "gpuplane.wsgi:application", "interface": Interfaces.WSGI, "blocking_threads": threads}
    return {
        **served,
        "address": host,
        "port": int(port),
        "http": HTTPModes.http1,
        "workers": positive_int("GPUPLANE_WEBHOOK_WORKERS", 2),
        "backpressure": positive_int("GPUPLANE_WEBHOOK_BACKPRESSURE", 1024),
        "backlog": 2048,
        "http1_settings": HTTP1Settings(
            header_read_timeout=positive_int("GPUPLANE_WEBHOOK_HEADER_TIMEOUT_MS", 5000), keep_alive=True
        ),
        # One log line per call costs CPU on the path of every VMI CREATE: off unless asked for.
        "log_access": boolean("GPUPLANE_WEBHOOK_ACCESS_LOG", False),
        **tls,
    }


def shedding() -> bool:
    """Whether calls past the limit are shed from the event loop (``GPUPLANE_WEBHOOK_SHED``)."""
    return boolean("GPUPLANE_WEBHOOK_SHED", False)


def pool_sizes() -> tuple[int, int]:
    """The threads that run the application in each process, and the calls queued for them."""
    return positive_int("GPUPLANE_WEBHOOK_THREADS", 16), positive_int("GPUPLANE_WEBHOOK_QUEUE", 16, minimum=0)


_FRONT: list[Any] = []


def __getattr__(name: str) -> Any:
    """``webhook``, the application each granian worker serves, built on first use in the
    worker (importing this module in the server's own process builds no Django)."""
    if name != "webhook":
        raise AttributeError(name)
    if not _FRONT:
        from gpuplane.wsgi import application
        from webhooks.front import Front

        _FRONT.append(Front(application, *pool_sizes()))
    return _FRONT[0]


def main() -> None:
    os.environ["GPUPLANE_SERVE"] = "webhook"  # read by gpuplane.settings in every worker
    from granian import Granian

    try:
        served = options()
    except ServingError as exc:
        raise SystemExit(f"gpuplane: cannot start: {exc}") from None
    Granian(**served).serve()  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

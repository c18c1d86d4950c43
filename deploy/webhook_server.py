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
``GPUPLANE_WEBHOOK_CERT_CHECK_SECONDS``
    How often the server looks at the certificate files for a renewal (default 10). It serves
    copies it keeps under ``GPUPLANE_VAR_DIR`` (granian resolves a path once, and a mounted
    Secret's files are symlinks the kubelet swaps on renewal); when a file changes and the new
    pair loads, it writes new copies and sends itself SIGHUP: granian starts new workers with
    them one by one and stops the old ones gracefully, so a renewed certificate is served
    without a restart and without a refused call.
``GPUPLANE_WEBHOOK_METRICS_BIND``
    ``host:port`` of the server's own ``/metrics`` (plain HTTP; unset: none): the calls of every
    worker by outcome and their latency (``webhooks/metrics.py``, prometheus_client's
    multiprocess mode in a directory under ``GPUPLANE_VAR_DIR``) and
    ``gpuplane_webhook_certificate_expiry_seconds``. Closed as the API's ``/metrics`` is:
    ``GPUPLANE_METRICS_TOKEN`` (or ``_FILE``) as a bearer token, else open only with
    ``GPUPLANE_METRICS_OPEN=true`` or outside cluster mode.
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # the repository root: deploy.serving and gpuplane

from deploy.serving import TLS_PORT, cluster_mode, existing_file, tls_files  # noqa: E402
from gpuplane.settings_parsers import SettingError, boolean, positive_int  # noqa: E402

PLAIN_PORT = 8001
log = logging.getLogger("gpuplane.webhook_server")


# -- the certificate: served from copies, reloaded when the files change --------------------------


class ServedCertificate:
    """The serving pair (and the client CA) as the server serves them: copies under ``directory``
    of the files the environment names, renewed when those change."""

    def __init__(self, sources: dict[str, Path], directory: Path) -> None:
        self.sources = sources  # "cert", "key", optionally "client_ca" -> the configured file
        self.directory = directory
        self.copies = {name: directory / source.name for name, source in sources.items()}
        self.reloads = 0

    def install(self) -> None:
        """The first copies (the server refuses to start on a pair that does not load)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        contents = self._read()
        _check_pair(contents)
        self._write(contents)

    def _read(self) -> dict[str, bytes]:
        return {name: source.read_bytes() for name, source in self.sources.items()}

    def _write(self, contents: dict[str, bytes]) -> None:
        for name, data in contents.items():
            spare = self.copies[name].with_suffix(".new")
            spare.write_bytes(data)
            spare.chmod(0o600)
            spare.replace(self.copies[name])  # atomic: a worker starting now reads one pair or the other

    def changed(self) -> bool:
        """Whether a source differs from its copy and the new pair loads; then the copies are
        replaced and True returned (a half-written or mismatched pair is left for the next look)."""
        try:
            contents = self._read()
        except OSError as exc:
            log.warning("webhook certificate: cannot read the mounted files (%s); serving the last good pair", exc)
            return False
        if all(self.copies[name].read_bytes() == data for name, data in contents.items()):
            return False
        try:
            _check_pair(contents)
        except (ssl.SSLError, ValueError) as exc:
            log.warning("webhook certificate: the changed files do not load yet (%s); serving the last good pair", exc)
            return False
        self._write(contents)
        self.reloads += 1
        return True

    def not_after(self) -> float | None:
        """The served certificate's end, as a Unix time."""
        from cryptography import x509

        try:
            return x509.load_pem_x509_certificate(self.copies["cert"].read_bytes()).not_valid_after_utc.timestamp()
        except (OSError, ValueError):
            return None


def _check_pair(contents: dict[str, bytes]) -> None:
    """Raise unless the certificate and the key load together (ssl's own check)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        cert, key = Path(scratch) / "c", Path(scratch) / "k"
        cert.write_bytes(contents["cert"])
        key.write_bytes(contents["key"])
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)


def watch_certificate(served: ServedCertificate, every: float, reload: Callable[[], None]) -> threading.Thread:
    """A daemon thread that calls ``reload`` after each change of the certificate files."""

    def loop() -> None:
        while True:
            time.sleep(every)
            if served.changed():
                log.warning("webhook certificate: the files changed; reloading the workers with the new pair")
                reload()

    thread = threading.Thread(target=loop, name="certificate-watch", daemon=True)
    thread.start()
    return thread


# -- /metrics of the server itself ----------------------------------------------------------------


class CertificateCollector:
    """``gpuplane_webhook_certificate_expiry_seconds`` and the reloads, read at scrape time."""

    def __init__(self, served: ServedCertificate | None) -> None:
        self.served = served

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.served is None:
            return
        end = self.served.not_after()
        if end is not None:
            yield GaugeMetricFamily(
                "gpuplane_webhook_certificate_expiry_seconds",
                "When the webhook's serving certificate (the one served now) expires, as a Unix time.",
                value=end,
            )
        yield CounterMetricFamily(
            "gpuplane_webhook_certificate_reloads",
            "Times the server reloaded a renewed serving certificate without a restart.",
            value=self.served.reloads,
        )


def metrics_app(served: ServedCertificate | None) -> Callable[..., Iterable[bytes]]:
    """The WSGI application of the metrics port: every worker's counts, the certificate's expiry."""
    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Made here too (prometheus_client only, no Django): every outcome's series exists at 0
        # from the start, before a worker has answered anything.
        import webhooks.metrics  # noqa: F401

        MultiProcessCollector(registry)
    registry.register(CertificateCollector(served))  # type: ignore[arg-type]
    inner = make_wsgi_app(registry)
    token = _metrics_token()
    open_without = boolean("GPUPLANE_METRICS_OPEN", not cluster_mode())

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics here\n"]
        scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        authorized = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
        if (token and not authorized) or (not token and not open_without):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="gpuplane metrics"')],
            )
            return [
                b"a bearer token is required\n" if token else b"/metrics needs GPUPLANE_METRICS_TOKEN in cluster mode\n"
            ]
        return inner(environ, start_response)  # type: ignore[no-any-return]

    return app


def _metrics_token() -> str:
    raw = os.environ.get("GPUPLANE_METRICS_TOKEN", "")
    path = os.environ.get("GPUPLANE_METRICS_TOKEN_FILE", "")
    if path:
        try:
            raw = Path(path).read_text()
        except OSError as exc:
            raise SettingError(f"GPUPLANE_METRICS_TOKEN_FILE={path!r} cannot be read: {exc.strerror}") from None
    return raw.strip()


def serve_metrics(bind: str, app: Callable[..., Iterable[bytes]]) -> tuple[Any, threading.Thread]:
    """The metrics port, in a daemon thread of the server's main process."""
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Threading(WSGIServer):
        daemon_threads = True

    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise SettingError(f"GPUPLANE_WEBHOOK_METRICS_BIND={bind!r} is not host:port")
    try:
        server = make_server(host, int(port), app, server_class=Threading, handler_class=Quiet)
    except OSError as exc:
        raise SettingError(f"GPUPLANE_WEBHOOK_METRICS_BIND={bind!r}: {exc.strerror}") from None
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread


def metrics_directory(var: Path) -> Path:
    """A fresh directory for the workers' metric files (prometheus_client's multiprocess mode)."""
    directory = var / "webhook-metrics"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def options(served: ServedCertificate | None = None) -> dict[str, object]:
    """Granian's keyword arguments from the environment (raises SettingError naming the variable);
    with ``served``, the TLS files are its copies."""
    from granian.constants import HTTPModes, Interfaces, SSLProtocols
    from granian.http import HTTP1Settings

    tls_pair = tls_files()
    cert, key = tls_pair if tls_pair is not None else (None, None)
    auth = os.environ.get("GPUPLANE_WEBHOOK_AUTH", "")
    client_ca = existing_file("GPUPLANE_WEBHOOK_CLIENT_CA")
    if served is not None and cert is not None:
        cert, key = served.copies["cert"], served.copies["key"]
        client_ca = served.copies.get("client_ca", client_ca)
    if auth == "client-cert" and (client_ca is None or cert is None):
        raise SettingError(
            "GPUPLANE_WEBHOOK_AUTH=client-cert needs TLS and GPUPLANE_WEBHOOK_CLIENT_CA (the apiserver's CA)"
        )
    bind = os.environ.get("GPUPLANE_WEBHOOK_BIND") or (f"0.0.0.0:{TLS_PORT}" if cert else f"127.0.0.1:{PLAIN_PORT}")
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise SettingError(f"GPUPLANE_WEBHOOK_BIND={bind!r} is not host:port")
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


def served_certificate(var: Path) -> ServedCertificate | None:
    """The certificate files to serve from copies (None without TLS)."""
    pair = tls_files()
    if pair is None:
        return None
    sources = {"cert": pair[0], "key": pair[1]}
    client_ca = existing_file("GPUPLANE_WEBHOOK_CLIENT_CA")
    if client_ca is not None and os.environ.get("GPUPLANE_WEBHOOK_AUTH", "") == "client-cert":
        sources["client_ca"] = client_ca
    return ServedCertificate(sources, var / "webhook-tls")


def main() -> None:
    os.environ["GPUPLANE_SERVE"] = "webhook"  # read by gpuplane.settings in every worker
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    var = Path(os.environ.get("GPUPLANE_VAR_DIR") or Path(_ROOT) / "var")
    metrics_bind = os.environ.get("GPUPLANE_WEBHOOK_METRICS_BIND", "")
    if metrics_bind:
        # Before anything imports prometheus_client: the workers write their counts there.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_directory(var))
    from granian import Granian

    try:
        certificate = served_certificate(var)
        if certificate is not None:
            certificate.install()
        served = options(certificate)
        every = positive_int("GPUPLANE_WEBHOOK_CERT_CHECK_SECONDS", 10)
        if metrics_bind:
            serve_metrics(metrics_bind, metrics_app(certificate))
    except (SettingError, ssl.SSLError) as exc:
        raise SystemExit(f"gpuplane: cannot start: {exc}") from None
    if certificate is not None:
        # Granian's own reload: new workers one by one (with the new copies), the old ones
        # stopped gracefully once each new one is up.
        watch_certificate(certificate, every, lambda: os.kill(os.getpid(), signal.SIGHUP))
    Granian(**served).serve()  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

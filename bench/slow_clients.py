"""Slow clients against a web server: do trickling connections starve everyone else?

Opens ``--slow`` loopback sockets that each send ``POST /webhooks/vmi HTTP/1.1``, a
``Host`` line and then one more header line every ``--trickle`` seconds (a slowloris),
and meanwhile sends ``GET /healthz`` (or a review, ``--path``) once every 50 ms from one
ordinary client, measuring each answer. Prints the ordinary client's p50/p99/max and how
many of its calls failed, and how many slow sockets the server closed on its own.

    python -m bench.slow_clients --url http://127.0.0.1:8000 --slow 200 --seconds 15

Run it against ``gunicorn -c deploy/gunicorn.conf.py gpuplane.wsgi`` (the API server)
and against ``python deploy/webhook_server.py`` (the webhook server) to compare; the
table in docs/webhook.md (serving the webhook) comes from this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import ssl
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit


def trickle(host: str, port: int, stop: threading.Event, every: float, closed: list[int], tls: bool) -> None:
    """One slowloris connection: a request line, then a header line every ``every`` seconds."""
    try:
        raw = socket.create_connection((host, port), timeout=5)
        sock: socket.socket = raw
        if tls:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            sock = context.wrap_socket(raw, server_hostname=host)
        sock.sendall(f"POST /webhooks/vmi HTTP/1.1\r\nHost: {host}\r\n".encode())
        n = 0
        while not stop.wait(every):
            n += 1
            sock.sendall(f"X-Slow-{n}: {n}\r\n".encode())
    except OSError:
        closed.append(1)  # the server hung up on us: what a defended server does
        return
    finally:
        with contextlib.suppress(OSError, UnboundLocalError):
            sock.close()


def probe(url: str, body: bytes | None, headers: dict[str, str], timeout: float) -> float | None:
    """Seconds for one ordinary call, or None if it failed or timed out."""
    context = ssl._create_unverified_context()  # noqa: S323 - loopback bench against a self-signed server
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")  # noqa: S310
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:  # noqa: S310
            response.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, object]:
    parts = urlsplit(args.url)
    host, port, tls = parts.hostname or "127.0.0.1", parts.port or 80, parts.scheme == "https"
    stop = threading.Event()
    closed: list[int] = []
    threads = [
        threading.Thread(target=trickle, args=(host, port, stop, args.trickle, closed, tls), daemon=True)
        for _ in range(args.slow)
    ]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # let every slow socket connect and start trickling
    body = Path(args.body).read_bytes() if args.body else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {args.token}"} if args.token else {})}
    times: list[float] = []
    failed = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        took = probe(args.url.rstrip("/") + args.path, body, headers, args.timeout)
        if took is None:
            failed += 1
        else:
            times.append(took)
        time.sleep(0.05)
    stop.set()
    times.sort()
    return {
        "slow_connections": args.slow,
        "calls": len(times) + failed,
        "failed": failed,
        "p50_ms": round(statistics.median(times) * 1000, 1) if times else None,
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 1) if times else None,
        "max_ms": round(times[-1] * 1000, 1) if times else None,
        "slow_closed_by_server": len(closed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--path", default="/healthz", help="what the ordinary client calls")
    parser.add_argument("--body", help="file with a JSON body to POST instead of a GET")
    parser.add_argument("--token", help="bearer token for the ordinary client")
    parser.add_argument("--slow", type=int, default=200, help="slow connections")
    parser.add_argument("--trickle", type=float, default=2.0, help="seconds between a slow client's header lines")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the ordinary client keeps calling")
    parser.add_argument("--timeout", type=float, default=5.0, help="the ordinary client's timeout per call")
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()

"""Real parts for the queue tests: `celery worker` processes, the test Redis, the webhook
served by gunicorn, and waits on the pass lock and the queue.

Shared by tests/runtime/test_worker.py, tests/webhooks/test_webhook.py, tests/webhooks/test_webhook_race.py and
tests/system/test_faults.py; the pytest fixtures built on them (``broker``, ``start_worker``,
``server``, ``postgres_only``) are in tests/conftest.py.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from django.db import connection, transaction

from binder.queue import queue_full_pass
from binder.runtime.locking import ADVISORY_KEY
from gpuplane.celery import app as celery_app
from harness.ports import free_port

#: The test Redis. Read at call time by :class:`Worker` and :func:`serve_webhook`, so a test
#: may point them at a Redis of its own (tests/system/test_faults.py monkeypatches it).
REDIS_URL = os.environ.get("GPUPLANE_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
#: Every key of this run under its own prefix: parallel runs on one Redis stay apart.
PREFIX = f"gpuplane-test-{os.getpid()}:"
ROOT = Path(__file__).resolve().parents[1]


def skip_unless_postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("worker integration tests run on PostgreSQL (make test-postgres), as in production")


def forget_keys(client: redis.Redis) -> None:
    """Delete every key of this run (:data:`PREFIX`) from ``client``."""
    for key in client.scan_iter(match=PREFIX + "*"):
        client.delete(key)


def reset_producer_pool() -> None:
    """Drop Celery's cached broker connections so the next publish uses the new URL."""
    celery_app._pool = None
    celery_app.amqp._producer_pool = None


def database_url() -> str:
    """The test database as a DATABASE_URL, for the processes a test starts (on SQLite the
    test database is a file, so another process opens the same one)."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Worker:
    """One `celery worker` process (solo pool: the pass runs in the process we can kill)."""

    def __init__(self, name: str, log: Path, delay: float, extra_env: dict[str, str] | None = None) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "CELERY_BROKER_URL": REDIS_URL,
            "GPUPLANE_FAULT_PASS_DELAY_SECONDS": str(delay),
            "GPUPLANE_VAR_DIR": str(log.parent),
            "GPUPLANE_AUTO_PASS": "false",
            "GPUPLANE_BROKER_KEY_PREFIX": PREFIX,
            # Every pass on the worker's in-memory state is verified against a rebuild.
            "GPUPLANE_VERIFY_SECONDS": "0",
            "GPUPLANE_CHECKPOINTS": "false",  # as in the test process (tests/conftest.py)
            **(extra_env or {}),
        }
        self.log = log
        self.handle = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "gpuplane", "worker", "-Q", "binder", "--pool", "solo",
             "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
            cwd=ROOT, env=env, stdout=self.handle, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while "ready." not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n{log.read_text()}")
            time.sleep(0.1)

    def tasks_done(self) -> int:
        return self.log.read_text().count("succeeded in")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.handle.close()


class Served(str):
    """A server's URL, with the process group serving it: a test may stop the group
    (SIGSTOP) to stand for a server that accepts connections and never answers."""

    pgid: int

    def __new__(cls, url: str, pgid: int) -> Served:
        served = super().__new__(cls, url)
        served.pgid = pgid
        return served

    def hang(self) -> None:
        os.killpg(self.pgid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pgid, signal.SIGCONT)


@contextmanager
def webhook_server(
    env: dict[str, str], workdir: Path, *, scheme: str = "http", probe_http: bool = True, port: int | None = None
) -> Iterator[Served]:
    """The production webhook server (``deploy/webhook_server.py``: granian, its own port)
    with ``env`` on a free port, in a process group of its own; yields its URL once
    ``/healthz`` answers (or, with ``probe_http=False``, once the port accepts: a server that
    demands client certificates answers no probe without one)."""
    port = port or free_port()
    env = {**env, "GPUPLANE_WEBHOOK_BIND": f"127.0.0.1:{port}", "GPUPLANE_WEBHOOK_ENABLED": "true"}
    log = (workdir / "webhook-server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "deploy/webhook_server.py"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = Served(f"{scheme}://127.0.0.1:{port}", process.pid)
    context = ssl._create_unverified_context()  # noqa: S323 - readiness probe of a loopback test server
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if not probe_http:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                with urllib.request.urlopen(f"{url}/healthz", timeout=1, context=context) as resp:  # noqa: S310
                    if resp.status == 200:
                        break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((workdir / "webhook-server.log").read_text()) from None
                time.sleep(0.1)
        yield url
    finally:
        url.resume()  # a stopped group would not hear the SIGTERM
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@contextmanager
def serve_webhook(workdir: Path) -> Iterator[str]:
    """The webhook as production serves it (plain HTTP: TLS has its own test), with the test
    database and :data:`REDIS_URL`; yields its URL."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "CELERY_BROKER_URL": REDIS_URL,
        "GPUPLANE_BROKER_KEY_PREFIX": PREFIX,
        "GPUPLANE_VAR_DIR": str(workdir),
        "GPUPLANE_AUTO_PASS": "false",
        "GPUPLANE_WEBHOOK_WORKERS": "2",
        "GPUPLANE_WEBHOOK_THREADS": "26",
        "GPUPLANE_WEBHOOK_AUTH": "none",
        "GPUPLANE_CLUSTER": "standalone",
    }
    with webhook_server(env, workdir) as url:
        yield url


def mirror_event() -> None:
    """One mirror change, committed on its own: it queues a full pass."""
    with transaction.atomic():
        queue_full_pass()


def pass_holder() -> int | None:
    """The backend holding the pass lock in this test's database, if any.

    pg_locks lists the advisory locks of every database on the server, and other test
    runs on the same PostgreSQL take the same key in theirs: only this database counts.
    """
    high, low = (ADVISORY_KEY >> 32) & 0xFFFFFFFF, ADVISORY_KEY & 0xFFFFFFFF
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s AND objid = %s"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [high, low],
        )
        row = cursor.fetchone()
    return int(row[0]) if row else None


def pass_running() -> bool:
    """True while a session holds the pass lock in this database."""
    return pass_holder() is not None


def wait_until_idle(client: redis.Redis, timeout: float = 30) -> None:
    """Wait until nothing is queued and no pass is running (or has been, for 0.5 s)."""
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        # Not the "unacked" hash: a killed worker's message stays there until the
        # visibility timeout. A fetched message starts its pass within the quiet period.
        busy = sum(client.llen(PREFIX + k) for k in ("binder", "binder:9")) or pass_running()
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 0.5:
            return
        time.sleep(0.05)
    raise AssertionError("the binder queue did not drain")


def wait_for(predicate: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)

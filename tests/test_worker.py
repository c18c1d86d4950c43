"""The binder queue with real parts: a `celery worker` process, Redis and PostgreSQL.

These tests start real workers (``celery -A gpuplane worker``) against the Redis on
127.0.0.1:6379 (database 11, flushed per test) and the PostgreSQL test database, and
check what operators rely on: bursts collapse, answer passes jump the queue, several
workers never overlap or double-book, and a worker killed mid-pass leaves nothing
half-written. A pass is slowed down with the fault-injection setting
``GPUPLANE_FAULT_PASS_DELAY_SECONDS`` so "while a pass runs" is deterministic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection, transaction

from binder import models
from binder.mirror.snapshot import load_objects
from binder.queue import collapse_key, queue_answer_pass, queue_full_pass
from binder.runtime.locking import ADVISORY_KEY
from gpuplane.celery import app as celery_app
from tests.shapes import H100, class_obj, gpu_obj, node_obj

REDIS_URL = os.environ.get("GPUPLANE_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
#: Every key of this run under its own prefix: parallel runs on one Redis stay apart.
PREFIX = f"gpuplane-test-{os.getpid()}:"
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("worker integration tests run on PostgreSQL (make test-postgres), as in production")


@pytest.fixture
def broker(settings: Any) -> Iterator[redis.Redis]:
    """Point this process's Celery at the test Redis, flushed; restore afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()  # no Redis is a failure here, not a skip
    _forget(client)
    # Saved before the settings change: Celery reads its conf from Django's settings lazily,
    # so reading it afterwards would "save" the test's values and leave eager mode off.
    conf = celery_app.conf
    saved = (conf.broker_url, conf.task_always_eager, conf.broker_transport_options)
    options = {**django_settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": PREFIX}
    settings.CELERY_BROKER_URL = REDIS_URL
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    conf.broker_url, conf.task_always_eager, conf.broker_transport_options = REDIS_URL, False, options
    _reset_producer_pool()
    yield client
    conf.broker_url, conf.task_always_eager, conf.broker_transport_options = saved
    _reset_producer_pool()
    _forget(client)


def _forget(client: redis.Redis) -> None:
    for key in client.scan_iter(match=PREFIX + "*"):
        client.delete(key)


def _reset_producer_pool() -> None:
    """Drop Celery's cached broker connections so the next publish uses the new URL."""
    celery_app._pool = None
    celery_app.amqp._producer_pool = None


def _database_url() -> str:
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Worker:
    """One `celery worker` process (solo pool: the pass runs in the process we can kill)."""

    def __init__(self, name: str, log: Path, delay: float) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": _database_url(),
            "CELERY_BROKER_URL": REDIS_URL,
            "GPUPLANE_FAULT_PASS_DELAY_SECONDS": str(delay),
            "GPUPLANE_VAR_DIR": str(log.parent),
            "GPUPLANE_AUTO_PASS": "false",
            "GPUPLANE_BROKER_KEY_PREFIX": PREFIX,
            # Every pass on the worker's in-memory state is verified against a rebuild (issue 14).
            "GPUPLANE_VERIFY_SECONDS": "0",
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


@pytest.fixture
def start_worker(broker: redis.Redis, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def start(name: str = "w1", delay: float = 0.0) -> Worker:
        worker = Worker(name, tmp_path / f"{name}-{len(workers)}.log", delay)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def _cluster(orders: int = 6, units: int = 4) -> None:
    load_objects(
        [
            class_obj("h100", H100),
            node_obj("n1", {H100: units}),
            node_obj("n2", {H100: units}),
            *[gpu_obj("t1", f"vm{i}-gpu0", "h100", f"vm{i}") for i in range(orders)],
        ]
    )


def _event() -> None:
    """One mirror change, committed on its own: it queues a full pass."""
    with transaction.atomic():
        queue_full_pass()


def _idle(client: redis.Redis, timeout: float = 30) -> None:
    """Wait until nothing is queued and no pass is running (or has been, for 0.5 s)."""
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        # Not the "unacked" hash: a killed worker's message stays there until the
        # visibility timeout. A fetched message starts its pass within the quiet period.
        busy = sum(client.llen(PREFIX + k) for k in ("binder", "binder:9")) or _pass_running()
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 0.5:
            return
        time.sleep(0.05)
    raise AssertionError("the binder queue did not drain")


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


def _pass_running() -> bool:
    """True while a session holds the pass lock in this database."""
    return pass_holder() is not None


def _wait_for(predicate: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def _runs() -> list[models.PassRun]:
    return list(models.PassRun.objects.order_by("started"))


def test_a_burst_of_200_events_runs_at_most_two_full_passes(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster()
    start_worker(delay=2.0)
    started = time.monotonic()
    for _ in range(200):
        _event()
    burst = time.monotonic() - started
    assert burst < 2.0, f"the burst took {burst:.1f}s, longer than one slowed pass: the test proves nothing"
    _idle(broker)
    full = [r for r in _runs() if r.kind == "full"]
    assert 1 <= len(full) <= 2, [r.started for r in full]
    assert models.GpuDevice.objects.filter(phase="Bound").count() == 6


def test_an_answer_pass_runs_right_after_the_running_pass_before_the_next_full_pass(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster(orders=2)
    start_worker(delay=1.5)
    _event()  # full pass A starts and runs slowly
    _wait_for(_pass_running)
    for _ in range(3):
        _event()  # collapse into one full pass B, queued behind A
    models.GpuDevice.objects.filter(name="vm0-gpu0").update(bind_request="req-1")
    with transaction.atomic():
        queue_answer_pass()  # published last, but must run before B
    _idle(broker)
    assert [r.kind for r in _runs()] == ["full", "answer", "full"]


def test_two_workers_never_overlap_and_never_book_a_unit_twice(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster(orders=12, units=4)  # 12 single-GPU orders, 8 units
    workers = [start_worker("w1", delay=0.3), start_worker("w2", delay=0.3)]
    for i in range(12):
        _event()
        if i % 3 == 0:
            models.GpuDevice.objects.filter(name=f"vm{i}-gpu0").update(bind_request=f"req-{i}")
            with transaction.atomic():
                queue_answer_pass()
        time.sleep(0.1)
    _idle(broker)
    runs = _runs()
    assert len(runs) >= 3
    for before, after in zip(runs, runs[1:], strict=False):
        assert before.finished is not None and after.started >= before.finished, "two passes overlapped"
    assert all(w.tasks_done() >= 1 for w in workers), [w.tasks_done() for w in workers]
    for node in ("n1", "n2"):
        assert models.GpuDevice.objects.filter(phase="Bound", node=node).count() <= 4
    assert models.GpuDevice.objects.filter(phase="Bound").count() == 8


def test_a_worker_killed_mid_pass_leaves_nothing_half_written(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster(orders=2)
    # A set left split by an earlier half-failed write: one member on n1, one on n2.
    load_objects(
        [
            gpu_obj("t2", "split-gpu0", "h100", "split", phase="Bound", node="n1"),
            gpu_obj("t2", "split-gpu1", "h100", "split", phase="Bound", node="n2"),
        ]
    )
    before = sorted(models.GpuDevice.objects.values_list("name", "phase", "node"))
    doomed = start_worker("doomed", delay=5.0)
    _event()
    _wait_for(_pass_running)
    doomed.stop(signal.SIGKILL)
    _wait_for(lambda: not _pass_running())  # PostgreSQL rolled the pass back and freed the lock
    assert sorted(models.GpuDevice.objects.values_list("name", "phase", "node")) == before
    assert models.PassRun.objects.count() == 0

    start_worker("heir")
    _event()
    _idle(broker)
    split = set(models.GpuDevice.objects.filter(vm_name="split").values_list("phase", "node"))
    assert len(split) == 1 and next(iter(split))[0] == "Bound"
    assert models.GpuDevice.objects.filter(phase="Pending").count() == 0


def test_collapse_key_is_cleared_when_the_pass_starts(start_worker: Callable[..., Worker], broker: redis.Redis) -> None:
    _cluster(orders=1)
    _event()
    assert broker.exists(collapse_key("full"))  # queued, no worker yet
    _event()
    assert broker.llen(PREFIX + "binder:9") == 1  # the second event added nothing
    start_worker()
    _idle(broker)
    assert not broker.exists(collapse_key("full"))
    assert [r.kind for r in _runs()] == ["full"]
    assert django_settings.CELERY_BROKER_URL == REDIS_URL

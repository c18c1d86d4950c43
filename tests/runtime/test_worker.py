"""The binder queue with real parts: a `celery worker` process, Redis and PostgreSQL.

These tests start real workers (``celery -A gpuplane worker``) against the Redis on
127.0.0.1:6379 (database 11, flushed per test) and the PostgreSQL test database, and
check what operators rely on: bursts collapse, answer passes jump the queue, several
workers never overlap or double-book, and a worker killed mid-pass leaves nothing
half-written. A pass is slowed down with the fault-injection setting
``GPUPLANE_FAULT_PASS_DELAY_SECONDS`` so "while a pass runs" is deterministic. The workers
and the waits are in harness/workers.py, the ``broker`` and ``start_worker`` fixtures in
tests/conftest.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest
import redis
from django.conf import settings as django_settings
from django.db import transaction

from binder import models
from binder.mirror.snapshot import load_objects
from binder.queue import collapse_key, queue_answer_pass, queue_full_pass
from harness.shapes import H100, class_obj, gpu_obj, node_obj
from harness.workers import PREFIX, REDIS_URL, Worker, mirror_event, pass_running, wait_for, wait_until_idle

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("postgres_only")]


def _cluster(orders: int = 6, units: int = 4) -> None:
    load_objects(
        [
            class_obj("h100", H100),
            node_obj("n1", {H100: units}),
            node_obj("n2", {H100: units}),
            *[gpu_obj("t1", f"vm{i}-gpu0", "h100", f"vm{i}") for i in range(orders)],
        ]
    )


def _runs() -> list[models.PassRun]:
    return list(models.PassRun.objects.order_by("started"))


def test_a_burst_of_200_events_runs_at_most_two_full_passes(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster()
    start_worker(delay=2.0)
    started = time.monotonic()
    for _ in range(200):
        mirror_event()
    burst = time.monotonic() - started
    assert burst < 2.0, f"the burst took {burst:.1f}s, longer than one slowed pass: the test proves nothing"
    wait_until_idle(broker)
    full = [r for r in _runs() if r.kind == "full"]
    assert 1 <= len(full) <= 2, [r.started for r in full]
    assert models.GpuDevice.objects.filter(phase="Bound").count() == 6


def test_an_answer_pass_runs_right_after_the_running_pass_before_the_next_full_pass(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster(orders=2)
    start_worker(delay=1.5)
    mirror_event()  # full pass A starts and runs slowly
    wait_for(pass_running)
    for _ in range(3):
        mirror_event()  # collapse into one full pass B, queued behind A
    models.GpuDevice.objects.filter(name="vm0-gpu0").update(bind_request="req-1")
    with transaction.atomic():
        queue_answer_pass()  # published last, but must run before B
    wait_until_idle(broker)
    assert [r.kind for r in _runs()] == ["full", "answer", "full"]


@pytest.mark.slow
@pytest.mark.parametrize(("max_delay", "starves"), [(1.0, False), (60.0, True)])
def test_a_queued_full_pass_waits_behind_a_stream_of_answer_passes_at_most_the_max_delay(
    start_worker: Callable[..., Worker], broker: redis.Redis, max_delay: float, starves: bool
) -> None:
    """Fairness: answer passes go first, but a full pass queued during a stream of them
    runs within GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS (plus the pass in flight). With a delay
    longer than the stream it waits for the whole stream: the setting is what bounds it."""
    _cluster(orders=2)
    start_worker(delay=0.3, GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS=str(max_delay))
    mirror_event()  # full pass A
    wait_for(pass_running)
    with transaction.atomic():
        queue_full_pass()  # full pass B, queued behind A and then behind the stream
    queued = time.monotonic()
    stream_until = queued + 4.0
    while time.monotonic() < stream_until:  # a bind request every 0.1 s: an answer pass always queued
        models.GpuDevice.objects.filter(name="vm0-gpu0").update(bind_request=f"req-{time.monotonic()}")
        with transaction.atomic():
            queue_answer_pass()
        time.sleep(0.1)
    wait_until_idle(broker)
    runs = _runs()
    full_b = [r for r in runs if r.kind == "full"][1]
    answers_before_b = sum(1 for r in runs if r.kind == "answer" and r.started < full_b.started)
    answers_after_b = sum(1 for r in runs if r.kind == "answer" and r.started > full_b.started)
    if starves:
        assert answers_after_b <= 1, "the full pass ran during the stream although its delay was not reached"
    else:
        # B ran in the middle of the stream, ahead of answer passes queued before it ran.
        assert answers_before_b >= 1 and answers_after_b >= 3, (answers_before_b, answers_after_b)


@pytest.mark.slow
def test_two_workers_never_overlap_and_never_book_a_unit_twice(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    _cluster(orders=12, units=4)  # 12 single-GPU orders, 8 units
    workers = [start_worker("w1", delay=0.3), start_worker("w2", delay=0.3)]
    for i in range(12):
        mirror_event()
        if i % 3 == 0:
            models.GpuDevice.objects.filter(name=f"vm{i}-gpu0").update(bind_request=f"req-{i}")
            with transaction.atomic():
                queue_answer_pass()
        time.sleep(0.1)
    wait_until_idle(broker)
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
    mirror_event()
    wait_for(pass_running)
    doomed.stop(signal.SIGKILL)
    wait_for(lambda: not pass_running())  # PostgreSQL rolled the pass back and freed the lock
    assert sorted(models.GpuDevice.objects.values_list("name", "phase", "node")) == before
    assert models.PassRun.objects.count() == 0

    start_worker("heir")
    mirror_event()
    wait_until_idle(broker)
    split = set(models.GpuDevice.objects.filter(vm_name="split").values_list("phase", "node"))
    assert len(split) == 1 and next(iter(split))[0] == "Bound"
    assert models.GpuDevice.objects.filter(phase="Pending").count() == 0


def test_collapse_key_is_cleared_when_the_pass_starts(start_worker: Callable[..., Worker], broker: redis.Redis) -> None:
    _cluster(orders=1)
    mirror_event()
    assert broker.exists(collapse_key("full"))  # queued, no worker yet
    mirror_event()
    assert broker.llen(PREFIX + "binder:9") == 1  # the second event added nothing
    start_worker()
    wait_until_idle(broker)
    assert not broker.exists(collapse_key("full"))
    assert [r.kind for r in _runs()] == ["full"]
    assert django_settings.CELERY_BROKER_URL == REDIS_URL

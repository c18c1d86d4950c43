"""The full pass an answer pass asks for comes GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS later.

A full pass started right after every answer pass that bound a set made the next answer
passes (and the webhook calls waiting on them) wait for its end. Now it is published with
a countdown, requests meanwhile fold into it, fairness counts from when it is due, and the
embedded default (tasks in-process) still runs it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import redis
from celery import current_app
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from binder import models
from binder.mirror.snapshot import load_objects
from binder.queue import collapse_key, full_pass_overdue, queue_answer_pass, send_full_pass
from binder.tasks import answer_pass_task, full_pass_task
from gpuplane.settings import env_float
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj
from harness.workers import Worker, wait_for, wait_until_idle
from usage.models import UsageRecord


def _published(task: str) -> Any:
    return mock.patch.object(current_app.tasks[task], "apply_async")


def test_a_delayed_full_pass_goes_out_with_a_countdown_and_later_requests_fold_into_it(
    broker: redis.Redis, settings: Any
) -> None:
    settings.GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS = 5.0
    with _published("binder.full_pass") as publish:
        send_full_pass("answer", delay=2.0)
        send_full_pass("event")  # already queued (due in 2 s): adds nothing
    publish.assert_called_once_with(kwargs={"triggered_by": "answer"}, priority=9, countdown=2.0)
    due = float(broker.get(collapse_key("full")) or 0)
    assert time.time() + 1 < due <= time.time() + 2
    assert not full_pass_overdue()
    # Fairness counts from when the pass is due, not from when it was asked for.
    broker.set(collapse_key("full"), f"{time.time() - 4:.3f}")
    assert not full_pass_overdue()
    broker.set(collapse_key("full"), f"{time.time() - 6:.3f}")
    assert full_pass_overdue()


def test_an_undelayed_full_pass_goes_out_as_before(broker: redis.Redis) -> None:
    with _published("binder.full_pass") as publish:
        send_full_pass("resync")
    publish.assert_called_once_with(kwargs={"triggered_by": "resync"}, priority=9)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("answer_queued", "due_ago", "eta", "runs"),
    [
        (True, 0.0, True, False),  # came due behind a queued answer pass: queued again
        (False, 0.0, True, True),  # nothing queued ahead: runs
        (True, 6.0, True, True),  # due past GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS: runs
        (True, 0.0, False, True),  # not a delayed message: the priority lists already ordered it
    ],
)
def test_a_delayed_full_pass_due_behind_a_queued_answer_pass_goes_back_into_its_priority_list(
    broker: redis.Redis, settings: Any, answer_queued: bool, due_ago: float, eta: bool, runs: bool
) -> None:
    settings.GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS = 5.0
    broker.set(collapse_key("full"), f"{time.time() - due_ago:.3f}")
    if answer_queued:
        broker.set(collapse_key("answer"), f"{time.time():.3f}")
    full_pass_task.push_request(eta="2026-11-30T12:00:00+00:00" if eta else None)
    try:
        with _published("binder.full_pass") as publish, mock.patch("binder.tasks.run_pass") as run:
            run.return_value.pk = 41
            result = full_pass_task.run("answer")
    finally:
        full_pass_task.pop_request()
    if runs:
        assert result == 41 and not publish.called
        assert broker.get(collapse_key("full")) is None  # released: events from now need another pass
    else:
        assert result is None and not run.called
        publish.assert_called_once_with(kwargs={"triggered_by": "answer"}, priority=9)
        assert broker.get(collapse_key("full")) is not None  # still the one queued full pass


@pytest.mark.django_db
@pytest.mark.parametrize(("delay", "countdown"), [(1.5, {"countdown": 1.5}), (0.0, {})])
def test_an_answer_pass_that_binds_asks_for_the_full_pass_after_the_setting(
    settings: Any, django_capture_on_commit_callbacks: Any, delay: float, countdown: dict[str, float]
) -> None:
    settings.GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS = delay
    load_objects([namespace_obj("t1"), class_obj("h100", H100), node_obj("n1", {H100: 8}),
                  gpu_obj("t1", "g0", "h100", "vm1", bind_request="req-1")])  # fmt: skip
    with _published("binder.full_pass") as publish, django_capture_on_commit_callbacks(execute=True):
        answer_pass_task.apply()
    publish.assert_called_once_with(kwargs={"triggered_by": "answer"}, priority=9, **countdown)


@pytest.mark.django_db
def test_in_process_the_follow_up_full_pass_still_runs_at_once(
    settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    """The embedded default has no broker: Celery runs the task in-process and ignores the countdown."""
    settings.GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS = 30.0
    load_objects([namespace_obj("t1"), class_obj("h100", H100), node_obj("n1", {H100: 8}),
                  gpu_obj("t1", "g0", "h100", "vm1", bind_request="req-1")])  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        answer_pass_task.apply()
    kinds = list(models.PassRun.objects.order_by("pk").values_list("kind", "triggered_by"))
    assert kinds == [("answer", "webhook"), ("full", "answer")]
    assert UsageRecord.objects.filter(subject="g0", end__isnull=True).count() == 1


@pytest.mark.parametrize(("raw", "ok"), [("", True), ("0", True), ("2.5", True), ("60", True), ("61", False)])
def test_the_delay_is_at_most_a_minute(monkeypatch: pytest.MonkeyPatch, raw: str, ok: bool) -> None:
    monkeypatch.setenv("GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS", raw)
    if ok:
        env_float("GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS", 1.0, maximum=60.0)
    else:
        with pytest.raises(ImproperlyConfigured, match="GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS='61' must be at most"):
            env_float("GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS", 1.0, maximum=60.0)


# -- with a real worker -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
def test_answer_passes_run_while_the_follow_up_full_pass_waits_and_one_full_pass_follows_them(
    start_worker: Callable[..., Worker], broker: redis.Redis
) -> None:
    load_objects([namespace_obj("t1"), class_obj("h100", H100), node_obj("n1", {H100: 8})])
    start_worker(GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS="2")
    with transaction.atomic():
        send_full_pass("event")  # the cluster's first full pass: records are exact from here
    wait_until_idle(broker)
    for i in range(2):  # two orders, one after the other, as the webhook writes them
        load_objects([gpu_obj("t1", f"vm{i}-gpu0", "h100", f"vm{i}", bind_request=f"req-{i}")])
        with transaction.atomic():
            queue_answer_pass()
        wait_for(lambda i=i: models.GpuDevice.objects.filter(name=f"vm{i}-gpu0", phase="Bound").exists())
    wait_for(lambda: models.PassRun.objects.filter(kind="full", triggered_by="answer").exists(), timeout=30)
    wait_until_idle(broker)
    runs = list(models.PassRun.objects.order_by("pk"))
    assert [(r.kind, r.triggered_by) for r in runs[1:]] == [
        ("answer", "webhook"),
        ("answer", "webhook"),
        ("full", "answer"),
    ]
    first_answer, full = runs[1], runs[3]
    assert full.started - first_answer.started >= timedelta(seconds=2)  # not before it is due
    for device in models.GpuDevice.objects.all():
        (record,) = UsageRecord.objects.filter(subject=device.name)
        assert record.start == device.since  # billed from its binding, not from the full pass
        assert record.start < full.started

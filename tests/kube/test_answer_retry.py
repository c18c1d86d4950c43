"""An answer pass whose status write did not land asks for another answer pass at once.

A webhook call waits for its set's answer, and the pass that would otherwise retry the
write (the full pass after answers, a resync) may be seconds away: at 10,000 nodes a VMI
was refused "the binder did not answer within 8s" because the answer pass met its device's
row held by the sync, mirroring the bind request's own watch event, and skipped it. The
row is held here the same way, by another transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from binder import models, sync, tasks
from binder.runtime import bind_requests
from harness.cluster_mode import RowHolder, cluster_gpus
from harness.controlplane import ControlPlane
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The answer passes the task asked for (instead of publishing them)."""
    calls: list[str] = []
    monkeypatch.setattr(tasks, "send_answer_pass", lambda triggered_by=None: calls.append(triggered_by or ""))
    monkeypatch.setattr(tasks, "_answer_retries", 0)
    yield calls


def one_requested_order(plane: ControlPlane) -> None:
    """t1's g0, a Pending GPU of vm0 with room for it on n1, mirrored, with a bind request."""
    plane.seed(
        namespace_obj("t1"), node_obj("n1", {H100: 8}), class_obj("h100", H100), gpu_obj("t1", "g0", "h100", "vm0")
    )
    sync.sync_once()
    assert bind_requests.write_requests("t1", "vm0", ("g0",), "req-1", {}) == 1


@pytest.mark.django_db(transaction=True)
def test_a_skipped_answer_is_retried_at_once_and_lands_once_the_row_is_free(
    apiserver: ControlPlane, postgres_only: None, asked: list[str]
) -> None:
    one_requested_order(apiserver)
    holder = RowHolder("g0")
    try:
        first = models.PassRun.objects.get(pk=tasks.answer_pass_task())
    finally:
        holder.stop()
    assert first.writes_failed == 1 and first.devices_written == 0
    assert asked == ["retry"], "the skipped answer waited for some later pass"
    assert models.GpuDevice.objects.get(name="g0").answered_request == ""

    second = models.PassRun.objects.get(pk=tasks.answer_pass_task(triggered_by="retry"))
    assert second.writes_failed == 0 and second.triggered_by == "retry"
    assert asked == ["retry"], "a pass whose writes all landed asks for nothing more"
    device = models.GpuDevice.objects.get(name="g0")
    assert (device.phase, device.answered_request) == ("Bound", "req-1")
    status: dict[str, Any] = cluster_gpus(apiserver)[("t1", "g0")]["status"]
    assert (status["phase"], status["answeredRequest"]) == ("Bound", "req-1")


@pytest.mark.django_db(transaction=True)
def test_retries_stop_after_a_few_in_a_row_while_the_write_never_lands(
    apiserver: ControlPlane, postgres_only: None, asked: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks, "ANSWER_RETRIES", 2)
    one_requested_order(apiserver)
    holder = RowHolder("g0")
    try:
        for _ in range(4):
            tasks.answer_pass_task(triggered_by="retry")
    finally:
        holder.stop()
    assert asked == ["retry", "retry"]
    assert models.GpuDevice.objects.get(name="g0").answered_request == ""

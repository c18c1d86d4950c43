"""Checkpoints saved in the background (binder.runtime.checkpoint, PostgreSQL).

A pass on a large state saves its checkpoint from a forked child holding the state as it
was at the fork, so the passes after it do not wait for the save:

- the passes go on while the child is held before it pickles, and what the child saves
  is the state of the fork with the feed position of the fork (the worker's state moved
  on meanwhile), and a new worker starting from it ends equal to one reading everything;
- a child killed inside its transaction leaves the previous checkpoint, which a new
  worker then loads, and the worker logs that the save did not land;
- a save asked for while one runs in the background is not started; a save in place
  (the shutdown's) waits for the one in the background first, so it ends the newest;
- inside a transaction (what another connection cannot see yet) the save stays in place.

The child is held by the module's hooks (``_before_pickle``, ``_before_write``), which
it inherits from the test process at the fork; it is released through files.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from binder import models
from binder.mirror.snapshot import load_objects
from binder.runtime import checkpoint, checkpoint_payload
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness.factories import checkpointed
from harness.shapes import H100, gpu_obj


def assert_same_as_from_scratch(state: ClusterState) -> None:
    scratch = ClusterState()
    scratch.rebuild("compare")
    assert compare_records(state, scratch) == []
    assert state.device_ids == scratch.device_ids
    assert {k: dict(v) for k, v in state.members.items()} == {k: dict(v) for k, v in scratch.members.items()}


def held_until(release: Path, reached: Path | None = None) -> Callable[[], None]:
    """A hook for the child: say it got there (``reached``), then wait for ``release``."""

    def hook() -> None:
        if reached is not None:
            reached.write_text("here")
        while not release.exists():
            time.sleep(0.01)

    return hook


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


@pytest.fixture
def in_background(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Checkpoints on, and every pass's checkpoint saved in the background (any size)."""
    settings.GPUPLANE_CHECKPOINTS = True
    monkeypatch.setattr(checkpoint, "BACKGROUND_AT_DEVICES", 0)
    yield
    assert checkpoint.wait(timeout=120), "a background save is still running"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("in_background", "postgres_only")
def test_passes_go_on_while_the_checkpoint_is_saved_from_the_state_at_the_fork(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    monkeypatch.setattr(checkpoint, "_before_pickle", held_until(release))
    load_objects(checkpointed())
    first = ClusterState()
    try:
        assert run_pass(models.PassKind.FULL, first).view == "rebuilt"  # its checkpoint: in a child, held
        assert checkpoint.saving()
        at_fork = first.position
        records_at_fork = {kind: dict(table) for kind, table in first.records.items()}
        # The worker goes on while the child is held: its state moves past the fork.
        models.Node.objects.filter(name="n2").update(allocatable={H100: 2})
        load_objects([gpu_obj("t1", "g2", "h100", "vm2"), gpu_obj("t1", "g3", "h100", "vm2")])
        assert run_pass(models.PassKind.FULL, first).view == "incremental"
        assert models.GpuDevice.objects.get(name="g2").phase == "Bound"
        assert first.position > at_fork
        assert not models.Checkpoint.objects.exists()
    finally:
        release.write_text("go")
    assert checkpoint.wait(timeout=120)
    assert not checkpoint.saving()
    row = models.Checkpoint.objects.get()
    assert row.position == at_fork
    payload = checkpoint_payload.loads(bytes(row.data))
    assert payload["records"] == records_at_fork  # the content of its position, not the worker's now
    assert ("t1", "g2") not in payload["device_ids"]
    # A new worker starts from it and replays the feed after it.
    models.GpuDevice.objects.filter(name="g1").delete()
    second = ClusterState()
    assert run_pass(models.PassKind.FULL, second).view == "checkpoint"
    assert_same_as_from_scratch(second)
    assert ("t1", "g2") in second.device_ids
    assert run_pass(models.PassKind.FULL, first).view == "incremental"
    assert_same_as_from_scratch(first)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("in_background", "postgres_only")
def test_a_child_killed_inside_its_transaction_leaves_the_previous_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    load_objects(checkpointed())
    first = ClusterState()
    run_pass(models.PassKind.FULL, first)
    assert checkpoint.wait(timeout=120)
    previous = models.Checkpoint.objects.get()
    models.Node.objects.filter(name="n2").update(unschedulable=True)
    run_pass(models.PassKind.FULL, first)

    reached = tmp_path / "in-transaction"

    def stall_inside_the_transaction() -> None:
        # In the child, after its checkpoint row is written: stop before the older go.
        def stall(*args: Any, **kwargs: Any) -> Any:
            reached.write_text("here")
            time.sleep(600)

        models.Checkpoint.objects.filter = stall  # type: ignore[method-assign]

    monkeypatch.setattr(checkpoint, "_before_write", stall_inside_the_transaction)
    with first.lock:
        assert checkpoint.save(first, "to be killed") is None  # the lock held, as in a pass: a child
    wait_for(reached)
    pid = checkpoint._saving.pid if checkpoint._saving is not None else 0
    assert pid > 0
    with caplog.at_level(logging.WARNING, logger="binder.runtime.checkpoint"):
        os.kill(pid, signal.SIGKILL)
        assert checkpoint.wait(timeout=120)
    assert any("not saved" in r.getMessage() and "exited with -9" in r.getMessage() for r in caplog.records)
    assert list(models.Checkpoint.objects.values_list("pk", flat=True)) == [previous.pk]
    fresh = ClusterState()
    assert run_pass(models.PassKind.FULL, fresh).view == "checkpoint"
    assert_same_as_from_scratch(fresh)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("in_background", "postgres_only")
def test_one_save_at_a_time_and_a_save_in_place_comes_after_the_background_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    release = tmp_path / "release"
    monkeypatch.setattr(checkpoint, "_before_pickle", held_until(release))
    load_objects(checkpointed())
    first = ClusterState()
    shutdown_done = threading.Event()
    try:
        run_pass(models.PassKind.FULL, first)
        pid = checkpoint._saving.pid if checkpoint._saving is not None else 0
        with caplog.at_level(logging.INFO, logger="binder.runtime.checkpoint"), first.lock:
            assert checkpoint.save(first, "again") is None
        assert any("is still running in process" in r.getMessage() for r in caplog.records)
        assert checkpoint._saving is not None and checkpoint._saving.pid == pid  # no second child
        models.Node.objects.filter(name="n2").update(unschedulable=True)
        run_pass(models.PassKind.FULL, first)

        def shutdown() -> None:
            try:
                checkpoint.save(first, "worker shutdown")  # what save_on_shutdown does, for this state
            finally:
                from django.db import connection

                connection.close()
                shutdown_done.set()

        saver = threading.Thread(target=shutdown)
        saver.start()
        assert not shutdown_done.wait(0.5)  # it waits for the child, which is held
    finally:
        release.write_text("go")
    saver.join(timeout=120)
    assert shutdown_done.is_set()
    rows = list(models.Checkpoint.objects.values_list("position", flat=True))
    assert rows == [first.position]  # the shutdown's, newest; the child's was deleted by it
    fresh = ClusterState()
    assert run_pass(models.PassKind.FULL, fresh).view == "checkpoint"
    assert_same_as_from_scratch(fresh)


@pytest.mark.django_db
@pytest.mark.usefixtures("in_background")
def test_inside_a_transaction_the_save_stays_in_place() -> None:
    """What the pass wrote is not yet visible to another connection (here the test's
    transaction around everything; on SQLite always): the pass saves in place."""
    load_objects(checkpointed())
    run_pass(models.PassKind.FULL, ClusterState())
    assert not checkpoint.saving()
    assert models.Checkpoint.objects.count() == 1
    assert run_pass(models.PassKind.FULL, ClusterState()).view == "checkpoint"

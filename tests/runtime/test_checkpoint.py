"""Checkpoints of the pass worker's state (binder.runtime.checkpoint).

- Round trip: a worker started from a checkpoint and the feed after it holds exactly
  what a worker reading everything holds (records and ledger), and its pass decides the
  same.
- Every refusal leads to a rebuild, with a log line saying why: none saved, corrupt
  (checksum, or data that does not unpickle), another schema, older than the feed's
  retention (its reader row forgotten), and a gap in the feed after it.
- A worker killed while writing a checkpoint leaves the previous one usable (PostgreSQL,
  a real process killed inside its transaction).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from binder import models
from binder.engine.accounting import Ledger
from binder.mirror.snapshot import load_objects
from binder.runtime import checkpoint
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness import workers
from harness.factories import checkpointed
from harness.shapes import H100, gpu_obj

ROOT = Path(__file__).resolve().parents[2]


def ledger_view(ledger: Ledger) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    booked = {n: {r: u for r, u in sorted(c.items()) if u} for n, c in sorted(ledger.booked.items())}
    used = {ns: {k: u for k, u in sorted(c.items()) if u} for ns, c in sorted(ledger.used.items())}
    return ({n: c for n, c in booked.items() if c}, {ns: c for ns, c in used.items() if c})


def assert_same_as_from_scratch(state: ClusterState) -> None:
    scratch = ClusterState()
    scratch.rebuild("compare")
    assert compare_records(state, scratch) == []
    assert ledger_view(state.ledger()) == ledger_view(scratch.ledger())
    assert state.device_ids == scratch.device_ids
    assert {k: dict(v) for k, v in state.members.items()} == {k: dict(v) for k, v in scratch.members.items()}


@pytest.fixture
def checkpoints(settings: Any) -> None:
    settings.GPUPLANE_CHECKPOINTS = True


def saved_after_a_pass() -> ClusterState:
    """A worker's first pass: it reads everything, then saves a checkpoint."""
    load_objects(checkpointed())
    first = ClusterState()
    assert run_pass(models.PassKind.FULL, first).view == "rebuilt"
    assert models.Checkpoint.objects.count() == 1
    return first


@pytest.mark.django_db
@pytest.mark.usefixtures("checkpoints")
def test_a_new_worker_starts_from_the_checkpoint_and_the_feed_after_it(
    caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    first = saved_after_a_pass()
    # Changes after the checkpoint: a node shrinks, an order arrives, a device goes.
    models.Node.objects.filter(name="n2").update(allocatable={H100: 2})
    load_objects([gpu_obj("t1", "g2", "h100", "vm2"), gpu_obj("t1", "g3", "h100", "vm2")])
    run_pass(models.PassKind.FULL, first)  # the first worker goes on (its state is current)
    models.GpuDevice.objects.filter(name="g1").delete()
    load_objects([gpu_obj("t1", "g4", "h100", "vm3")])
    second = ClusterState()
    with caplog.at_level(logging.INFO, logger="binder.runtime.checkpoint"):
        run = run_pass(models.PassKind.FULL, second)
    assert run.view == "checkpoint"
    assert any("loaded from checkpoint" in r.getMessage() for r in caplog.records)
    assert run.rows_read < 20
    assert_same_as_from_scratch(second)
    # The same decisions as a worker reading everything (which then has nothing to do,
    # usage records included: its full reconciliation opens and closes none).
    phases = sorted(models.GpuDevice.objects.values_list("name", "phase", "node"))
    assert ("t1", "g4") in second.device_ids and dict((n, p) for n, p, _ in phases)["g4"] == "Bound"
    settings.GPUPLANE_CHECKPOINTS = False
    again = run_pass(models.PassKind.FULL, ClusterState())
    assert (again.view, again.devices_written, again.records_opened, again.records_closed) == ("rebuilt", 0, 0, 0)
    assert sorted(models.GpuDevice.objects.values_list("name", "phase", "node")) == phases
    settings.GPUPLANE_CHECKPOINTS = True
    # And it follows the feed from there like any worker.
    models.Node.objects.filter(name="n1").update(unschedulable=True)
    assert run_pass(models.PassKind.FULL, second).view == "incremental"
    assert_same_as_from_scratch(second)


@pytest.mark.django_db
@pytest.mark.usefixtures("checkpoints")
def test_a_worker_whose_place_was_forgotten_loads_the_checkpoint() -> None:
    first = saved_after_a_pass()
    models.FeedReader.objects.filter(worker=first.worker).delete()
    models.Node.objects.filter(name="n2").update(unschedulable=True)
    assert run_pass(models.PassKind.FULL, first).view == "checkpoint"
    assert_same_as_from_scratch(first)


def _corrupt_checksum() -> None:
    row = models.Checkpoint.objects.get()
    data = bytearray(bytes(row.data))
    data[len(data) // 2] ^= 0xFF
    models.Checkpoint.objects.filter(pk=row.pk).update(data=bytes(data))


def _corrupt_payload() -> None:
    import hashlib

    data = b"not a pickle at all"
    models.Checkpoint.objects.update(data=data, checksum=hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (_corrupt_checksum, "corrupt (checksum mismatch)"),
        (_corrupt_payload, "is corrupt (error"),
        (lambda: models.Checkpoint.objects.update(schema="0:old"), "has schema '0:old'"),
        (
            lambda: models.FeedReader.objects.filter(worker=checkpoint.READER).delete(),
            "older than the change feed's retention",
        ),
    ],
    ids=["checksum", "unpickle", "schema", "retention"],
)
@pytest.mark.django_db
@pytest.mark.usefixtures("checkpoints")
def test_a_refused_checkpoint_is_logged_and_the_worker_rebuilds(
    spoil: Any, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved_after_a_pass()
    spoil()
    models.Node.objects.filter(name="n2").update(unschedulable=True)
    fresh = ClusterState()
    with caplog.at_level(logging.WARNING, logger="binder.runtime.checkpoint"):
        run = run_pass(models.PassKind.FULL, fresh)
    assert run.view == "rebuilt"
    refused = [r.getMessage() for r in caplog.records if "checkpoint refused" in r.getMessage()]
    assert refused and said in refused[-1], refused
    assert_same_as_from_scratch(fresh)
    # The rebuild saved a good checkpoint again.
    assert models.Checkpoint.objects.count() == 1
    assert run_pass(models.PassKind.FULL, ClusterState()).view == "checkpoint"


@pytest.mark.django_db
@pytest.mark.usefixtures("checkpoints")
def test_a_checkpoint_past_the_retention_is_forgotten_by_pruning_and_refused(settings: Any) -> None:
    saved_after_a_pass()
    models.FeedReader.objects.filter(worker=checkpoint.READER).update(updated=timezone.now() - timedelta(days=1))
    settings.GPUPLANE_FEED_RETENTION_SECONDS = 60
    run_pass(models.PassKind.FULL, ClusterState())  # loads it, then prunes: the checkpoint's reader is stale
    assert not models.FeedReader.objects.filter(worker=checkpoint.READER).exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("checkpoints")
def test_a_gap_in_the_feed_after_the_checkpoint_rebuilds() -> None:
    saved_after_a_pass()
    row = models.Checkpoint.objects.get()
    models.Change.objects.filter(position__lte=row.mark_at).delete()  # the entry at its mark gone
    models.Node.objects.filter(name="n2").update(unschedulable=True)
    fresh = ClusterState()
    assert run_pass(models.PassKind.FULL, fresh).view == "rebuilt"
    assert_same_as_from_scratch(fresh)


@pytest.mark.django_db
def test_checkpoints_off_saves_and_loads_nothing(settings: Any) -> None:
    settings.GPUPLANE_CHECKPOINTS = False
    load_objects(checkpointed())
    run_pass(models.PassKind.FULL, ClusterState())
    assert not models.Checkpoint.objects.exists()
    assert run_pass(models.PassKind.FULL, ClusterState()).view == "rebuilt"


@pytest.mark.django_db
@pytest.mark.usefixtures("checkpoints")
def test_a_shutdown_saves_the_state() -> None:
    first = saved_after_a_pass()
    models.Node.objects.filter(name="n2").update(unschedulable=True)
    run_pass(models.PassKind.FULL, first)
    before = models.Checkpoint.objects.get()
    checkpoint.save(first, "worker shutdown")
    after = models.Checkpoint.objects.get()
    assert after.pk != before.pk and after.position > before.position and after.reconciled


WRITER = """
import os, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")
import django
django.setup()
from binder import models
from binder.runtime import checkpoint
from binder.runtime.state import ClusterState

state = ClusterState()
state.rebuild("writer")
real_filter = models.Checkpoint.objects.filter

def stall(*args, **kwargs):
    # Inside the checkpoint's transaction: the row and the reader row are written.
    print("writing", flush=True)
    time.sleep(600)

models.Checkpoint.objects.filter = stall
checkpoint.save(state, "killed")
"""


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("checkpoints", "postgres_only")
def test_a_worker_killed_while_writing_a_checkpoint_leaves_the_previous_one() -> None:
    saved_after_a_pass()
    previous = models.Checkpoint.objects.get()
    env = {**os.environ, "DATABASE_URL": workers.database_url(), "GPUPLANE_CHECKPOINTS": "true"}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        time.sleep(0.2)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    assert list(models.Checkpoint.objects.values_list("pk", flat=True)) == [previous.pk]
    models.Node.objects.filter(name="n2").update(unschedulable=True)
    fresh = ClusterState()
    assert run_pass(models.PassKind.FULL, fresh).view == "checkpoint"
    assert_same_as_from_scratch(fresh)

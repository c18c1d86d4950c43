"""Passes never overlap: the cluster-wide lock is held for the whole pass transaction."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections, transaction

from binder.engine import full_pass
from binder.mirror.snapshot import load_objects
from binder.models import PassKind, PassRun
from binder.runtime import passes
from binder.runtime.locking import pass_lock
from binder.runtime.state import ClusterState
from harness.shapes import H100, class_obj, gpu_obj, node_obj


def test_lock_must_be_taken_inside_a_transaction(transactional_db: Any) -> None:
    with pytest.raises(RuntimeError, match="inside transaction.atomic"), pass_lock():
        pass


@pytest.mark.django_db(transaction=True)
def test_concurrent_passes_never_overlap_and_never_book_a_unit_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    load_objects(
        [
            class_obj("h100", H100),
            node_obj("n1", {H100: 4}),
            *[gpu_obj("t1", f"vm{i}-gpu0", "h100", f"vm{i}") for i in range(8)],
        ]
    )
    spans: list[tuple[float, float]] = []

    def slow_full_pass(cluster: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.2)
        result = full_pass(cluster, *args, **kwargs)
        spans.append((start, time.monotonic()))
        return result

    monkeypatch.setitem(passes.ENGINES, PassKind.FULL, slow_full_pass)
    errors: list[BaseException] = []

    def worker() -> None:
        # Each thread is its own worker (its own in-memory state, as separate processes
        # are): only the database lock keeps their passes apart.
        try:
            passes.run_pass(PassKind.FULL, ClusterState())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    spans.sort()
    assert len(spans) == 4
    for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False):
        assert next_start >= end, "two passes ran at the same time"
    # Exactly 4 units exist: every pass saw the previous one's bookings.
    from binder.models import GpuDevice

    assert GpuDevice.objects.filter(phase="Bound").count() == 4
    assert PassRun.objects.filter(kind="full").count() == 4
    assert sum(PassRun.objects.values_list("bound", flat=True)) == 4


@pytest.mark.django_db(transaction=True)
def test_failed_pass_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 4}), gpu_obj("t1", "g0", "h100", "vm")])

    def broken_write(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("database went away half way")

    monkeypatch.setattr(passes, "write_result", broken_write)
    with pytest.raises(RuntimeError):
        passes.run_pass(PassKind.FULL)
    assert PassRun.objects.count() == 0
    from binder.models import GpuDevice

    assert GpuDevice.objects.get(name="g0").phase == "Pending"
    assert transaction.get_autocommit()

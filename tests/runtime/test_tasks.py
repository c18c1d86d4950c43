"""Asking for passes: after commit, once per transaction, never lost to a rollback."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from binder import models
from binder.mirror.snapshot import load_objects
from binder.queue import queue_full_pass
from harness.shapes import H100, class_obj, gpu_obj, node_obj


@pytest.mark.django_db(transaction=True)
def test_many_requests_in_one_transaction_run_one_pass_after_commit() -> None:
    with transaction.atomic():
        for _ in range(5):
            queue_full_pass()
        assert models.PassRun.objects.count() == 0  # nothing runs before commit
    assert models.PassRun.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_request_does_not_block_later_ones() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        queue_full_pass()
        raise RuntimeError("request failed")
    assert models.PassRun.objects.count() == 0
    with transaction.atomic():
        queue_full_pass()
    assert models.PassRun.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_mirror_changes_queue_a_full_pass_that_places_devices(settings: Any) -> None:
    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 2}), gpu_obj("t1", "g0", "h100", "vm")])
    assert models.PassRun.objects.count() == 0
    settings.GPUPLANE_AUTO_PASS = True
    node = models.Node.objects.get(name="n1")
    node.labels = {**node.labels, "pool": "a"}
    node.save()
    assert models.PassRun.objects.count() == 1
    assert models.GpuDevice.objects.get(name="g0").phase == "Bound"

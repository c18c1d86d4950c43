"""Asking for passes: after commit, once per transaction, never lost to a rollback."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from django.db import transaction

from binder import models
from binder.mirror.snapshot import load_objects
from binder.mirror.write import mirror_objects
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


@pytest.mark.django_db(transaction=True)
def test_the_webhooks_admitted_stamp_alone_queues_no_pass(settings: Any) -> None:
    """The sync mirrors every Bound VMI start's ``gpuplane.io/admitted`` write; that stamp only makes
    the set less movable, so it asks for no full pass (one per VM start otherwise). Any other
    change of the same GPU still does."""
    bound = gpu_obj("t1", "g0", "h100", "vm", phase="Bound", node="n1")
    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 2}), bound])
    settings.GPUPLANE_AUTO_PASS = True
    stamped = copy.deepcopy(bound)
    stamped["metadata"]["annotations"]["gpuplane.io/admitted"] = "2026-11-29T11:00:00Z"
    stamped["metadata"]["resourceVersion"] = "7"
    mirror_objects("GPU", [stamped])
    row = models.GpuDevice.objects.get(name="g0")
    assert row.admitted is not None and row.resource_version == "7"  # mirrored all the same
    assert models.PassRun.objects.count() == 0
    changed = copy.deepcopy(stamped)
    changed["metadata"]["annotations"]["gpuplane.io/keep-node"] = "true"
    changed["metadata"]["resourceVersion"] = "8"
    mirror_objects("GPU", [changed])
    assert models.PassRun.objects.count() == 1

"""The sync's watch, batched, against the real kube-apiserver.

The stream is read on a thread of its own while the sync mirrors, so the events that arrive
while one batch is being written go into the next, one transaction for all of them
(``binder.sync.WatchStream``, ``KindSync.apply_events``). These tests hold the sync's
consumer on its first batch while the cluster changes, so what piles up behind it is known,
then check that it lands as one batch and that each object ends as its last event says:
created, deleted and created again, created and deleted. And that an event whose row a pass
holds is set aside without holding up the rest of its batch (PostgreSQL: SQLite has no row
locks), then applied, newest first, once the row is free.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from binder import models, sync
from binder.kube import client as kube_client
from harness.cluster_mode import GPUS, RowHolder, cluster_gpus, wait_for
from harness.controlplane import ControlPlane
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj


def rows() -> dict[str, tuple[str, str, str]]:
    """name -> (vmName, bind request, resourceVersion) of the mirrored GPUs."""
    return {
        name: (vm, request, version)
        for name, vm, request, version in models.GpuDevice.objects.values_list(
            "name", "vm_name", "bind_request", "resource_version"
        )
    }


def annotate(server: ControlPlane, name: str, request: str) -> None:
    server.request(
        "PATCH",
        f"{GPUS}/namespaces/t1/gpus/{name}",
        {"metadata": {"annotations": {"gpuplane.io/bind-request": request}}},
    )


class HeldConsumer:
    """A ``KindSync`` whose first batch waits for :meth:`release`: what the watch delivers
    meanwhile piles up in its stream, and the batches it applies are recorded."""

    def __init__(self, runner: sync.KindSync, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.first: Sequence[sync.Event] = ()
        self.streams: list[sync.WatchStream] = []
        self._go = threading.Event()
        apply_events = runner.apply_events
        stream_class = sync.WatchStream

        def recorded_stream(*args: Any) -> sync.WatchStream:
            stream = stream_class(*args)
            self.streams.append(stream)
            return stream

        def held(events: Sequence[sync.Event]) -> None:
            self.sizes.append(len(events))
            self.first = self.first or events
            self._go.wait(60)
            apply_events(events)

        monkeypatch.setattr(sync, "WatchStream", recorded_stream)
        monkeypatch.setattr(runner, "apply_events", held)

    def release(self) -> int:
        """Let the consumer go on; the events waiting behind its first batch."""
        waiting = self.streams[-1].backlog
        self._go.set()
        return waiting


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_events_is_mirrored_as_one_batch_each_object_as_its_last_event_says(
    apiserver: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    apiserver.seed(
        namespace_obj("t1"), node_obj("n1", {H100: 8}), class_obj("h100", H100), gpu_obj("t1", "first", "h100", "vm0")
    )
    stop = threading.Event()
    runner = sync.KindSync("GPU", stop, relist_seconds=300, watch_seconds=30)
    runner.relist()
    consumer = HeldConsumer(runner, monkeypatch)
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        annotate(apiserver, "first", "r1")  # an event for the first batch, which then waits
        wait_for(lambda: len(consumer.sizes) == 1, what="the first batch")
        apiserver.seed(*(gpu_obj("t1", f"g{i}", "h100", f"vm{i}") for i in range(12)))
        apiserver.request("DELETE", f"{GPUS}/namespaces/t1/gpus/g5")
        apiserver.seed(gpu_obj("t1", "g5", "h100", "other"))  # the same name, a new object
        apiserver.seed(gpu_obj("t1", "brief", "h100", "vm-brief"))
        apiserver.request("DELETE", f"{GPUS}/namespaces/t1/gpus/brief")
        burst = 12 + 2 + 2  # created; g5 deleted and created again; brief created and deleted
        # The first batch is the finalizer's event for "first", with the annotation's or without.
        annotated = any(obj["metadata"].get("annotations") for _, obj, _ in consumer.first)
        behind = burst + (0 if annotated else 1)
        wait_for(lambda: consumer.streams[-1].backlog == behind, what="the burst behind the first batch")
        waiting = consumer.release()
        expected = {"first", *(f"g{i}" for i in range(12))}
        wait_for(lambda: set(rows()) == expected, what="the burst mirrored")
        # Every GPU gets gpuplane's finalizer (written several at once after the batch), and
        # each row ends at its object's version: the finalizers' own events applied in turn.
        wait_for(
            lambda: all(
                kube_client.FINALIZER in g["metadata"].get("finalizers", []) for g in cluster_gpus(apiserver).values()
            ),
            what="the finalizers",
        )
        wait_for(
            lambda: (
                {n: v for n, (_, _, v) in rows().items()}
                == {n: g["metadata"]["resourceVersion"] for (_, n), g in cluster_gpus(apiserver).items()}
            ),
            what="every row at its object's version",
        )
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
    # Everything that waited went in as one batch: one transaction, one status update.
    assert consumer.sizes[1] == waiting, consumer.sizes
    assert rows()["g5"][0] == "other", "g5 is the object created last, not the one deleted"
    assert rows()["first"][1] == "r1"
    status = models.SyncStatus.objects.get(kind="GPU")
    assert status.events >= 1 + burst and status.lag_seconds is not None
    assert status.resource_version == max(
        (g["metadata"]["resourceVersion"] for g in cluster_gpus(apiserver).values()), key=int
    )


@pytest.mark.django_db(transaction=True)
def test_an_event_whose_row_a_pass_holds_waits_aside_and_the_rest_of_its_batch_lands(
    apiserver: ControlPlane, postgres_only: None
) -> None:
    apiserver.seed(
        namespace_obj("t1"),
        node_obj("n1", {H100: 8}),
        class_obj("h100", H100),
        *(gpu_obj("t1", f"g{i}", "h100", f"vm{i}") for i in range(2)),
    )
    stop = threading.Event()
    runner = sync.KindSync("GPU", stop, relist_seconds=300, watch_seconds=30)
    runner.relist()
    holder = RowHolder("g1")  # as a pass holds a device's row while it writes its status
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        annotate(apiserver, "g1", "r1")
        annotate(apiserver, "g0", "r1")
        wait_for(lambda: rows()["g0"][1] == "r1", what="g0's event, behind g1's held row")
        annotate(apiserver, "g1", "r2")  # a later event of the object set aside waits behind it
        annotate(apiserver, "g0", "r2")
        wait_for(lambda: rows()["g0"][1] == "r2", what="g0's second event")
        assert rows()["g1"][1] == "", "g1's event went past the transaction holding its row"
        holder.stop()
        cluster = cluster_gpus(apiserver)[("t1", "g1")]
        wait_for(lambda: rows()["g1"][1] == "r2", what="g1's events, once its row is free")
        wait_for(lambda: rows()["g1"][2] == cluster_gpus(apiserver)[("t1", "g1")]["metadata"]["resourceVersion"])
        assert cluster["metadata"]["annotations"]["gpuplane.io/bind-request"] == "r2"
    finally:
        holder.stop()
        stop.set()
        thread.join(15)
    assert not thread.is_alive()

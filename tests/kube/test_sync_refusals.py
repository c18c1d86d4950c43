"""The sync meets a permanent refusal of one write: the rest of the cluster is still mirrored.

Adding gpuplane's finalizer is the sync's only write. A transient refusal (409, 5xx) waits
for the object's next event; a permanent one (403 when the ClusterRole lacks ``patch``,
422) is classified by ``binder.errors``, logged and counted on the kind's ``SyncStatus``,
and never fails the list it happened in, or every relist would fail the same way and the
kind would stop being mirrored.
"""

from __future__ import annotations

import pytest

from binder import models, sync
from binder.kube import client as kube_client
from harness.cluster_mode import cluster_gpus, seed_cluster
from harness.controlplane import ControlPlane
from harness.faults import Kind


@pytest.mark.django_db(transaction=True)
def test_a_finalizer_the_api_server_forbids_is_counted_and_the_list_goes_on(apiserver: ControlPlane) -> None:
    seed_cluster(apiserver)

    def forbid_gpu_patches(verb: str, kind: Kind, namespace: str, target: str) -> int | None:
        return 403 if (verb, kind.plural, target) == ("patch", "gpus", "vm1-gpu0") else None

    apiserver.faults.decide = forbid_gpu_patches
    applied = sync.sync_once()  # raised the 403 out of the GPU list before

    assert applied["GPU"].upserted == 4
    assert models.GpuDevice.objects.count() == 4
    status = models.SyncStatus.objects.get(kind="GPU")
    assert status.errors == 1
    assert "finalizer on t1/vm1-gpu0" in status.last_error and "403" in status.last_error
    gpus = cluster_gpus(apiserver)
    assert kube_client.FINALIZER not in (gpus[("t1", "vm1-gpu0")]["metadata"].get("finalizers") or [])
    assert kube_client.FINALIZER in gpus[("t1", "vm1-gpu1")]["metadata"]["finalizers"]


@pytest.mark.django_db(transaction=True)
def test_a_transient_refusal_waits_for_the_next_event_uncounted(apiserver: ControlPlane) -> None:
    seed_cluster(apiserver)
    apiserver.faults.decide = lambda verb, kind, namespace, target: 503 if kind.plural == "gpus" else None
    sync.sync_once()
    assert models.GpuDevice.objects.count() == 4
    assert models.SyncStatus.objects.get(kind="GPU").errors == 0

"""deploy/'s finalizer policy on a real apiserver: gpuplane's finalizer from the create on.

Without the policy the sync adds ``gpuplane.io/release`` to every GPU and GPUClass with a
PATCH of its own (tests/kube/test_sync_refusals.py refuses that PATCH); with it, the
apiserver stores each object with the finalizer already on (a MutatingAdmissionPolicy runs
CEL inside the apiserver: no webhook call, no second write), and the sync has nothing to add.
"""

from __future__ import annotations

import pytest

from binder import models, sync
from binder.kube.client import FINALIZER
from harness.cluster_mode import seed_cluster
from harness.controlplane import ControlPlane
from harness.shapes import gpu_obj, namespace_obj


def finalizer_patches(plane: ControlPlane) -> list[str]:
    """The patches of GPUs and classes (not their status) since the last ``mark_calls``."""
    return [
        f"{c.resource} {c.namespace}/{c.name}"
        for c in plane.calls()
        if c.verb == "patch" and c.group == "gpuplane.io" and c.resource in ("gpus", "gpuclasses")
    ]


@pytest.mark.django_db(transaction=True)
def test_with_the_policy_objects_are_created_with_the_finalizer_and_the_sync_writes_none(
    apiserver: ControlPlane,
) -> None:
    apiserver.seed(namespace_obj("t0"))
    with apiserver.finalizer_policy("t0"):
        seed_cluster(apiserver)
        apiserver.mark_calls()
        applied = sync.sync_once()
        patches = finalizer_patches(apiserver)
        # Another controller's finalizer is kept beside gpuplane's; one already there is not doubled.
        other = gpu_obj("t0", "with-other", "h100", "vm-o")
        other["metadata"]["finalizers"] = ["example.com/keep"]
        mine = gpu_obj("t0", "with-mine", "h100", "vm-m")
        mine["metadata"]["finalizers"] = [FINALIZER]
        stored_other, stored_mine = apiserver.seed(other, mine)

    assert applied["GPU"].upserted == 4 and models.GpuDevice.objects.count() == 4
    assert patches == [], "the sync added a finalizer the policy had put on already"
    gpus = apiserver.request("GET", "/apis/gpuplane.io/v1alpha1/gpus")["items"]
    classes = apiserver.request("GET", "/apis/gpuplane.io/v1alpha1/gpuclasses")["items"]
    assert {g["metadata"]["name"] for g in gpus} >= {"vm1-gpu0", "vm1-gpu1", "vm9-gpu0", "vm9-gpu1"}
    for obj in gpus + classes:
        assert obj["metadata"].get("finalizers", []).count(FINALIZER) == 1, obj["metadata"]["name"]
    assert stored_other["metadata"]["finalizers"] == ["example.com/keep", FINALIZER]
    assert stored_mine["metadata"]["finalizers"] == [FINALIZER]


@pytest.mark.django_db(transaction=True)
def test_without_the_policy_the_sync_adds_the_finalizer_with_a_patch_per_object(apiserver: ControlPlane) -> None:
    """The other side of the test above, on the same cluster: what the policy saves."""
    seed_cluster(apiserver)
    apiserver.mark_calls()
    sync.sync_once()
    assert sorted(finalizer_patches(apiserver)) == [
        "gpuclasses /a10",
        "gpuclasses /h100",
        "gpus t1/vm1-gpu0",
        "gpus t1/vm1-gpu1",
        "gpus t2/vm9-gpu0",
        "gpus t2/vm9-gpu1",
    ]

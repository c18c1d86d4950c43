"""``sync_cluster`` against a cluster that does not serve a kind it mirrors: the error names the
API and what to install, instead of "cannot list the cluster: HTTP 404 Not Found".

The real apiserver answers the list; the VMI kind is pointed at a version of kubevirt.io this
apiserver does not serve (as a cluster without KubeVirt serves none of it), so the 404 is the
apiserver's own.
"""

from __future__ import annotations

import dataclasses

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from binder.kube import client as kube_client
from harness.controlplane import ControlPlane

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_a_cluster_without_kubevirt_is_named(apiserver: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    served = kube_client.RESOURCES["VirtualMachineInstance"]
    monkeypatch.setitem(kube_client.RESOURCES, "VirtualMachineInstance", dataclasses.replace(served, version="v9"))
    with pytest.raises(CommandError) as refused:
        call_command("sync_cluster", "--once", "--no-progress")
    assert str(refused.value) == (
        "cannot list the cluster: kubevirt.io/v9 virtualmachineinstances is not served (HTTP 404): install KubeVirt"
    )


def test_a_cluster_without_gpuplanes_crds_is_named(apiserver: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    served = kube_client.RESOURCES["GPU"]
    monkeypatch.setitem(kube_client.RESOURCES, "GPU", dataclasses.replace(served, version="v9"))
    with pytest.raises(CommandError) as refused:
        call_command("sync_cluster", "--once", "--no-progress")
    assert "gpuplane.io/v9 gpus is not served (HTTP 404): install gpuplane's CRDs" in str(refused.value)


def test_a_cluster_without_virtual_machines_syncs_the_rest_and_mirrors_none(
    apiserver: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VirtualMachines are optional (making room reads them): a cluster that does not serve the
    kind is synced as one without any, and nothing is movable."""
    from binder import models

    served = kube_client.RESOURCES["VirtualMachine"]
    assert served.optional
    monkeypatch.setitem(kube_client.RESOURCES, "VirtualMachine", dataclasses.replace(served, version="v9"))
    call_command("sync_cluster", "--once", "--no-progress")
    assert not models.VirtualMachine.objects.exists()
    assert models.SyncStatus.objects.get(kind="VirtualMachine").listed == 0

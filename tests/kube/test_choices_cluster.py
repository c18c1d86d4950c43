"""Cluster mode: an order placed on its second choice is written back to the API server with
``status.className``, and the mirror reads the held class back from the object."""

from __future__ import annotations

from typing import Any

import pytest

from binder import models, sync
from binder.runtime.passes import run_pass
from harness.cluster_mode import cluster_gpus
from harness.controlplane import ControlPlane
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj

A100 = "nvidia.com/GA100_A100_SXM4_80GB"


def order(name: str) -> dict[str, Any]:
    obj = gpu_obj("t1", name, "h100", "vm1")
    obj["spec"]["alternativeClassNames"] = ["a100"]
    return obj


@pytest.mark.django_db
def test_status_writes_carry_the_held_class(apiserver: ControlPlane) -> None:
    apiserver.seed(
        namespace_obj("t1"),
        node_obj("nh", {H100: 1}),
        node_obj("na", {A100: 4}),
        class_obj("h100", H100),
        class_obj("a100", A100),
        order("vm1-gpu0"),
        order("vm1-gpu1"),
    )
    sync.sync_once()
    run = run_pass("full")
    assert run.devices_written == 2 and run.writes_failed == 0
    for g in cluster_gpus(apiserver).values():
        assert (g["status"]["phase"], g["status"]["node"], g["status"]["className"]) == ("Bound", "na", "a100")
        assert g["spec"]["alternativeClassNames"] == ["a100"]
        assert "as a100 (passed over h100" in g["status"]["reason"]
    rows = models.GpuDevice.objects.values_list("class_name", "status_class_name", "alternative_class_names")
    assert set(map(lambda r: (r[0], r[1], tuple(r[2])), rows)) == {("h100", "a100", ("a100",))}
    # The next pass reads the held class from what it wrote: nothing to write again.
    sync.sync_once()
    again = run_pass("full")
    assert (again.devices_written, again.writes_failed) == (0, 0)

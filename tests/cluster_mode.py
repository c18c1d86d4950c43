"""Cluster mode in tests: the GPUs as the API server emulator holds them, and the mirror's
view of the same devices (shared by tests/test_cluster.py and tests/test_faults.py; the
``apiserver`` fixture that points gpuplane at the emulator is in tests/conftest.py)."""

from __future__ import annotations

from typing import Any

from binder import models
from tests.kube_emulator import RunningApiServer

GPUS = "/apis/gpuplane.io/v1alpha1"


def cluster_gpus(server: RunningApiServer) -> dict[tuple[str, str], dict[str, Any]]:
    """Every GPU object in the emulator by (namespace, name)."""
    items = server.request("GET", f"{GPUS}/gpus")["items"]
    return {(g["metadata"]["namespace"], g["metadata"]["name"]): g for g in items}


def mirrored_devices() -> dict[tuple[str, str], tuple[str, str]]:
    """Every mirrored device by (namespace, name): (phase, node)."""
    return {
        (ns, name): (phase, node)
        for ns, name, phase, node in models.GpuDevice.objects.values_list("namespace__name", "name", "phase", "node")
    }

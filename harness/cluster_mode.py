"""Cluster mode in tests: the GPUs as the real kube-apiserver holds them, and the mirror's
view of the same devices (shared by tests/kube/test_cluster.py and tests/system/test_faults.py; the
``apiserver`` fixture that points gpuplane at the test control plane is in tests/conftest.py,
the control plane itself in harness/controlplane/)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction

from binder import models, sync
from harness.controlplane import UNION_USER, ControlPlane
from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    vmi_obj,
)

GPUS = "/apis/gpuplane.io/v1alpha1"


def cluster_gpus(server: ControlPlane) -> dict[tuple[str, str], dict[str, Any]]:
    """Every GPU object in the cluster by (namespace, name)."""
    items = server.request("GET", f"{GPUS}/gpus")["items"]
    return {(g["metadata"]["namespace"], g["metadata"]["name"]): g for g in items}


def mirrored_devices() -> dict[tuple[str, str], tuple[str, str]]:
    """Every mirrored device by (namespace, name): (phase, node)."""
    return {
        (ns, name): (phase, node)
        for ns, name, phase, node in models.GpuDevice.objects.values_list("namespace__name", "name", "phase", "node")
    }


def seed_cluster(server: ControlPlane) -> None:
    """Two tenants: t1's vm1 (2 h100 Bound on n1) with its launcher and a pod forging a
    launcher's owner; an order of 2 a10 in t2; a budget; three nodes.

    No virt-controller runs on this control plane, so nothing writes the VMI's
    ``status.activePods`` and neither pod is the VMI's launcher: both count as raw usage,
    as a launcher does in the moment before virt-controller lists it. Tests of what the
    real writer lists run on the VM cluster (tests/kube/test_vm_life.py)."""
    server.seed(
        namespace_obj("t1"),
        namespace_obj("t2"),
        node_obj("n1", {H100: 8}),
        node_obj("n2", {A10: 4}),
        node_obj("n3", {H100: 8}),
        class_obj("h100", H100),
        class_obj("a10", A10),
        budget_obj("t1", {"h100": 4}),
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1", phase="Bound", node="n1"),
        gpu_obj("t1", "vm1-gpu1", "h100", "vm1", phase="Bound", node="n1"),
        gpu_obj("t2", "vm9-gpu0", "a10", "vm9"),
        gpu_obj("t2", "vm9-gpu1", "a10", "vm9"),
        plain_pod_obj("t2", "trainer", A10, 1, "n2"),
    )
    # As KubeVirt does it: the VMI first, then its launcher pod owned by the VMI's real uid (a
    # pod whose owner does not exist would be deleted by the garbage collector). The forger
    # copies the owner reference.
    (vmi,) = server.seed(vmi_obj("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"], {}, "n1"))
    server.seed(launcher_obj(vmi, H100, 2, "n1", name="virt-launcher-vm1-real1"))
    server.seed(launcher_obj(vmi, H100, 3, "n1", name="virt-launcher-vm1-fake1"))


class Follower:
    """The sync of some kinds, driven step by step: list once, then apply what the watch
    delivers for a moment (``follow``), as ``sync_cluster``'s threads do continuously."""

    def __init__(self, *kinds: str) -> None:
        stop = threading.Event()
        self.runners = [sync.KindSync(kind, stop, relist_seconds=300, watch_seconds=1) for kind in kinds]
        for runner in self.runners:
            runner.relist()

    def follow(self, seconds: float = 1.0, kinds: tuple[str, ...] | None = None) -> None:
        """Apply every event the watch delivers within ``seconds`` (per kind; ``kinds``:
        only those, when the test changes nothing else: each kind's watch lasts at least
        the API's one-second minimum, so following idle kinds is only waiting)."""
        for runner in self.runners:
            if kinds is None or runner.kind in kinds:
                runner.watch_until(time.monotonic() + seconds)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Until ``condition()`` holds; an AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or condition}")


def gpu_lists(server: ControlPlane) -> int:
    """How many LISTs of GPUs gpuplane has made (the test's own reads not counted)."""
    return sum(1 for call in server.calls(UNION_USER) if call.resource == "gpus" and call.verb == "list")


class RowHolder:
    """A transaction holding one device's row until :meth:`stop`, as a pass does while it writes
    its statuses, or the sync's batch while it mirrors."""

    def __init__(self, name: str) -> None:
        self.locked, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(name,))
        self.thread.start()
        assert self.locked.wait(10)

    def _hold(self, name: str) -> None:
        try:
            with transaction.atomic():
                models.GpuDevice.objects.select_for_update().get(name=name)
                self.locked.set()
                self.release.wait(60)
        finally:
            connection.close()

    def stop(self) -> None:
        self.release.set()
        self.thread.join(10)

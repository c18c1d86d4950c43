"""Cluster mode against an API server: sync, fresh reads, status writes, finalizers.

gpuplane talks to ``tests.kube_emulator.ApiServer`` (kmock's Kubernetes emulator,
extended where the real kube-apiserver behaves differently: uid and resourceVersion
on writes, 409 on stale versions, the status subresource, 410 Gone, finalizers,
namespace deletion) through the official ``kubernetes`` client over real HTTP.
Cluster objects are built from the real captures (``tests.shapes``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from binder import models, sync
from binder.kube import client as kube_client
from binder.runtime.passes import run_pass
from tests.cluster_mode import GPUS, cluster_gpus, mirrored_devices, seed_cluster
from tests.factories import new_vmi, review
from tests.kube_emulator import RunningApiServer
from tests.manifests import of_kind, overlay
from tests.shapes import (
    H100,
    class_obj,
    gpu_obj,
    namespace_obj,
    node_obj,
)
from tests.webhook_calls import allowed_patch, denied, post
from usage.models import UsageRecord


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or condition}")


# -- sync -------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_sync_mirrors_the_cluster_and_follows_adds_changes_deletes(apiserver: RunningApiServer, settings: Any) -> None:
    seed_cluster(apiserver)
    stop = threading.Event()
    threads = sync.run_forever(stop, relist_seconds=300, watch_seconds=2)
    try:
        wait_for(
            lambda: models.SyncStatus.objects.filter(relists__gte=1).count() == len(sync.SYNC_ORDER),
            what="first list of every kind",
        )
        assert len(mirrored_devices()) == 4 and models.Pod.objects.count() == 3
        assert mirrored_devices()[("t1", "vm1-gpu0")] == ("Bound", "n1")
        assert set(models.Node.objects.values_list("name", flat=True)) == {"n1", "n2", "n3"}
        assert models.GpuBudget.objects.get(namespace__name="t1").limits == {"h100": 4}
        vmi = models.VirtualMachineInstance.objects.get(name="vm1")
        real_uid = models.Pod.objects.get(name="virt-launcher-vm1-real1").uid
        assert vmi.active_pods == {real_uid: "n1"}
        # gpuplane's finalizer went on every GPU and class (SPEC §6).
        wait_for(
            lambda: all(
                kube_client.FINALIZER in (g["metadata"].get("finalizers") or [])
                for g in cluster_gpus(apiserver).values()
            ),
            what="finalizers on GPUs",
        )
        wait_for(
            lambda: all(
                c["metadata"].get("finalizers") == [kube_client.FINALIZER]
                for c in apiserver.request("GET", f"{GPUS}/gpuclasses")["items"]
            ),
            what=f"finalizers on classes {apiserver.request('GET', f'{GPUS}/gpuclasses')['items']}",
        )

        # Add, change, delete: the mirror follows the watch.
        apiserver.seed(gpu_obj("t2", "vm9-gpu2", "a10", "vm9"))
        apiserver.request("PATCH", "/api/v1/nodes/n3", {"metadata": {"labels": {"gpuplane.io/drain": "true"}}})
        apiserver.request("DELETE", "/api/v1/namespaces/t2/pods/trainer")
        wait_for(lambda: ("t2", "vm9-gpu2") in mirrored_devices(), what="added GPU")
        wait_for(lambda: models.Node.objects.get(name="n3").labels.get("gpuplane.io/drain") == "true", what="label")
        wait_for(lambda: not models.Pod.objects.filter(name="trainer").exists(), what="deleted pod")
        status = {s.kind: s for s in models.SyncStatus.objects.all()}
        assert set(status) == set(sync.SYNC_ORDER)
        assert status["GPU"].events >= 1 and status["GPU"].lag_seconds is not None
        assert status["Node"].resource_version == str(int(status["Node"].resource_version))
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.django_db(transaction=True)
def test_410_gone_leads_to_a_relist_without_losing_or_duplicating(apiserver: RunningApiServer) -> None:
    apiserver.seed(namespace_obj("t1"), *(gpu_obj("t1", f"g{i}", "h100", f"vm{i}") for i in range(3)))
    stop = threading.Event()
    runner = sync.KindSync("GPU", stop, relist_seconds=300, watch_seconds=1)
    runner.relist()
    listed_at = runner.resource_version
    # Changes the watch would have to replay, then compaction: that version is gone.
    apiserver.seed(gpu_obj("t1", "g3", "h100", "vm3"))
    apiserver.request("DELETE", f"{GPUS}/namespaces/t1/gpus/g0")
    apiserver.server.compact()
    apiserver.seed(gpu_obj("t1", "g4", "h100", "vm4"))
    assert runner.resource_version == listed_at
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        wait_for(lambda: models.SyncStatus.objects.filter(kind="GPU", gone__gte=1).exists(), what="a 410")
        wanted = {("t1", n) for n in ("g1", "g2", "g3", "g4")}
        wait_for(lambda: set(mirrored_devices()) == wanted, what="mirror after relist")
        names = Counter(models.GpuDevice.objects.values_list("name", flat=True))
        assert max(names.values()) == 1
        # The relist's own status row is written just after its mirror rows.
        wait_for(lambda: models.SyncStatus.objects.get(kind="GPU").relists >= 2, what="the relist counted")
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.django_db
def test_sync_once_skips_an_invalid_object_and_keeps_the_rest(apiserver: RunningApiServer) -> None:
    apiserver.seed(namespace_obj("t1"), gpu_obj("t1", "good", "h100", "vm1"))
    bad = gpu_obj("t1", "bad", "h100", "vm1")
    del bad["spec"]["vmName"]  # a real API server with the CRD schema would refuse it; sync must survive it
    apiserver.seed(bad)
    applied = sync.sync_once()
    assert applied["GPU"].invalid == 1
    assert set(mirrored_devices()) == {("t1", "good")}


# -- binder in cluster mode -------------------------------------------------------------------


def whole_and_within_capacity(server: RunningApiServer) -> tuple[bool, dict[str, int]]:
    """Every set on one phase and node, and booked units per node from the cluster's own objects."""
    gpus = cluster_gpus(server).values()
    sets: dict[tuple[str, str], set[tuple[str, str]]] = {}
    booked: Counter[str] = Counter()
    for g in gpus:
        status = g.get("status") or {}
        phase, node = status.get("phase", "Pending"), status.get("node") or ""
        sets.setdefault((g["metadata"]["namespace"], g["spec"]["vmName"]), set()).add((phase, node))
        if phase == "Bound":
            booked[node] += 1
    return all(len(states) == 1 for states in sets.values()), dict(booked)


@pytest.mark.django_db
def test_every_third_status_write_fails_and_later_passes_make_every_set_whole(apiserver: RunningApiServer) -> None:
    apiserver.seed(
        namespace_obj("t1"),
        node_obj("n1", {H100: 4}),
        node_obj("n2", {H100: 4}),
        class_obj("h100", H100),
        *(gpu_obj("t1", f"vm{v}-gpu{i}", "h100", f"vm{v}", created=f"2026-11-2{v}T10:00:00Z")
          for v in range(4) for i in range(2)),
    )  # fmt: skip
    sync.sync_once()
    writes = Counter[str]()

    def every_third(verb: str, kind: Any, ns: str, target: str) -> int | None:
        if not target.endswith("/status") or kind.plural != "gpus":
            return None
        writes["n"] += 1
        return (409 if writes["n"] % 2 else 500) if writes["n"] % 3 == 0 else None

    apiserver.server.fail_writes = every_third
    failed = []
    for _ in range(8):
        run = run_pass("full")
        failed.append(run.writes_failed)
        whole, booked = whole_and_within_capacity(apiserver)
        assert all(units <= 4 for units in booked.values()), booked  # never over-booked, even half-written
        if run.devices_written == 0 and run.writes_failed == 0:
            break
    assert failed[0] > 0  # faults really happened
    whole, booked = whole_and_within_capacity(apiserver)
    assert whole
    assert booked == {"n1": 4, "n2": 4}
    # The mirror says what the cluster says, and decisions only for writes that happened.
    for (ns, name), g in cluster_gpus(apiserver).items():
        assert mirrored_devices()[(ns, name)] == (g["status"]["phase"], g["status"].get("node") or "")
    assert models.Decision.objects.filter(to_phase="Bound").count() == 8


@pytest.mark.django_db
def test_a_pass_reads_devices_fresh_not_from_a_stale_mirror(apiserver: RunningApiServer) -> None:
    apiserver.seed(namespace_obj("t1"), node_obj("n1", {H100: 2}), class_obj("h100", H100))
    apiserver.seed(gpu_obj("t1", "a-gpu0", "h100", "a", phase="Bound", node="n1"))
    apiserver.seed(gpu_obj("t1", "a-gpu1", "h100", "a", phase="Bound", node="n1"))
    sync.sync_once()
    # Someone else's write the sync has not seen: the mirror still says Pending.
    apiserver.seed(gpu_obj("t1", "b-gpu0", "h100", "b"))
    models.GpuDevice.objects.filter(name="a-gpu0").update(phase="Pending", node="")  # a stale mirror row
    run_pass("full")
    gpus = cluster_gpus(apiserver)
    assert gpus[("t1", "b-gpu0")]["status"]["phase"] == "Pending"  # n1 is full: a's units were read fresh
    assert "no Ready, schedulable node" in gpus[("t1", "b-gpu0")]["status"]["reason"]
    assert mirrored_devices()[("t1", "a-gpu0")] == ("Bound", "n1")


@pytest.mark.django_db
@pytest.mark.parametrize("enabled", [False, True])
def test_namespace_deletion_completes_and_closes_usage_records(
    apiserver: RunningApiServer, settings: Any, enabled: bool
) -> None:
    seed_cluster(apiserver)
    sync.sync_once()  # adds the finalizers
    run_pass("full")
    assert UsageRecord.objects.filter(namespace="t1", subject_kind="GPU", end__isnull=True).count() == 2
    settings.GPUPLANE_ENABLED = enabled
    apiserver.request("DELETE", "/api/v1/namespaces/t1")
    # The finalizers hold the GPUs (and so the namespace) until gpuplane releases them.
    ns = apiserver.request("GET", "/api/v1/namespaces/t1")
    assert ns["status"]["phase"] == "Terminating"
    assert {n for _, n in cluster_gpus(apiserver) if _ == "t1"} == {"vm1-gpu0", "vm1-gpu1"}
    # KubeVirt's virt-controller releases its own finalizer on the VMI (no controller here).
    apiserver.request("PATCH", "/apis/kubevirt.io/v1/namespaces/t1/virtualmachineinstances/vm1",
                      {"metadata": {"finalizers": None}})  # fmt: skip
    sync.sync_once()
    run = run_pass("full")
    assert run.finalizers_released == 2
    left = [k for k in apiserver.server.store.objects if k[1] == "t1" or k[2] == "t1"]
    names = [n["metadata"]["name"] for n in apiserver.request("GET", "/api/v1/namespaces")["items"]]
    assert "t1" not in names, left
    assert not UsageRecord.objects.filter(namespace="t1", end__isnull=True).exists()
    assert UsageRecord.objects.filter(namespace="t1", subject_kind="GPU").count() == 2  # closed, kept


@pytest.mark.django_db
def test_class_deletion_releases_its_devices_then_the_class(apiserver: RunningApiServer, settings: Any) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    run_pass("full")
    settings.GPUPLANE_ENABLED = False
    apiserver.request("DELETE", f"{GPUS}/gpuclasses/h100")
    assert apiserver.request("GET", f"{GPUS}/gpuclasses/h100")["metadata"]["deletionTimestamp"]
    run = run_pass("full")
    assert run.finalizers_released == 1
    classes = [c["metadata"]["name"] for c in apiserver.request("GET", f"{GPUS}/gpuclasses")["items"]]
    assert classes == ["a10"]
    assert not UsageRecord.objects.filter(key="h100", end__isnull=True).exists()


@pytest.mark.django_db
def test_usage_records_read_the_vmi_fresh_from_the_api_server(apiserver: RunningApiServer) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    run_pass("full")
    raw = dict(UsageRecord.objects.filter(subject_kind="Pod", end__isnull=True).values_list("subject", "units"))
    assert raw == {"virt-launcher-vm1-fake1": 3, "trainer": 1}  # the forger pays in full; the launcher nothing
    # The VMI ends in the cluster; the mirror has not heard yet. Records read it fresh:
    # the former launcher's GPUs are now raw usage.
    apiserver.request("PATCH", "/apis/kubevirt.io/v1/namespaces/t1/virtualmachineinstances/vm1/status",
                      {"status": {"activePods": None}})  # fmt: skip
    run_pass("full")
    raw = dict(UsageRecord.objects.filter(subject_kind="Pod", end__isnull=True).values_list("subject", "units"))
    assert raw["virt-launcher-vm1-real1"] == 2


@pytest.mark.django_db(transaction=True)
def test_sync_and_passes_settle_the_cluster_and_then_go_quiet(apiserver: RunningApiServer, settings: Any) -> None:
    """Every change queues a pass; the pass's own status writes come back as events but
    change nothing, so the loop settles instead of feeding itself."""
    settings.GPUPLANE_AUTO_PASS = True
    seed_cluster(apiserver)
    stop = threading.Event()
    threads = sync.run_forever(stop, relist_seconds=300, watch_seconds=2)
    try:

        def order_bound() -> bool:
            gpus = cluster_gpus(apiserver)
            return all((gpus[("t2", f"vm9-gpu{i}")].get("status") or {}).get("phase") == "Bound" for i in (0, 1))

        wait_for(order_bound, what="the order bound by passes the sync queued")
        seen = {"count": -1, "since": time.monotonic()}

        def quiet_for_two_seconds() -> bool:
            count = models.PassRun.objects.count()
            if count != seen["count"]:
                seen.update(count=count, since=time.monotonic())
            return time.monotonic() - seen["since"] >= 2.0

        wait_for(quiet_for_two_seconds, what="no new pass for 2 s (a pass feeding the next never stops)")
        assert mirrored_devices()[("t2", "vm9-gpu0")] == ("Bound", "n2")
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


@pytest.mark.django_db
def test_sync_lag_and_counts_are_exported(apiserver: RunningApiServer, client: Any) -> None:
    apiserver.seed(namespace_obj("t1"), gpu_obj("t1", "g0", "h100", "vm0"))
    sync.sync_once()
    models.SyncStatus.objects.filter(kind="GPU").update(lag_seconds=0.25, events=7, gone=1)
    text = client.get("/metrics").content.decode()
    assert 'gpuplane_sync_lag_seconds{kind="GPU"} 0.25' in text
    assert 'gpuplane_sync_events_total{kind="GPU"} 7.0' in text
    assert 'gpuplane_sync_gone_total{kind="GPU"} 1.0' in text
    assert 'gpuplane_sync_listed_objects{kind="GPU"} 1.0' in text


# -- the webhook in cluster mode --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_webhook_writes_the_bind_request_annotation_and_the_answer_comes_back_as_status(
    apiserver: RunningApiServer, client: Any
) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    body = review(new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"]))
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n2"
    gpus = cluster_gpus(apiserver)
    for name in ("vm9-gpu0", "vm9-gpu1"):
        obj = gpus[("t2", name)]
        request = obj["metadata"]["annotations"]["gpuplane.io/bind-request"]
        assert request and obj["status"]["answeredRequest"] == request  # answered through /status
        assert obj["status"]["phase"] == "Bound" and obj["status"]["node"] == "n2"


@pytest.mark.django_db(transaction=True)
def test_webhook_denies_clearly_when_the_api_server_refuses_the_bind_request(
    apiserver: RunningApiServer, client: Any
) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    apiserver.server.fail_writes = lambda verb, kind, ns, target: 503 if kind.plural == "gpus" else None
    body = review(new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"]))
    message = denied(post(client, body), body)
    assert "API server refused the bind request" in message and "try again" in message


# -- RBAC: granted == called ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_rbac_grants_exactly_the_api_calls_the_code_makes(apiserver: RunningApiServer, client: Any) -> None:
    """Drive every cluster code path against the emulator, record each request as the
    (group, resource, verb) the apiserver authorizes, and compare with the union of the
    cluster overlay's ClusterRoles: nothing granted that no code calls, nothing called
    that is not granted."""
    seed_cluster(apiserver)
    apiserver.server.calls.clear()
    sync.sync_once()  # list every kind; finalizers on GPUs and classes
    stop = threading.Event()
    for kind in sync.SYNC_ORDER:  # one short watch of every kind
        runner = sync.KindSync(kind, stop, relist_seconds=1, watch_seconds=1)
        runner.resource_version = str(apiserver.server.store.revision)
        runner.watch_until(time.monotonic() + 1)
    run_pass("full")  # fresh reads, status of devices, classes and budgets, VMIs read fresh
    body = review(new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"]))
    allowed_patch(post(client, body), body)  # the webhook's bind-request annotation
    apiserver.request("DELETE", f"{GPUS}/gpuclasses/a10")  # the operator's call, not gpuplane's
    assert apiserver.server.calls.pop() == (kube_client.GROUP, "gpuclasses", "delete")
    sync.sync_once()
    run_pass("full")  # finalizer release
    called = set(apiserver.server.calls)

    granted = set()
    for role in of_kind(overlay("cluster"), "ClusterRole").values():
        for rule in role["rules"]:
            granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert called - granted == set(), "called without a grant"
    assert granted - called == set(), "granted but never called"

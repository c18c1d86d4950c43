"""Cluster mode against a real kube-apiserver: sync, passes that list nothing, status writes, finalizers.

gpuplane talks to the test control plane (etcd, kube-apiserver and kube-controller-manager
built from pinned modules; harness/controlplane/) through the official ``kubernetes``
client over TLS, authenticated as ``gpuplane-test`` (deploy/'s ClusterRoles, together). The
freshness tests put a proxy in front of the apiserver (harness/faults.py) that holds
back or drops watch events while reads already return the write, and check that a watch
delivering the binder's own writes late, behind a relist taken before them, or never, does
not make a pass book the same units twice; that a real 409 from a concurrent writer leads
to one GET; and, from the apiserver's audit log, that no pass lists GPUs.
Cluster objects are built from the real captures (``harness.shapes``).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import pytest

from binder import apiserver as kube_connection
from binder import models, sync
from binder.actions import NODE_PATCHES
from binder.engine.preview import NodeAction
from binder.kube import client as kube_client
from binder.kube.resources import GROUP
from binder.mirror.write import mirror_event, mirror_list
from binder.runtime import admissions
from binder.runtime.passes import run_pass
from harness.cluster_mode import (
    GPUS,
    Follower,
    cluster_gpus,
    gpu_lists,
    mirrored_devices,
    seed_cluster,
    wait_for,
)
from harness.controlplane import UNION_USER, ControlPlane
from harness.factories import new_vmi, review
from harness.faults import WatchProxy
from harness.shapes import (
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    namespace_obj,
    node_obj,
)
from harness.webhook_calls import allowed_patch, denied, post
from usage.models import UsageRecord

# -- sync -------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_sync_mirrors_the_cluster_and_follows_adds_changes_deletes(apiserver: ControlPlane, settings: Any) -> None:
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
        assert models.VirtualMachineInstance.objects.get(name="vm1").active_pods == {}  # no virt-controller here
        # gpuplane's finalizer went on every GPU and class.
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
        # No kubelet here: a Running pod would stay Terminating until its kubelet confirmed it stopped.
        apiserver.request("DELETE", "/api/v1/namespaces/t2/pods/trainer?gracePeriodSeconds=0")
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
def test_410_gone_leads_to_a_relist_without_losing_or_duplicating(apiserver: ControlPlane) -> None:
    apiserver.seed(namespace_obj("t1"), *(gpu_obj("t1", f"g{i}", "h100", f"vm{i}") for i in range(3)))
    stop = threading.Event()
    runner = sync.KindSync("GPU", stop, relist_seconds=300, watch_seconds=1)
    runner.relist()
    listed_at = runner.resource_version
    # Changes the watch would have to replay, then compaction: that version is gone.
    apiserver.seed(gpu_obj("t1", "g3", "h100", "vm3"))
    apiserver.request("DELETE", f"{GPUS}/namespaces/t1/gpus/g0")
    # etcd compacted (the apiserver does it every 5 minutes), then the apiserver restarted: its
    # watch cache starts at the current revision, so a watch from before is answered 410 Gone.
    apiserver.compact()
    apiserver.restart_apiserver()
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
def test_sync_once_skips_an_invalid_object_and_keeps_the_rest(apiserver: ControlPlane) -> None:
    apiserver.seed(namespace_obj("t1"), gpu_obj("t1", "good", "h100", "vm1"))
    bad = gpu_obj("t1", "bad", "h100", "vm1")
    del bad["spec"]["vmName"]  # today's CRD refuses it; made while an older one was served, the sync survives it
    with apiserver.older_crd("gpus", bad):
        apiserver.seed(bad)
    applied = sync.sync_once()
    assert applied["GPU"].invalid == 1
    assert set(mirrored_devices()) == {("t1", "good")}


# -- binder in cluster mode -------------------------------------------------------------------


def whole_and_within_capacity(server: ControlPlane) -> tuple[bool, dict[str, int]]:
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
def test_every_third_status_write_fails_and_later_passes_make_every_set_whole(apiserver: ControlPlane) -> None:
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

    apiserver.faults.decide = every_third
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


# -- freshness without a LIST: the pass's own writes, late or lost events, 409s ------


def two_unit_cluster(server: ControlPlane, orders: dict[str, int]) -> None:
    """One node with 2 h100 units; each order ``vm -> devices`` a Pending set, oldest first."""
    server.seed(namespace_obj("t1"), node_obj("n1", {H100: 2}), class_obj("h100", H100))
    server.seed(
        *(gpu_obj("t1", f"{vm}-gpu{i}", "h100", vm, created=f"2026-11-2{n}T10:00:00Z")
          for n, (vm, count) in enumerate(orders.items()) for i in range(count)),
    )  # fmt: skip


def phases(server: ControlPlane, vm: str) -> set[tuple[str, str]]:
    """(phase, node) of a set's devices as the cluster holds them."""
    return {
        ((g.get("status") or {}).get("phase", "Pending"), (g.get("status") or {}).get("node") or "")
        for g in cluster_gpus(server).values()
        if g["spec"]["vmName"] == vm
    }


def gpu_status_events(event: Any) -> str | None:
    """The GPU events a status write causes (MODIFIED with a phase): the binder's own writes."""
    return "drop" if event.kind.plural == "gpus" and event.type == "MODIFIED" else None


@pytest.mark.django_db
def test_a_pass_after_its_own_watch_events_were_lost_still_sees_its_booking(
    apiserver: ControlPlane, watch_proxy: WatchProxy
) -> None:
    two_unit_cluster(apiserver, {"a": 2})
    follower = Follower("Namespace", "Node", "GPUClass", "GPUBudget", "GPU")
    watch_proxy.withhold = gpu_status_events  # the watch never brings the binder's writes back
    lists = gpu_lists(apiserver)
    first = run_pass("full")
    assert first.devices_written == 2 and phases(apiserver, "a") == {("Bound", "n1")}
    # The pass mirrored what its writes returned: the row is the object at that version.
    for name in ("a-gpu0", "a-gpu1"):
        row = models.GpuDevice.objects.get(name=name)
        stored = cluster_gpus(apiserver)[("t1", name)]
        assert (row.phase, row.node, row.resource_version) == ("Bound", "n1", stored["metadata"]["resourceVersion"])
    # A new order arrives (its ADDED event is delivered); n1 is full.
    apiserver.seed(gpu_obj("t1", "b-gpu0", "h100", "b", created="2026-11-29T10:00:00Z"))
    follower.follow()
    assert ("t1", "b-gpu0") in mirrored_devices()
    second = run_pass("full")
    assert second.view == "incremental"
    assert phases(apiserver, "b") == {("Pending", "")}
    assert "no Ready, schedulable node" in cluster_gpus(apiserver)[("t1", "b-gpu0")]["status"]["reason"]
    whole, booked = whole_and_within_capacity(apiserver)
    assert whole and booked == {"n1": 2}
    assert gpu_lists(apiserver) == lists, "a pass listed GPUs"


@pytest.mark.django_db
def test_late_watch_events_and_a_relist_older_than_the_row_are_ignored(
    apiserver: ControlPlane, watch_proxy: WatchProxy
) -> None:
    two_unit_cluster(apiserver, {"a": 2, "b": 2})
    follower = Follower("Namespace", "Node", "GPUClass", "GPUBudget", "GPU")
    api = kube_connection.api()
    before = api.list("GPU")  # a relist's snapshot, taken before the pass, applied after it
    held = Counter[str]()

    def hold_gpu_events(event: Any) -> str | None:
        if event.kind.plural != "gpus":
            return None
        held[event.type] += 1
        return "hold"

    watch_proxy.withhold = hold_gpu_events
    run_pass("full")
    follower.follow(1.0, ("GPU",))  # the watch sends the pass's own events: the proxy holds them back
    assert phases(apiserver, "a") == {("Bound", "n1")} and phases(apiserver, "b") == {("Pending", "")}
    mirror_list("GPU", before.items, list_version=before.resource_version)
    assert mirrored_devices()[("t1", "a-gpu0")] == ("Bound", "n1"), "the older list undid the pass's booking"
    # An event older than the row (a copy of the object from before the pass) changes nothing.
    stale = next(g for g in before.items if g["metadata"]["name"] == "a-gpu1")
    assert mirror_event("GPU", "MODIFIED", stale).stale == 1
    assert mirrored_devices()[("t1", "a-gpu1")] == ("Bound", "n1")
    # The held events (the pass's own writes) arrive late, after everything sent since.
    watch_proxy.withhold = None
    assert watch_proxy.release_held() == held["MODIFIED"] > 0
    follower.follow()
    assert mirrored_devices()[("t1", "a-gpu0")] == ("Bound", "n1")
    run_pass("full")
    assert phases(apiserver, "a") == {("Bound", "n1")} and phases(apiserver, "b") == {("Pending", "")}
    whole, booked = whole_and_within_capacity(apiserver)
    assert whole and booked == {"n1": 2}
    # The held events (the sync's finalizer writes and the pass's own) came after the rows had
    # moved on, in one burst with their successors (the watch resumed from the late events'
    # versions and sent those again): every one counted, and in each batch an object's latest
    # event stood for its earlier ones; none was newer than its row, so nothing moved back.
    assert models.SyncStatus.objects.get(kind="GPU").events >= held["MODIFIED"]
    mirrored = dict(models.GpuDevice.objects.values_list("name", "resource_version"))
    assert mirrored == {
        g["metadata"]["name"]: g["metadata"]["resourceVersion"] for g in cluster_gpus(apiserver).values()
    }
    # A deletion is applied whatever the row holds: a DELETED event carries the last version.
    assert mirror_event("GPU", "DELETED", stale).deleted == 1
    assert ("t1", "a-gpu1") not in mirrored_devices()


@pytest.mark.django_db
def test_a_409_gets_that_one_object_and_the_next_pass_writes_against_it(
    apiserver: ControlPlane, watch_proxy: WatchProxy
) -> None:
    two_unit_cluster(apiserver, {"a": 2})
    follower = Follower("Namespace", "Node", "GPUClass", "GPUBudget", "GPU")
    watch_proxy.withhold = lambda event: "hold" if event.kind.plural == "gpus" else None
    # Someone else changes a-gpu0; the watch has not brought it: the row's version is old.
    apiserver.request("PATCH", f"{GPUS}/namespaces/t1/gpus/a-gpu0", {"metadata": {"labels": {"team": "x"}}})
    apiserver.mark_calls()
    first = run_pass("full")
    assert first.writes_failed == 1
    gets = [c for c in [c.rbac for c in apiserver.calls(UNION_USER)] if c == (GROUP, "gpus", "get")]
    assert len(gets) == 1 and gpu_lists(apiserver) == 0
    current = cluster_gpus(apiserver)[("t1", "a-gpu0")]
    assert models.GpuDevice.objects.get(name="a-gpu0").resource_version == current["metadata"]["resourceVersion"]
    assert phases(apiserver, "a") == {("Bound", "n1"), ("Pending", "")}  # half-written
    second = run_pass("full")
    assert second.writes_failed == 0
    assert phases(apiserver, "a") == {("Bound", "n1")}
    assert mirrored_devices()[("t1", "a-gpu0")] == ("Bound", "n1")
    watch_proxy.withhold = None
    watch_proxy.release_held()
    follower.follow()
    assert run_pass("full").devices_written == 0


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize("seed", [1, 2])
def test_a_watch_that_delays_or_loses_the_binders_writes_never_double_books(
    apiserver: ControlPlane, watch_proxy: WatchProxy, seed: int
) -> None:
    """Orders keep arriving on two 2-unit nodes while the watch holds back, drops or
    late-delivers the GPU events at random; after every pass no node holds more than it
    has, and every set is whole (what a double booking would break first)."""
    rng = random.Random(seed)
    apiserver.seed(namespace_obj("t1"), node_obj("n1", {H100: 2}), node_obj("n2", {H100: 2}), class_obj("h100", H100))
    follower = Follower("Namespace", "Node", "GPUClass", "GPUBudget", "GPU")
    watch_proxy.withhold = lambda event: (
        rng.choice(("hold", "drop", None)) if event.kind.plural == "gpus" and event.type == "MODIFIED" else None
    )
    lists = gpu_lists(apiserver)
    # Only GPUs (the orders, the binder's status writes) and classes (their status) change
    # after the first list: the other kinds' watches would deliver nothing.
    changing = ("GPUClass", "GPU")
    for n in range(6):
        vm = f"vm{n}"
        apiserver.seed(*(gpu_obj("t1", f"{vm}-gpu{i}", "h100", vm, created=f"2026-11-2{n}T10:00:00Z")
                         for i in range(rng.choice((1, 2)))))  # fmt: skip
        follower.follow(0.5, changing)
        run_pass("full")
        whole, booked = whole_and_within_capacity(apiserver)
        assert all(units <= 2 for units in booked.values()), booked
        assert whole
        if rng.random() < 0.5:
            watch_proxy.release_held()
    assert gpu_lists(apiserver) == lists
    follower.follow(0.5)  # every kind once more, as the sync would
    run_pass("full")
    _, booked = whole_and_within_capacity(apiserver)
    assert sum(booked.values()) >= 3  # the nodes really filled up


@pytest.mark.django_db
@pytest.mark.parametrize("enabled", [False, True])
def test_namespace_deletion_completes_and_closes_usage_records(
    apiserver: ControlPlane, settings: Any, enabled: bool
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
    # The namespace controller deletes the pods first (the kubelets confirm they stopped), then
    # the rest: the GPUs wait on gpuplane's finalizer.
    assert apiserver.kubelet_stops_pods("t1") == 2
    wait_for(
        lambda: all(
            g["metadata"].get("deletionTimestamp") for (ns, _), g in cluster_gpus(apiserver).items() if ns == "t1"
        ),
        what="the namespace controller deleting t1's GPUs",
    )
    # KubeVirt's virt-controller releases its own finalizer on the VMI (no KubeVirt here).
    apiserver.request("PATCH", "/apis/kubevirt.io/v1/namespaces/t1/virtualmachineinstances/vm1",
                      {"metadata": {"finalizers": None}})  # fmt: skip
    sync.sync_once()
    run = run_pass("full")
    assert run.finalizers_released == 2
    # kube-controller-manager's namespace controller deletes what is left and then the namespace.
    wait_for(
        lambda: "t1" not in {n["metadata"]["name"] for n in apiserver.request("GET", "/api/v1/namespaces")["items"]},
        what="the namespace controller finishing t1's deletion",
    )
    assert not UsageRecord.objects.filter(namespace="t1", end__isnull=True).exists()
    assert UsageRecord.objects.filter(namespace="t1", subject_kind="GPU").count() == 2  # closed, kept


@pytest.mark.django_db
def test_class_deletion_releases_its_devices_then_the_class(apiserver: ControlPlane, settings: Any) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    run_pass("full")
    settings.GPUPLANE_ENABLED = False
    apiserver.request("DELETE", f"{GPUS}/gpuclasses/h100")
    assert apiserver.request("GET", f"{GPUS}/gpuclasses/h100")["metadata"]["deletionTimestamp"]
    sync.sync_once()  # the sync sees the deletion and notes the finalizer; the pass lists nothing
    assert models.FinalizerRelease.objects.filter(kind="GPUClass", name="h100").exists()
    run = run_pass("full")
    assert run.finalizers_released == 1
    classes = [c["metadata"]["name"] for c in apiserver.request("GET", f"{GPUS}/gpuclasses")["items"]]
    assert classes == ["a10"]
    assert not UsageRecord.objects.filter(key="h100", end__isnull=True).exists()
    assert not models.FinalizerRelease.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_sync_and_passes_settle_the_cluster_and_then_go_quiet(apiserver: ControlPlane, settings: Any) -> None:
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
def test_sync_lag_and_counts_are_exported(apiserver: ControlPlane, client: Any) -> None:
    apiserver.seed(namespace_obj("t1"), gpu_obj("t1", "g0", "h100", "vm0"))
    sync.sync_once()
    models.SyncStatus.objects.filter(kind="GPU").update(lag_seconds=0.25, events=7, gone=1, stale=3)
    text = client.get("/metrics").content.decode()
    assert 'gpuplane_sync_lag_seconds{kind="GPU"} 0.25' in text
    assert 'gpuplane_sync_events_total{kind="GPU"} 7.0' in text
    assert 'gpuplane_sync_gone_total{kind="GPU"} 1.0' in text
    assert 'gpuplane_sync_stale_total{kind="GPU"} 3.0' in text
    assert 'gpuplane_sync_listed_objects{kind="GPU"} 1.0' in text


# -- the webhook in cluster mode --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_webhook_writes_the_bind_request_annotation_and_the_answer_comes_back_as_status(
    apiserver: ControlPlane, client: Any
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


def vm9_placed_by_its_bind_request(apiserver: ControlPlane, client: Any) -> None:
    """The seeded cluster, with t2/vm9's set Bound on n2 by its VMI's first admission (a bind
    request, answered) and the answer mirrored."""
    seed_cluster(apiserver)
    sync.sync_once()
    body = review(new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"]))
    allowed_patch(post(client, body), body)
    sync.sync_once()


@pytest.mark.django_db(transaction=True)
def test_a_bound_sets_admission_writes_nothing_to_the_api_and_the_mirror_keeps_its_stamp(
    apiserver: ControlPlane, client: Any
) -> None:
    """The webhook's admitted stamp before a pin is a write of the first member's row only
    (binder/runtime/admissions.py): no apiserver write on a Bound VMI's start. The objects the
    sync mirrors afterwards carry no stamp; the row keeps it, by watch event and by relist."""
    vm9_placed_by_its_bind_request(apiserver, client)
    apiserver.mark_calls()
    again = review(new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"]))
    pinned = allowed_patch(post(client, again), again)
    assert pinned["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n2"
    assert [c for c in apiserver.calls(UNION_USER) if c.verb not in ("get", "list", "watch")] == []
    stamp = models.GpuDevice.objects.get(name="vm9-gpu0").admitted
    assert stamp is not None
    apiserver.request("PATCH", f"{GPUS}/namespaces/t2/gpus/vm9-gpu0", {"metadata": {"labels": {"team": "x"}}})
    changed = apiserver.request("GET", f"{GPUS}/namespaces/t2/gpus/vm9-gpu0")
    mirror_event("GPU", "MODIFIED", changed)
    row = models.GpuDevice.objects.get(name="vm9-gpu0")
    assert (row.admitted, row.resource_version) == (stamp, changed["metadata"]["resourceVersion"])
    apiserver.request("PATCH", f"{GPUS}/namespaces/t2/gpus/vm9-gpu0", {"metadata": {"labels": {"team": "y"}}})
    sync.sync_once()  # a relist
    row = models.GpuDevice.objects.get(name="vm9-gpu0")
    assert row.admitted == stamp and row.resource_version != changed["metadata"]["resourceVersion"]


@pytest.mark.django_db(transaction=True)
def test_a_set_stamped_after_the_pass_read_it_stays_where_it_is_in_cluster_mode(
    apiserver: ControlPlane, client: Any, monkeypatch: Any
) -> None:
    """The pass's end in cluster mode: a drain would take vm9's set off n2, but the webhook
    stamps its first member after the pass's catch-up and before the pass locks the rows (here,
    in the pass's own transaction, as a stamp that committed in between). The pass finds the
    row is not the one it decided from: no member of the set is written, the VMI's pin holds."""
    vm9_placed_by_its_bind_request(apiserver, client)
    apiserver.request("PATCH", "/api/v1/nodes/n2", NODE_PATCHES[NodeAction.DRAIN])
    sync.sync_once()
    locking = admissions.locked_devices

    def stamped_first(object_ids: Any, state: Any, *, skip_locked: bool) -> Any:
        first = models.GpuDevice.objects.get(namespace__name="t2", name="vm9-gpu0")
        decided = state.records["GPU"][first.id]
        assert admissions.admit(decided)
        return locking(object_ids, state, skip_locked=skip_locked)

    monkeypatch.setattr(admissions, "locked_devices", stamped_first)
    apiserver.mark_calls()
    run_pass("full")
    status_writes = [c for c in apiserver.calls(UNION_USER) if c.verb == "patch" and "vm9" in c.name]
    assert status_writes == []
    assert {(d.phase, d.node) for d in models.GpuDevice.objects.filter(vm_name="vm9")} == {("Bound", "n2")}
    monkeypatch.setattr(admissions, "locked_devices", locking)
    run_pass("full")  # decided from the stamped row, with no VMI to keep it: the drain takes it
    assert ("Bound", "n2") not in {(d.phase, d.node) for d in models.GpuDevice.objects.filter(vm_name="vm9")}


@pytest.mark.django_db(transaction=True)
def test_webhook_denies_clearly_when_the_api_server_refuses_the_bind_request(
    apiserver: ControlPlane, client: Any
) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    apiserver.faults.decide = lambda verb, kind, ns, target: 503 if kind.plural == "gpus" else None
    body = review(new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"]))
    message = denied(post(client, body), body)
    assert "API server refused the bind request" in message and "try again" in message


# -- fresh VMI reads at scale -----------------------------------------------------------------


@pytest.mark.django_db
def test_usage_records_read_many_vmis_with_one_list(apiserver: ControlPlane, monkeypatch: Any) -> None:
    """Past a few hundred VMIs to read fresh (a full reconciliation at scale names one per
    launcher pod), one LIST replaces a GET each; the records come out the same."""
    from binder.runtime import usage_records

    monkeypatch.setattr(usage_records, "_LIST_VMIS_FROM", 0)
    seed_cluster(apiserver)
    sync.sync_once()
    apiserver.mark_calls()
    run_pass("full")
    vmi_calls = {
        verb
        for group, plural, verb in [c.rbac for c in apiserver.calls(UNION_USER)]
        if plural == "virtualmachineinstances"
    }
    assert vmi_calls == {"list"}
    raw = dict(UsageRecord.objects.filter(subject_kind="Pod", end__isnull=True).values_list("subject", "units"))
    # No virt-controller lists the launcher here: both pods the VMI controls count in full.
    assert raw == {"virt-launcher-vm1-real1": 2, "virt-launcher-vm1-fake1": 3, "trainer": 1}


# -- outages and cut streams: the real apiserver's own failures ---------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_apiserver_outage_ends_in_a_relist_and_the_mirror_catches_up(apiserver: ControlPlane) -> None:
    """kube-apiserver is killed and started again (a rollout, a crash): every watch breaks,
    each kind's loop lists again, and what changed after the outage reaches the mirror."""
    seed_cluster(apiserver)
    stop = threading.Event()
    threads = sync.run_forever(stop, relist_seconds=300, watch_seconds=5)
    try:
        wait_for(lambda: len(mirrored_devices()) == 4, what="first list")
        apiserver.restart_apiserver(down_seconds=1.0)
        apiserver.seed(gpu_obj("t2", "vm9-gpu2", "a10", "vm9"))
        apiserver.request("DELETE", f"{GPUS}/namespaces/t1/gpus/vm1-gpu1")
        wait_for(lambda: ("t2", "vm9-gpu2") in mirrored_devices(), what="a GPU created after the outage")
        wait_for(
            lambda: (
                models.FinalizerRelease.objects.filter(kind="GPU", name="vm1-gpu1").exists()
                or ("t1", "vm1-gpu1") not in mirrored_devices()
            ),
            what="a deletion after the outage",
        )
        status = models.SyncStatus.objects.get(kind="GPU")
        assert status.errors >= 1 or status.relists >= 2, "the outage went unnoticed"
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.django_db(transaction=True)
def test_cut_watch_streams_resume_from_the_last_event_without_losing_one(
    apiserver: ControlPlane, watch_proxy: WatchProxy
) -> None:
    """A proxy between gpuplane and the apiserver ends every watch stream at once (an idle
    timeout, a partition); the sync watches again from the last version it applied, and
    every change made meanwhile arrives exactly once."""
    apiserver.seed(namespace_obj("t1"), *(gpu_obj("t1", f"g{i}", "h100", f"vm{i}") for i in range(2)))
    stop = threading.Event()
    runner = sync.KindSync("GPU", stop, relist_seconds=300, watch_seconds=30)
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        wait_for(lambda: models.SyncStatus.objects.filter(kind="GPU", relists__gte=1).exists(), what="first list")
        assert len(mirrored_devices()) == 2
        relists = models.SyncStatus.objects.get(kind="GPU").relists
        for round_ in range(3):
            wait_for(lambda: watch_proxy.cut_watches() > 0, what="an open watch to cut")
            apiserver.seed(gpu_obj("t1", f"g{2 + round_}", "h100", f"vm{2 + round_}"))
        wait_for(lambda: len(mirrored_devices()) == 5, what="every GPU made while the streams were cut")
        assert Counter(models.GpuDevice.objects.values_list("name", flat=True)).most_common(1)[0][1] == 1
        assert models.SyncStatus.objects.get(kind="GPU").relists == relists, "a cut stream needs no relist"
    finally:
        stop.set()
        watch_proxy.cut_watches()
        thread.join(15)


@pytest.mark.django_db
def test_a_borrowed_set_is_written_to_and_read_back_from_the_cluster(apiserver: ControlPlane) -> None:
    """Lending in cluster mode: the budget's borrowing is read from the API, the borrowed
    set's devices carry ``status.borrowed`` there, the budget's status says what is
    borrowed, and the mirror (from what the writes returned) agrees with a fresh list."""
    budget = budget_obj("t1", {"h100": 1})
    budget["spec"]["borrowing"] = {"h100": 2}
    apiserver.seed(
        namespace_obj("t1"),
        node_obj("n1", {H100: 4}),
        class_obj("h100", H100),
        budget,
        *(gpu_obj("t1", f"vm1-gpu{i}", "h100", "vm1") for i in range(2)),
    )
    sync.sync_once()
    assert models.GpuBudget.objects.get(namespace__name="t1").borrowing == {"h100": 2}
    run_pass("full")
    for gpu in cluster_gpus(apiserver).values():
        assert gpu["status"]["phase"] == "Bound" and gpu["status"]["borrowed"] is True, gpu["status"]
    stored = apiserver.request("GET", f"{GPUS}/namespaces/t1/gpubudgets/gpu-budget")
    assert stored["status"]["borrowed"]["h100"] == 2  # and its raw key alike
    assert set(models.GpuDevice.objects.values_list("borrowed", flat=True)) == {True}
    sync.sync_once()  # a fresh list reads the same back
    assert set(models.GpuDevice.objects.values_list("borrowed", flat=True)) == {True}
    assert run_pass("full").devices_written == 0

"""The binder's passes, step by step, on plain engine objects built from real shapes."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from binder.engine import ANSWER_BOUND, ANSWER_REFUSED, Cluster, answer_pass, full_pass
from binder.engine import types as e
from binder.engine.limits import effective_limits
from harness.shapes import (
    A10,
    H100,
    NOW,
    budget,
    engine,
    gpu,
    gpu_class,
    launcher_obj,
    node,
    plain_pod_obj,
    vmi_obj,
)

H100_CLASS = gpu_class("h100", H100)
A10_CLASS = gpu_class("a10", A10)


def cluster(*devices: e.Device, nodes: tuple[e.Node, ...], **kwargs: Any) -> Cluster:
    kwargs.setdefault("classes", (H100_CLASS, A10_CLASS))
    return Cluster(now=NOW, nodes=nodes, devices=devices, **kwargs)


def order(ns: str, vm: str, n: int, cls: str = "h100", created: str = "2026-11-20T10:00:00Z") -> list[e.Device]:
    return [gpu(ns, f"{vm}-gpu{i}", cls, vm, created=created) for i in range(n)]


def held(
    ns: str, vm: str, n: int, node_name: str, cls: str = "h100", since: str = "2026-11-29T10:00:00Z"
) -> list[e.Device]:
    phase = "Lost" if not node_name else "Bound"
    return [gpu(ns, f"{vm}-gpu{i}", cls, vm, phase=phase, node=node_name, since=since) for i in range(n)]


def state(result: e.PassResult, before: Cluster) -> dict[str, e.Device]:
    """All devices after the pass, by name."""
    merged = {d.name: d for d in before.devices}
    merged.update({d.name: d for d in result.devices})
    return merged


def placement(result: e.PassResult, before: Cluster, vm: str) -> set[tuple[e.Phase, str]]:
    return {(d.phase, d.node) for d in state(result, before).values() if d.vm_name == vm}


# -- step 4: new orders -----------------------------------------------------------------------


def test_order_goes_to_the_fullest_node_with_room() -> None:
    c = cluster(
        *held("t1", "old", 5, "n2"),
        *order("t1", "new", 3),
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 8}), node("n3", {H100: 8})),
    )
    result = full_pass(c)
    assert placement(result, c, "new") == {(e.Phase.BOUND, "n2")}  # 0 left on n2, 5 on n1/n3
    assert state(result, c)["new-gpu0"].reason == "bound: fullest node with room"
    assert state(result, c)["new-gpu0"].since == NOW


def test_fullest_node_skips_nodes_without_room_and_ties_go_by_name() -> None:
    c = cluster(
        *held("t1", "old", 7, "n2"),
        *order("t1", "new", 2),
        nodes=(node("n3", {H100: 8}), node("n2", {H100: 8}), node("n1", {H100: 8})),
    )
    assert placement(full_pass(c), c, "new") == {(e.Phase.BOUND, "n1")}


def test_class_node_selector_is_honoured() -> None:
    picky = gpu_class("h100", H100, selector={"gpu.example.com/pool": "training"})
    c = cluster(
        *order("t1", "vm", 2),
        nodes=(node("n1", {H100: 2}), node("n2", {H100: 8}, labels={"gpu.example.com/pool": "training"})),
        classes=(picky,),
    )
    assert placement(full_pass(c), c, "vm") == {(e.Phase.BOUND, "n2")}


def test_order_needing_two_resources_lands_on_one_node_with_both() -> None:
    c = cluster(
        gpu("t1", "vm-h", "h100", "vm"),
        gpu("t1", "vm-a", "a10", "vm"),
        nodes=(node("n1", {H100: 8}), node("n2", {A10: 4}), node("n3", {H100: 8, A10: 2})),
    )
    assert placement(full_pass(c), c, "vm") == {(e.Phase.BOUND, "n3")}


def test_cordoned_node_keeps_its_sets_but_takes_nothing_new() -> None:
    c = cluster(
        *held("t1", "old", 2, "n1"),
        *order("t1", "new", 2),
        nodes=(node("n1", {H100: 8}, unschedulable=True),),
    )
    result = full_pass(c)
    assert placement(result, c, "old") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "new") == {(e.Phase.PENDING, "")}
    assert "no Ready, schedulable node" in state(result, c)["new-gpu0"].reason


def test_missing_class_leaves_devices_pending_saying_so() -> None:
    c = cluster(gpu("t1", "g0", "l40s", "vm"), gpu("t1", "g1", "h100", "vm"), nodes=(node("n1", {H100: 8}),))
    devices = state(full_pass(c), c)
    assert devices["g0"].phase is e.Phase.PENDING and devices["g1"].phase is e.Phase.PENDING
    assert devices["g0"].reason == "pending: class l40s does not exist"
    assert "missing class l40s" in devices["g1"].reason


def test_orders_are_taken_oldest_first() -> None:
    c = cluster(
        *order("t2", "young", 2, created="2026-11-21T00:00:00Z"),
        *order("t1", "elder", 2, created="2026-11-19T00:00:00Z"),
        nodes=(node("n1", {H100: 2}),),
    )
    result = full_pass(c)
    assert placement(result, c, "elder") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "young") == {(e.Phase.PENDING, "")}


# -- budgets ------------------------------------------------------------------------------------


def test_over_budget_order_stays_pending_naming_key_limit_and_usage() -> None:
    c = cluster(
        *held("t1", "old", 3, "n1"),
        *order("t1", "new", 2),
        nodes=(node("n1", {H100: 8}),),
        budgets=(budget("t1", {"h100": 4}),),
    )
    result = full_pass(c)
    reason = state(result, c)["new-gpu0"].reason
    assert placement(result, c, "new") == {(e.Phase.PENDING, "")}
    assert reason == "pending: over budget: class key h100 has limit 4 in the budget, 3 used, and this set needs 2 more"
    assert result.counts["refused"] == 1


def test_raw_key_budget_counts_raw_pods_and_the_smallest_limit_wins() -> None:
    raw = engine(plain_pod_obj("t1", "trainer-0", H100, 3, "n1"))
    c = cluster(
        *order("t1", "vm", 2),
        nodes=(node("n1", {H100: 8}),),
        pods=(raw,),
        budgets=(budget("t1", {H100: 10}, name="wide"), budget("t1", {H100: 4}, name="narrow")),
    )
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.PENDING, "")}
    assert f"raw key {H100} has limit 4" in state(result, c)["vm-gpu0"].reason
    assert "3 used" in state(result, c)["vm-gpu0"].reason
    assert result.budget_used[("t1", "narrow")] == {H100: 3}


def test_default_budget_deny_refuses_tenants_without_a_budget() -> None:
    c = cluster(
        *order("t1", "vm", 1),
        nodes=(node("n1", {H100: 8}),),
        settings=e.Settings(default_budget=e.DefaultBudget.DENY),
    )
    result = full_pass(c)
    assert "limit 0 in the default budget (deny)" in state(result, c)["vm-gpu0"].reason


def test_binding_a_running_vms_set_replaces_its_pods_raw_usage_in_the_budget() -> None:
    # The VM's pod already counts 2 raw units; binding its 2 devices adds 2 and removes 2.
    devices = order("t1", "vm1", 2)
    vmi = vmi_obj("t1", "vm1", [d.name for d in devices], {"uid-1": "n1"}, "n1")
    pod = engine(launcher_obj(vmi, H100, 2, "n1", uid="uid-1"))
    c = cluster(
        *devices,
        nodes=(node("n1", {H100: 2}),),
        vmis=(engine(vmi),),
        pods=(pod,),
        budgets=(budget("t1", {H100: 2}),),
    )
    assert placement(full_pass(c), c, "vm1") == {(e.Phase.BOUND, "n1")}


# -- step 1: restore sets ---------------------------------------------------------------------


def test_split_set_is_gathered_onto_the_node_holding_most_of_it() -> None:
    devices = held("t1", "vm", 3, "n2")
    devices[0] = dataclasses.replace(devices[0], node="n1")  # a write that failed half way
    c = cluster(*devices, nodes=(node("n1", {H100: 8}), node("n2", {H100: 8})))
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.BOUND, "n2")}
    assert state(result, c)["vm-gpu0"].reason.startswith("restored: set gathered onto n2")
    assert [(ch.name, ch.from_node, ch.to_node) for ch in result.changes] == [("vm-gpu0", "n1", "n2")]
    assert result.counts["restored"] == 1


def test_split_set_between_bound_and_lost_is_gathered() -> None:
    devices = held("t1", "vm", 2, "n1") + [gpu("t1", "vm-gpu9", "h100", "vm", phase="Lost")]
    c = cluster(*devices, nodes=(node("n1", {H100: 8}),))
    assert placement(full_pass(c), c, "vm") == {(e.Phase.BOUND, "n1")}


def test_split_set_with_no_node_for_all_of_it_goes_lost_whole() -> None:
    devices = held("t1", "vm", 4, "n1")
    devices[0] = dataclasses.replace(devices[0], node="n2")
    devices[1] = dataclasses.replace(devices[1], node="n2")
    c = cluster(
        *devices,
        *held("t2", "other", 5, "n1"),
        *held("t2", "third", 5, "n2"),
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 8})),
    )
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.LOST, "")}
    assert "no node has room for the whole set" in state(result, c)["vm-gpu0"].reason


def test_new_member_grows_the_set_on_its_node() -> None:
    c = cluster(
        *held("t1", "vm", 2, "n1"),
        gpu("t1", "vm-gpu2", "h100", "vm"),
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 3})),
    )
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.BOUND, "n1")}
    assert state(result, c)["vm-gpu2"].reason == "bound: the set grew on its node n1"


def test_new_member_without_room_on_its_node_moves_the_whole_set() -> None:
    c = cluster(
        *held("t1", "vm", 2, "n1"),
        gpu("t1", "vm-gpu2", "h100", "vm"),
        *held("t2", "filler", 6, "n1"),
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 4})),
    )
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.BOUND, "n2")}
    assert state(result, c)["vm-gpu0"].reason.startswith("moved from n1")


def test_new_member_without_room_anywhere_waits_and_the_set_stays() -> None:
    c = cluster(
        *held("t1", "vm", 2, "n1"),
        gpu("t1", "vm-gpu2", "h100", "vm"),
        *held("t2", "filler", 6, "n1"),
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 2})),
    )
    result = full_pass(c)
    devices = state(result, c)
    assert {(devices[f"vm-gpu{i}"].phase, devices[f"vm-gpu{i}"].node) for i in (0, 1)} == {(e.Phase.BOUND, "n1")}
    assert devices["vm-gpu2"].phase is e.Phase.PENDING
    assert devices["vm-gpu2"].reason.startswith("pending: no room for 1 x " + H100)


# -- step 2: nodes that cannot keep their sets --------------------------------------------------


def test_drain_label_moves_sets_off_the_node() -> None:
    c = cluster(
        *held("t1", "vm", 2, "n1"),
        nodes=(node("n1", {H100: 8}, labels={"gpuplane.io/drain": "true"}), node("n2", {H100: 8})),
    )
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.BOUND, "n2")}
    assert "labelled gpuplane.io/drain=true" in state(result, c)["vm-gpu0"].reason
    assert result.counts["moved"] == 1


def test_not_ready_node_keeps_sets_within_grace_and_loses_them_after() -> None:
    fresh = (NOW - timedelta(seconds=100)).isoformat().replace("+00:00", "Z")
    stale = (NOW - timedelta(seconds=400)).isoformat().replace("+00:00", "Z")
    within = cluster(*held("t1", "vm", 2, "n1"), nodes=(node("n1", {H100: 8}, ready=False, transition=fresh),))
    assert full_pass(within).changes == ()
    past = cluster(*held("t1", "vm", 2, "n1"), nodes=(node("n1", {H100: 8}, ready=False, transition=stale),))
    result = full_pass(past)
    assert placement(result, past, "vm") == {(e.Phase.LOST, "")}
    reason = state(result, past)["vm-gpu0"].reason
    assert "NotReady" in reason and "300s grace" in reason and "no other node has room" in reason


def test_deleted_node_moves_its_sets() -> None:
    c = cluster(*held("t1", "vm", 1, "gone"), nodes=(node("n1", {H100: 8}),))
    result = full_pass(c)
    assert placement(result, c, "vm") == {(e.Phase.BOUND, "n1")}
    assert "node gone was deleted" in state(result, c)["vm-gpu0"].reason


def test_selector_no_longer_matching_moves_the_set() -> None:
    picky = gpu_class("h100", H100, selector={"pool": "a"})
    c = cluster(
        *held("t1", "vm", 1, "n1"),
        nodes=(node("n1", {H100: 8}, labels={"pool": "b"}), node("n2", {H100: 8}, labels={"pool": "a"})),
        classes=(picky,),
    )
    assert placement(full_pass(c), c, "vm") == {(e.Phase.BOUND, "n2")}


def test_shrunk_allocatable_evicts_the_newest_sets_first() -> None:
    c = cluster(
        *held("t1", "oldest", 2, "n1", since="2026-11-01T00:00:00Z"),
        *held("t1", "middle", 2, "n1", since="2026-11-10T00:00:00Z"),
        *held("t1", "newest", 2, "n1", since="2026-11-20T00:00:00Z"),
        nodes=(node("n1", {H100: 4}), node("n2", {H100: 2})),  # allocatable shrank from 8 to 4
    )
    result = full_pass(c)
    assert placement(result, c, "oldest") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "middle") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "newest") == {(e.Phase.BOUND, "n2")}
    assert "over-booked" in state(result, c)["newest-gpu0"].reason


def test_over_booked_node_with_no_room_elsewhere_sends_newest_sets_lost() -> None:
    c = cluster(
        *held("t1", "oldest", 2, "n1", since="2026-11-01T00:00:00Z"),
        *held("t1", "newer", 2, "n1", since="2026-11-20T00:00:00Z"),
        *held("t1", "newest", 1, "n1", since="2026-11-25T00:00:00Z"),
        nodes=(node("n1", {H100: 2}),),
    )
    result = full_pass(c)
    assert placement(result, c, "oldest") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "newer") == {(e.Phase.LOST, "")}
    assert placement(result, c, "newest") == {(e.Phase.LOST, "")}


# -- step 3: Lost sets --------------------------------------------------------------------------


def test_lost_sets_rebind_before_new_orders_oldest_lost_first() -> None:
    c = cluster(
        *order("t1", "order", 2, created="2026-01-01T00:00:00Z"),
        *held("t2", "lost-late", 2, "", since="2026-11-28T00:00:00Z"),
        *held("t2", "lost-early", 2, "", since="2026-11-27T00:00:00Z"),
        nodes=(node("n1", {H100: 2}),),
    )
    result = full_pass(c)
    assert placement(result, c, "lost-early") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "lost-late") == {(e.Phase.LOST, "")}
    assert placement(result, c, "order") == {(e.Phase.PENDING, "")}


def test_lost_sets_rebind_without_a_budget_check() -> None:
    c = cluster(
        *held("t1", "lost", 2, ""),
        nodes=(node("n1", {H100: 8}),),
        budgets=(budget("t1", {"h100": 1}),),  # already over: Lost units count already
    )
    assert placement(full_pass(c), c, "lost") == {(e.Phase.BOUND, "n1")}


# -- answers and answer passes ------------------------------------------------------------------


def test_full_pass_answers_bind_requests() -> None:
    c = cluster(
        gpu("t1", "a-gpu0", "h100", "a", bind_request="req-1"),
        gpu("t1", "b-gpu0", "h100", "b", bind_request="req-2"),
        nodes=(node("n1", {H100: 1}),),
    )
    devices = state(full_pass(c), c)
    assert devices["a-gpu0"].answer == ANSWER_BOUND + "n1" and devices["a-gpu0"].answered_request == "req-1"
    assert devices["b-gpu0"].answer.startswith(ANSWER_REFUSED + "no Ready, schedulable node")
    assert devices["b-gpu0"].answered_request == "req-2"


def test_answer_pass_places_only_requested_sets_and_moves_nothing() -> None:
    c = cluster(
        *held("t1", "drained", 2, "n1"),
        gpu("t1", "asked-gpu0", "h100", "asked", bind_request="r1"),
        gpu("t1", "unasked-gpu0", "h100", "unasked"),
        nodes=(node("n1", {H100: 8}, labels={"gpuplane.io/drain": "true"}), node("n2", {H100: 8})),
    )
    result = answer_pass(c)
    assert placement(result, c, "asked") == {(e.Phase.BOUND, "n2")}
    assert placement(result, c, "drained") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "unasked") == {(e.Phase.PENDING, "")}
    assert state(result, c)["asked-gpu0"].answer == ANSWER_BOUND + "n2"
    assert result.class_status == {} and result.budget_used == {}


def test_answer_pass_on_a_bound_set_answers_its_node() -> None:
    devices = [dataclasses.replace(d, bind_request="r9") for d in held("t1", "vm", 2, "n1")]
    c = cluster(*devices, nodes=(node("n1", {H100: 8}),))
    result = answer_pass(c)
    assert {d.answer for d in result.devices} == {ANSWER_BOUND + "n1"}
    assert result.changes == ()


def test_answer_pass_refuses_an_over_budget_order_with_the_reason() -> None:
    c = cluster(
        gpu("t1", "vm-gpu0", "h100", "vm", bind_request="r1"),
        nodes=(node("n1", {H100: 8}),),
        budgets=(budget("t1", {"h100": 0}),),
    )
    answer = state(answer_pass(c), c)["vm-gpu0"].answer
    assert (
        answer
        == ANSWER_REFUSED + "over budget: class key h100 has limit 0 in the budget, 0 used, and this set needs 1 more"
    )


def test_disabled_feature_places_moves_and_answers_nothing() -> None:
    c = cluster(
        *held("t1", "drained", 1, "n1"),
        gpu("t1", "x-gpu0", "h100", "x", bind_request="r1"),
        nodes=(node("n1", {H100: 8}, labels={"gpuplane.io/drain": "true"}), node("n2", {H100: 8})),
        settings=e.Settings(enabled=False),
    )
    assert full_pass(c).devices == ()
    assert answer_pass(c).devices == ()


# -- status and determinism ---------------------------------------------------------------------


def test_class_status_totals() -> None:
    picky = gpu_class("h100", H100, units=2, selector={"pool": "a"})
    c = cluster(
        *held("t1", "b", 2, "n1"),
        *held("t1", "l", 1, ""),
        nodes=(node("n1", {H100: 4}, labels={"pool": "a"}), node("n2", {H100: 8})),
        classes=(picky,),
    )
    # n1 is full with the Bound set (2 devices x 2 units); n2 does not match the selector.
    status = full_pass(c).class_status
    assert status["h100"] == e.ClassStatus(allocatable=4, bound=4, lost=2)


def test_same_input_same_decisions() -> None:
    c = cluster(
        *held("t1", "a", 3, "n1"),
        *order("t2", "b", 4),
        *order("t3", "c", 2),
        *held("t1", "d", 2, ""),
        nodes=(node("n1", {H100: 4}), node("n2", {H100: 8}), node("n3", {H100: 8}, unschedulable=True)),
    )
    assert full_pass(c) == full_pass(c)


def test_a_second_pass_changes_nothing() -> None:
    c = cluster(
        *held("t1", "a", 3, "n1"),
        *order("t2", "b", 4),
        *held("t1", "d", 2, ""),
        nodes=(node("n1", {H100: 4}), node("n2", {H100: 8})),
    )
    first = full_pass(c)
    again = dataclasses.replace(c, devices=tuple(state(first, c).values()))
    second = full_pass(again)
    assert second.changes == () and second.devices == ()


def test_over_booked_node_keeps_the_set_whose_vm_runs_there() -> None:
    # n1 shrank to 1 unit under an older set and a newer one whose VM runs on n1. Moving the
    # newer set frees nothing (its launcher pod keeps booking the unit); moving the older does.
    devices = held("t1", "newer", 1, "n1", since="2026-11-20T00:00:00Z")
    vmi = vmi_obj("t1", "newer", [d.name for d in devices], {"uid-n": "n1"}, "n1")
    c = cluster(
        *held("t1", "older", 1, "n1", since="2026-11-01T00:00:00Z"),
        *devices,
        nodes=(node("n1", {H100: 1}), node("n2", {H100: 1})),
        vmis=(engine(vmi),),
        pods=(engine(launcher_obj(vmi, H100, 1, "n1", uid="uid-n")),),
    )
    result = full_pass(c)
    assert placement(result, c, "newer") == {(e.Phase.BOUND, "n1")}
    assert placement(result, c, "older") == {(e.Phase.BOUND, "n2")}


def test_over_booked_node_keeps_a_set_whose_vmi_is_pinned_there_and_says_why() -> None:
    """A stopped VM's set on n1; kube-scheduler, which knows nothing of gpuplane's bookings, put a
    raw pod on its units; the VM starts: its VMI is pinned to n1, its launcher still Pending (no
    room). Moving the set would leave the VMI pinned where its devices are not, its launcher never
    to start; it stays, its reason (code Crowded) naming the pods' units. A set whose VM has no VMI
    moves as before."""
    starting = held("t1", "starting", 2, "n1", since="2026-11-20T00:00:00Z")
    vmi = vmi_obj("t1", "starting", [d.name for d in starting], {}, "")
    vmi["status"] = {"phase": "Scheduling"}
    c = cluster(
        *held("t1", "stopped", 2, "n1", since="2026-11-10T00:00:00Z"),
        *starting,
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 8})),
        vmis=(engine(vmi),),
        pods=(engine(plain_pod_obj("t2", "trainer", H100, 6, "n1")),),
    )
    result = full_pass(c)
    after = state(result, c)
    assert placement(result, c, "starting") == {(e.Phase.BOUND, "n1")}
    assert after["starting-gpu0"].reason_code == "Crowded"
    assert "its VMI t1/starting is pinned there" in after["starting-gpu0"].reason
    assert "6 of nvidia.com/GH100" in after["starting-gpu0"].reason
    # The stopped VM's set makes the room instead (2 + 2 + 6 > 8 until it leaves).
    assert placement(result, c, "stopped") == {(e.Phase.BOUND, "n2")}
    # A finished VMI pins nothing: the newest set then moves, as any other would.
    vmi["status"] = {"phase": "Failed"}
    c2 = dataclasses.replace(c, vmis=(engine(vmi),))
    moved = full_pass(c2)
    assert placement(moved, c2, "starting") == {(e.Phase.BOUND, "n2")}
    assert placement(moved, c2, "stopped") == {(e.Phase.BOUND, "n1")}


def test_over_booked_node_keeps_a_set_admitted_moments_ago_whose_vmi_is_not_mirrored_yet() -> None:
    """The webhook pinned a VMI to the set (its first member's ``admitted``) within
    move_grace_seconds: the VMI is being created, pinned here, though no pass has seen it yet."""
    starting = [
        dataclasses.replace(d, admitted=NOW - timedelta(seconds=5)) if d.name.endswith("gpu0") else d
        for d in held("t1", "starting", 2, "n1", since="2026-11-20T00:00:00Z")
    ]
    c = cluster(
        *starting,
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 8})),
        pods=(engine(plain_pod_obj("t2", "trainer", H100, 8, "n1")),),
    )
    result = full_pass(c)
    assert placement(result, c, "starting") == {(e.Phase.BOUND, "n1")}
    assert state(result, c)["starting-gpu0"].reason_code == "Crowded"
    # Once its VMI would have been mirrored, no VMI means a stopped VM's set: it moves.
    later = dataclasses.replace(c, now=NOW + timedelta(seconds=10))
    assert placement(full_pass(later), later, "starting") == {(e.Phase.BOUND, "n2")}


# -- the pass's fast paths give what the general ones give ----------------------------------------


def test_device_placed_is_dataclasses_replace_for_every_field() -> None:
    # Every field set to a value of its own, so a field Device.placed forgot to carry (or a
    # new field it does not know yet) shows as a difference.
    device = e.Device(
        namespace="t1",
        name="vm-gpu0",
        class_name="h100",
        vm_name="vm",
        phase=e.Phase.LOST,
        node="",
        since=NOW - timedelta(days=2),
        reason="lost: earlier",
        bind_request="req-2",
        answered_request="req-1",
        answer="refused: earlier",
        created=NOW - timedelta(days=3),
        bind_node_selector={"zone": "a"},
        choices=("h100", "a10"),
        borrowed=True,
        reclaim_for="t2/waiting",
        reason_code="Lost",
        admitted=NOW - timedelta(minutes=1),
        keep_node=True,
    )
    assert {f.name for f in dataclasses.fields(e.Device)} == {
        "namespace", "name", "class_name", "vm_name", "phase", "node", "since", "reason", "bind_request",
        "answered_request", "answer", "created", "bind_node_selector", "choices", "borrowed", "reclaim_for",
        "reason_code",
        "admitted", "keep_node",
    }  # fmt: skip
    moved = device.placed("a10", e.Phase.BOUND, "n1", NOW, "bound: here")
    assert moved == dataclasses.replace(
        device, class_name="a10", phase=e.Phase.BOUND, node="n1", since=NOW, reason="bound: here"
    )
    answered = device.placed(
        device.class_name, device.phase, device.node, device.since, device.reason, answered_request="req-2", answer="x"
    )
    assert answered == dataclasses.replace(device, answered_request="req-2", answer="x")
    repaid = device.placed(device.class_name, device.phase, device.node, device.since, device.reason,
                           borrowed=False, reclaim_for="")  # fmt: skip
    assert repaid == dataclasses.replace(device, borrowed=False, reclaim_for="")
    coded = device.placed(device.class_name, device.phase, device.node, device.since, "bound: x", reason_code="Bound")
    assert coded == dataclasses.replace(device, reason="bound: x", reason_code="Bound")


def test_held_refusal_gives_the_budget_refusal_of_the_bound_candidate() -> None:
    from binder.engine.pass_state import PassState

    running = order("t1", "running", 2)
    vmi = vmi_obj("t1", "running", [d.name for d in running], {"uid-1": "n1"}, "n1")
    c = cluster(
        *held("t1", "old", 3, "n1"),
        *order("t1", "new", 2),
        *order("t1", "mixed", 1, cls="a10"),
        *order("t1", "ghost", 1, cls="missing"),
        *held("t2", "lost", 2, ""),
        *order("t2", "lost", 1),
        *running,
        nodes=(node("n1", {H100: 8, A10: 4}),),
        vmis=(engine(vmi),),
        pods=(engine(launcher_obj(vmi, H100, 2, "n1", uid="uid-1")), engine(plain_pod_obj("t1", "raw", H100, 1, "n1"))),
        budgets=(budget("t1", {"h100": 5, H100: 6, "a10": 0}), budget("t2", {H100: 2})),
    )
    run = PassState(c)
    for key in sorted({d.set_key for d in c.devices}):
        members = run.members(key)
        for names in ({d.name for d in members}, {d.name for d in members[:1]}, set()):
            candidate = run.bound_on(members, "-", names)
            assert run.held_refusal(key, members, names) == run.budget_refusal(key, candidate), (key, names)


def test_limits_are_unlimited_only_without_any_limit_or_a_deny_default() -> None:
    """What lets the webhook skip building a ledger: no key limited, no deny-by-default."""
    budget = e.Budget("t1", "b", {"h100": 4})
    assert effective_limits((), e.DefaultBudget.UNLIMITED).unlimited
    assert not effective_limits((budget,), e.DefaultBudget.UNLIMITED).unlimited
    assert not effective_limits((), e.DefaultBudget.DENY).unlimited

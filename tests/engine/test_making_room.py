"""Making room on the pure engine: stopped VMs' sets move so a waiting set fits (SPEC §4
"Making room"), one rule per test; properties in ``test_making_room_properties.py``."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from binder.engine import Cluster, full_pass
from binder.engine import types as e
from binder.engine.explain import explain_sets
from binder.engine.lending import Lending
from binder.engine.making_room import MADE_ROOM, ROOM_REFUSED, MakingRoom, template_refusal
from binder.engine.pass_placing import PlacingPass
from binder.engine.reasons import Code
from binder.engine.types import Requirement, Term
from harness.shapes import A10, H100, NOW, budget, engine, gpu, gpu_class, launcher_obj, node, vmi_obj

A10_CLASS = gpu_class("a10", A10)
H100_CLASS = gpu_class("h100", H100)
EARLY = "2026-11-20T10:00:00Z"


def held(ns: str, vm: str, n: int, node_name: str, cls: str = "a10", since: str = "2026-11-29T10:00:00Z",
         **kwargs: Any) -> list[e.Device]:  # fmt: skip
    return [gpu(ns, f"{vm}-gpu{i}", cls, vm, phase="Bound", node=node_name, since=since, **kwargs) for i in range(n)]


def order(ns: str, vm: str, n: int, cls: str = "a10", created: str = EARLY) -> list[e.Device]:
    return [gpu(ns, f"{vm}-gpu{i}", cls, vm, created=created) for i in range(n)]


def vms(*keys: str, **kwargs: Any) -> tuple[e.VirtualMachine, ...]:
    """A VirtualMachine for each ``ns/vm`` (the same template for all)."""
    return tuple(e.VirtualMachine(key.split("/")[0], key.split("/")[1], **kwargs) for key in keys)


def cluster(*devices: e.Device, nodes: tuple[e.Node, ...], **kwargs: Any) -> Cluster:
    kwargs.setdefault("classes", (A10_CLASS, H100_CLASS))
    return Cluster(now=NOW, nodes=nodes, devices=devices, **kwargs)


def after(result: e.PassResult, before: Cluster) -> dict[tuple[str, str], e.Device]:
    merged = {d.key: d for d in before.devices}
    merged.update({d.key: d for d in result.devices})
    return merged


def where(result: e.PassResult, before: Cluster, vm: str) -> set[tuple[e.Phase, str]]:
    return {(d.phase, d.node) for d in after(result, before).values() if d.vm_name == vm}


def then(result: e.PassResult, before: Cluster, minutes: int = 1) -> Cluster:
    return dataclasses.replace(
        before, devices=tuple(after(result, before).values()), now=before.now + timedelta(minutes=minutes)
    )


def running(ns: str, vm: str, devices: list[e.Device], node_name: str) -> tuple[e.Vmi, e.Pod]:
    vmi = vmi_obj(ns, vm, [d.name for d in devices], {}, node_name)
    pod = launcher_obj(vmi, A10, len(devices), node_name)
    vmi["status"]["activePods"] = {pod["metadata"]["uid"]: node_name}
    return engine(vmi), engine(pod)


#: Two nodes of 8: n1 holds two stopped 2-GPU VMs, n2 a running 4-GPU VM; an 8-GPU order waits.
A = held("t1", "a", 2, "n1", since="2026-11-28T10:00:00Z")
B = held("t1", "b", 2, "n1", since="2026-11-29T10:00:00Z")
C = held("t3", "c", 4, "n2")
NODES = (node("n1", {A10: 8}), node("n2", {A10: 8}))


def fragmented(**kwargs: Any) -> Cluster:
    vmi, pod = running("t3", "c", C, "n2")
    kwargs.setdefault("virtual_machines", vms("t1/a", "t1/b", "t3/c"))
    return cluster(*A, *B, *C, *order("t2", "big", 8), nodes=NODES, vmis=(vmi,), pods=(pod,), **kwargs)


def test_two_stopped_vms_move_so_an_eight_gpu_order_fits_in_the_same_pass() -> None:
    c = fragmented()
    result = full_pass(c)
    assert where(result, c, "a") == where(result, c, "b") == {(e.Phase.BOUND, "n2")}
    assert where(result, c, "big") == {(e.Phase.BOUND, "n1")}
    assert where(result, c, "c") == {(e.Phase.BOUND, "n2")}  # the running VM stays
    moved = [ch for ch in result.changes if ch.vm_name in ("a", "b")]
    assert {ch.reason_code for ch in moved} == {Code.MADE_ROOM}
    assert all("t2/big" in ch.reason and ch.from_node == "n1" and ch.to_node == "n2" for ch in moved)
    big = after(result, c)[("t2", "big-gpu0")]
    assert big.reason_code == Code.BOUND and "room made by moving t1/b (to n2), t1/a (to n2) off n1" in big.reason
    assert result.counts[MADE_ROOM] == 2 and result.counts[e.Outcome.MOVED] == 2
    assert result.room_plans == {("t2", "big"): (("t1", "b"), ("t1", "a"))}  # youngest first
    # The same input decides the same; the next pass changes nothing.
    assert full_pass(c) == result
    assert full_pass(then(result, c)).devices == ()


def test_a_set_with_a_vmi_never_moves_and_a_set_without_a_virtual_machine_neither() -> None:
    vmi_a, pod_a = running("t1", "a", A, "n1")
    c = fragmented()
    with_vmi = dataclasses.replace(c, vmis=(*c.vmis, vmi_a), pods=(*c.pods, pod_a))
    without_vm = dataclasses.replace(c, virtual_machines=vms("t1/b", "t3/c"))
    for blocked in (with_vmi, without_vm):
        result = full_pass(blocked)
        assert where(result, blocked, "a") == {(e.Phase.BOUND, "n1")}
        assert where(result, blocked, "big") == {(e.Phase.PENDING, "")}
        assert MADE_ROOM not in result.counts
    # A VMI that exists but has no running launcher (the VM is starting or stopping) counts too.
    idle = dataclasses.replace(c, vmis=(*c.vmis, dataclasses.replace(vmi_a, active_pods={})))
    assert where(full_pass(idle), idle, "a") == {(e.Phase.BOUND, "n1")}


def test_keep_node_an_unanswered_request_borrowing_and_a_recent_admission_keep_a_set_in_place() -> None:
    c = fragmented()
    tweaks: dict[str, dict[str, Any]] = {
        "keep-node": {"keep_node": True},
        "request": {"bind_request": "req-1"},
        "admitted": {"admitted": NOW - timedelta(seconds=30)},
        "borrowed": {"borrowed": True},
    }
    # t1 borrows: a stays borrowed (repaying would need 4 within a limit of 2), and lending
    # handles it; with only b movable, n1 cannot be freed enough.
    lender = (budget("t1", {"a10": 2}, borrowing={"a10": 4}),)
    for why, change in tweaks.items():
        devices = tuple(dataclasses.replace(d, **change) if d.vm_name == "a" else d for d in c.devices)
        result = full_pass(dataclasses.replace(c, devices=devices, budgets=lender if why == "borrowed" else ()))
        assert not any(ch.reason_code == Code.MADE_ROOM for ch in result.changes), why
        assert where(result, c, "big") == {(e.Phase.PENDING, "")}, why
        assert where(result, c, "a") == {(e.Phase.BOUND, "n1")}, why
    # Past the grace period an admitted set may move again.
    old = tuple(dataclasses.replace(d, admitted=NOW - timedelta(seconds=121)) if d.vm_name == "a" else d
                for d in c.devices)  # fmt: skip
    assert where(full_pass(dataclasses.replace(c, devices=old)), c, "big") == {(e.Phase.BOUND, "n1")}
    grace = dataclasses.replace(c.settings, move_grace_seconds=600)
    assert where(full_pass(dataclasses.replace(c, devices=old, settings=grace)), c, "big") == {(e.Phase.PENDING, "")}


def test_the_destination_obeys_the_vms_template_node_selector_affinity_and_taints() -> None:
    n3 = node("n3", {A10: 4}, labels={"zone": "b"})
    tainted = dataclasses.replace(node("n4", {A10: 4}), taints=(e.Taint("dedicated", "x", "NoSchedule"),))
    base = fragmented()
    c = dataclasses.replace(base, nodes=(*NODES, n3, tainted))
    # Without a constraint the stopped sets go to the fullest other node: n2 (4 free, before
    # n3 by name).
    assert where(full_pass(c), c, "a") == {(e.Phase.BOUND, "n2")}
    # A nodeSelector for zone b sends them to n3, the only node carrying it.
    zoned = dataclasses.replace(c, virtual_machines=vms("t1/a", "t1/b", node_selector={"zone": "b"}))
    assert where(full_pass(zoned), zoned, "a") == {(e.Phase.BOUND, "n3")}
    # A required affinity naming n4 leaves only n4, whose taint the template must tolerate.
    pinned = (Term(fields=(Requirement("metadata.name", "In", ("n4",)),)),)
    intolerant = dataclasses.replace(c, virtual_machines=vms("t1/a", "t1/b", affinity=pinned))
    result = full_pass(intolerant)
    assert where(result, c, "a") == {(e.Phase.BOUND, "n1")} and where(result, c, "big") == {(e.Phase.PENDING, "")}
    tolerant = dataclasses.replace(
        c, virtual_machines=vms("t1/a", "t1/b", affinity=pinned, tolerations=(e.Toleration("dedicated", "Exists"),))
    )
    # The class does not tolerate n4's taint either: n4 takes no new a10 units at all.
    assert where(full_pass(tolerant), c, "a") == {(e.Phase.BOUND, "n1")}
    tolerating_class = dataclasses.replace(A10_CLASS, tolerations=(e.Toleration("dedicated", "Exists"),))
    both = dataclasses.replace(tolerant, classes=(tolerating_class, H100_CLASS))
    assert where(full_pass(both), both, "a") == {(e.Phase.BOUND, "n4")}


def test_template_refusal_names_what_does_not_match() -> None:
    vm = e.VirtualMachine("t1", "a", {"zone": "a"}, (Term((Requirement("gpu", "Exists"),)),))
    assert template_refusal(vm, node("n", {}, labels={"zone": "b", "gpu": "x"})) == (
        "the VM's nodeSelector needs node label zone=a"
    )
    assert template_refusal(vm, node("n", {}, labels={"zone": "a"})) == "the VM's required node affinity does not match"
    assert template_refusal(vm, node("n", {}, labels={"zone": "a", "gpu": "x"})) is None
    nowhere = dataclasses.replace(vm, affinity=())
    assert template_refusal(nowhere, node("n", {}, labels={"zone": "a", "gpu": "x"})) is not None
    labelled = node("n", {}, labels={"zone": "a", "gpu": "x"})
    taint = dataclasses.replace(labelled, taints=(e.Taint("k", "", "NoExecute"),))
    assert "does not tolerate" in (template_refusal(vm, taint) or "")
    assert template_refusal(vm, taint, (e.Toleration("k", "Exists"),)) is None  # the class's, added by the webhook


def test_a_plan_over_the_per_pass_limit_makes_no_room_and_says_so() -> None:
    c = fragmented(settings=e.Settings(moves_per_pass=1))
    result = full_pass(c)
    assert where(result, c, "a") == where(result, c, "b") == {(e.Phase.BOUND, "n1")}
    assert where(result, c, "big") == {(e.Phase.PENDING, "")}
    assert result.counts[ROOM_REFUSED] == 1 and MADE_ROOM not in result.counts
    big = after(result, c)[("t2", "big-gpu0")]
    assert big.reason_code == Code.NO_ROOM and "making room would move 2 stopped VMs' sets" in big.reason
    assert "GPUPLANE_MOVES_PER_PASS=1" in big.reason
    # The note is stable: the next pass writes nothing new.
    assert full_pass(then(result, c)).devices == ()
    assert where(full_pass(fragmented(settings=e.Settings(moves_per_pass=2))), c, "big") == {(e.Phase.BOUND, "n1")}


def test_the_limit_counts_every_move_of_the_pass_and_a_later_smaller_plan_may_still_fit() -> None:
    # big (8 a10, oldest) fits only by moving three stopped sets off n1: over a limit of 2.
    # small (4 h100) needs one stopped set moved off n4 (to n5): within it.
    stopped = [*held("t1", "s1", 2, "n1"), *held("t1", "s2", 2, "n1"), *held("t1", "s3", 2, "n1")]
    c = cluster(
        *stopped, *held("t3", "r", 4, "n2"), *held("t3", "q", 4, "n3"), *held("t1", "s5", 2, "n4", cls="h100"),
        *order("t2", "big", 8), *order("t2", "small", 4, cls="h100", created="2026-11-25T00:00:00Z"),
        nodes=(*(node(n, {A10: 8}) for n in ("n1", "n2", "n3")), node("n4", {H100: 4}), node("n5", {H100: 2})),
        virtual_machines=vms("t1/s1", "t1/s2", "t1/s3", "t1/s5"),  # r and q have none: they stay
        settings=e.Settings(moves_per_pass=2),
    )  # fmt: skip
    result = full_pass(c)
    assert where(result, c, "big") == {(e.Phase.PENDING, "")} and result.counts[ROOM_REFUSED] == 1
    assert where(result, c, "small") == {(e.Phase.BOUND, "n4")} and where(result, c, "s5") == {(e.Phase.BOUND, "n5")}
    assert result.counts[MADE_ROOM] == 1
    roomy = dataclasses.replace(c, settings=e.Settings(moves_per_pass=4))
    assert full_pass(roomy).room_plans == {
        ("t2", "big"): (("t1", "s1"), ("t1", "s2"), ("t1", "s3")),
        ("t2", "small"): (("t1", "s5"),),
    }


def test_the_node_moving_the_fewest_units_then_sets_then_by_name_is_chosen() -> None:
    # n1 needs 4 units moved (one 4-GPU set), n2 needs 2 units moved (two 1-GPU sets): n2 wins
    # on units although it moves more sets.
    nodes = (node("n1", {A10: 8}), node("n2", {A10: 8}), node("n3", {A10: 8}))
    c = cluster(
        *held("t1", "four", 4, "n1"), *held("t1", "x", 1, "n2"), *held("t1", "y", 1, "n2"),
        *held("t1", "z", 2, "n2"), *held("t3", "full", 4, "n3"), *order("t2", "big", 6),
        nodes=nodes, virtual_machines=vms("t1/four", "t1/x", "t1/y"),
    )  # fmt: skip
    result = full_pass(c)
    assert result.room_plans == {("t2", "big"): (("t1", "x"), ("t1", "y"))}  # equal since: by name
    assert where(result, c, "big") == {(e.Phase.BOUND, "n2")}
    # Equal units: the fewest sets wins.
    c2 = cluster(
        *held("t1", "two", 2, "n1"), *held("t1", "four", 2, "n1", since=EARLY), *held("t1", "x", 1, "n2"),
        *held("t1", "y", 1, "n2"), *held("t1", "z", 2, "n2"), *held("t3", "full", 4, "n3"), *order("t2", "big", 6),
        nodes=nodes, virtual_machines=vms("t1/two", "t1/x", "t1/y"),
    )  # fmt: skip
    assert full_pass(c2).room_plans == {("t2", "big"): (("t1", "two"),)}


def test_youngest_sets_are_taken_first_until_the_node_has_room() -> None:
    # n1 (2 free) needs 4 more for big: new, then mid; old stays. n2's r has no VirtualMachine.
    nodes = (node("n1", {A10: 8}), node("n2", {A10: 8}))
    c = cluster(
        *held("t1", "old", 2, "n1", since="2026-11-01T00:00:00Z"), *held("t1", "mid", 2, "n1", since=EARLY),
        *held("t1", "new", 2, "n1", since="2026-11-29T00:00:00Z"), *held("t3", "r", 3, "n2"),
        *order("t2", "big", 6),
        nodes=nodes, virtual_machines=vms("t1/old", "t1/mid", "t1/new"),
    )  # fmt: skip
    result = full_pass(c)
    assert result.room_plans == {("t2", "big"): (("t1", "new"), ("t1", "mid"))}
    assert where(result, c, "old") == {(e.Phase.BOUND, "n1")} and where(result, c, "big") == {(e.Phase.BOUND, "n1")}
    # Without room for the moved sets elsewhere, nothing moves.
    crowded = dataclasses.replace(c, devices=(*c.devices[:6], *held("t3", "r", 6, "n2"), *order("t2", "big", 6)))
    assert full_pass(crowded).room_plans == {}


def test_an_order_over_budget_or_that_could_only_borrow_makes_no_room() -> None:
    c = fragmented(budgets=(budget("t2", {"a10": 4}),))
    assert where(full_pass(c), c, "big") == {(e.Phase.PENDING, "")}
    lender = fragmented(budgets=(budget("t2", {"a10": 4}, borrowing={"a10": 4}),))
    result = full_pass(lender)
    assert where(result, lender, "a") == {(e.Phase.BOUND, "n1")} and MADE_ROOM not in result.counts


def test_a_lost_set_is_made_room_for_before_an_older_order() -> None:
    lost = [gpu("t4", f"lost-gpu{i}", "a10", "lost", phase="Lost", since=EARLY) for i in range(8)]
    c = fragmented()
    c = dataclasses.replace(c, devices=(*c.devices, *lost))
    result = full_pass(c)
    assert where(result, c, "lost") == {(e.Phase.BOUND, "n1")}
    assert where(result, c, "big") == {(e.Phase.PENDING, "")}  # n1 was chosen for the Lost set
    lost_after = after(result, c)[("t4", "lost-gpu0")]
    assert lost_after.reason_code == Code.REBOUND and "room made by moving" in lost_after.reason


def test_no_room_is_made_for_a_set_reclaim_marked_for_nor_on_a_node_holding_marked_sets() -> None:
    # t5 borrows 4 on n2, its VM runs: reclaim marks it for big, which then waits for reclaim.
    lent = held("t5", "lent", 4, "n2", borrowed=True)
    vmi, pod = running("t5", "lent", lent, "n2")
    c = cluster(
        *A, *B, *lent, *order("t2", "big", 8),
        nodes=NODES, vmis=(vmi,), pods=(pod,), virtual_machines=vms("t1/a", "t1/b"),
        budgets=(budget("t5", {"a10": 0}, borrowing={"a10": 8}),),
    )  # fmt: skip
    result = full_pass(c)
    big = after(result, c)[("t2", "big-gpu0")]
    assert big.phase is e.Phase.PENDING and big.reason_code == Code.WAITS_FOR_RECLAIM
    assert MADE_ROOM not in result.counts
    assert {d.reclaim_for for d in after(result, c).values() if d.vm_name == "lent"} == {"t2/big"}


def test_a_set_with_alternatives_keeps_the_class_it_is_held_as_when_it_moves() -> None:
    h100_a10 = [
        dataclasses.replace(d, choices=("h100", "a10"))
        for d in held("t1", "a", 2, "n1", cls="a10", since="2026-11-28T10:00:00Z")
    ]
    c = fragmented()
    c = dataclasses.replace(c, devices=(*h100_a10, *(d for d in c.devices if d.vm_name != "a")),
                            nodes=(*NODES, node("n5", {H100: 8})))  # fmt: skip
    result = full_pass(c)
    moved = [d for d in after(result, c).values() if d.vm_name == "a"]
    assert {(d.class_name, d.node) for d in moved} == {("a10", "n2")}


def test_a_set_moved_for_one_waiting_set_is_not_moved_again() -> None:
    # first (6) frees n1: a goes to n3 (the fullest with room), b to n2. second (6) would need
    # n3's d, e and a moved off, but a moved in this pass: it waits.
    nodes = (node("n1", {A10: 6}), node("n2", {A10: 8}), node("n3", {A10: 6}))
    vmi, pod = running("t3", "c", C, "n2")
    c = cluster(
        *held("t1", "a", 2, "n1"), *held("t1", "b", 2, "n1"), *C, *held("t1", "d", 2, "n3"),
        *held("t1", "e", 2, "n3"), *order("t2", "first", 6), *order("t2", "second", 6, created="2026-11-21T00:00:00Z"),
        nodes=nodes, vmis=(vmi,), pods=(pod,), virtual_machines=vms("t1/a", "t1/b", "t1/d", "t1/e"),
    )  # fmt: skip
    result = full_pass(c)
    assert result.room_plans == {("t2", "first"): (("t1", "a"), ("t1", "b"))}
    assert where(result, c, "a") == {(e.Phase.BOUND, "n3")} and where(result, c, "b") == {(e.Phase.BOUND, "n2")}
    assert where(result, c, "first") == {(e.Phase.BOUND, "n1")}
    assert where(result, c, "second") == {(e.Phase.PENDING, "")}


def test_no_set_is_sent_to_a_node_reclaim_is_freeing() -> None:
    # big waits for t5's borrowed set on n2 (its VM runs): n2 is chosen for big. small needs a
    # moved off n1, and n2 is the only other node with room: closed, so a stays.
    lent = held("t5", "lent", 4, "n2", borrowed=True)
    vmi, pod = running("t5", "lent", lent, "n2")
    c = cluster(
        *A, *lent, *order("t2", "big", 8), *order("t2", "small", 7, created="2026-11-21T00:00:00Z"),
        nodes=NODES, vmis=(vmi,), pods=(pod,), virtual_machines=vms("t1/a"),
        budgets=(budget("t5", {"a10": 0}, borrowing={"a10": 8}),),
    )  # fmt: skip
    result = full_pass(c)
    assert {d.reclaim_for for d in after(result, c).values() if d.vm_name == "lent"} == {"t2/big"}
    assert where(result, c, "a") == {(e.Phase.BOUND, "n1")} and where(result, c, "small") == {(e.Phase.PENDING, "")}
    # With n2 free of marks (the borrowed set is t5's own, within a limit of 8), a moves there.
    own = dataclasses.replace(
        c,
        budgets=(budget("t5", {"a10": 8}),),
        devices=(*A, *(dataclasses.replace(d, borrowed=False) for d in lent), *order("t2", "small", 7)),
    )
    assert where(full_pass(own), own, "a") == {(e.Phase.BOUND, "n2")}


def test_making_room_runs_over_a_bare_working_state() -> None:
    run = PlacingPass(fragmented())
    lender = Lending(run)
    run.bind_order(("t2", "big"))  # step 4 on its own: no room
    room = MakingRoom(run, lender)
    assert room.waiting_sets() == [("t2", "big")]
    assert room.movable(("t1", "a")) is None
    assert room.movable(("t3", "c")) == "its VM runs (a VMI exists)"
    plan = room.plan(("t2", "big"))
    assert plan is not None and plan.node == "n1" and [m.key for m in plan.moves] == [("t1", "b"), ("t1", "a")]
    room.make_room()
    assert {d.node for d in run.members(("t2", "big"))} == {"n1"} and room.moved == [("t1", "b"), ("t1", "a")]


def test_the_explanation_of_a_waiting_set_names_the_moves_that_would_make_its_room() -> None:
    why = explain_sets(fragmented())[("t2", "big")]
    assert why.room == "t1/b (to n2), t1/a (to n2) off n1" and not why.room_over_limit
    assert "would fit by making room: moving t1/b (to n2), t1/a (to n2) off n1" in why.text()
    limited = explain_sets(fragmented(settings=e.Settings(moves_per_pass=1)))[("t2", "big")]
    assert limited.room_over_limit and "more sets than GPUPLANE_MOVES_PER_PASS" in limited.room_note
    # Nothing to say when no stopped VM's set could make room (here: no VirtualMachines).
    assert explain_sets(fragmented(virtual_machines=()))[("t2", "big")].room_note == ""

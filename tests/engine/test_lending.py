"""Lending on the pure engine: idle GPUs lent beyond budgets, taken back only while the
borrowing VM is not running (SPEC §4 Lending), one rule per test."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from binder.engine import Cluster, answer_pass, full_pass
from binder.engine import types as e
from binder.engine.accounting import ledger_for
from binder.engine.limits import effective_limits
from harness.shapes import A10, H100, NOW, budget, engine, gpu, gpu_class, launcher_obj, node, vmi_obj

A10_CLASS = gpu_class("a10", A10)
H100_CLASS = gpu_class("h100", H100)
#: An A10 class only nodes labelled zone=a take: an order of it waits for zone a alone.
ZONE_A10 = gpu_class("a10a", A10, selector={"zone": "a"})


def cluster(*devices: e.Device, nodes: tuple[e.Node, ...], **kwargs: Any) -> Cluster:
    kwargs.setdefault("classes", (A10_CLASS, H100_CLASS, ZONE_A10))
    return Cluster(now=NOW, nodes=nodes, devices=devices, **kwargs)


def order(ns: str, vm: str, n: int, cls: str = "a10", created: str = "2026-11-20T10:00:00Z") -> list[e.Device]:
    return [gpu(ns, f"{vm}-gpu{i}", cls, vm, created=created) for i in range(n)]


def lent(
    ns: str, vm: str, n: int, node_name: str, cls: str = "a10", since: str = "2026-11-29T10:00:00Z", mark: str = ""
) -> list[e.Device]:
    """A borrowed set Bound on ``node_name`` (marked for ``mark`` when given)."""
    return [
        gpu(ns, f"{vm}-gpu{i}", cls, vm, phase="Bound", node=node_name, since=since, borrowed=True, reclaim_for=mark)
        for i in range(n)
    ]


def held(ns: str, vm: str, n: int, node_name: str, cls: str = "a10") -> list[e.Device]:
    return [gpu(ns, f"{vm}-gpu{i}", cls, vm, phase="Bound", node=node_name) for i in range(n)]


def running(ns: str, vm: str, devices: list[e.Device], node_name: str, units: int) -> tuple[e.Vmi, e.Pod]:
    """The VMI of set ``vm`` and its running launcher pod (listed in the VMI's activePods)."""
    vmi = vmi_obj(ns, vm, [d.name for d in devices], {}, node_name)
    pod = launcher_obj(vmi, A10, units, node_name)
    vmi["status"]["activePods"] = {pod["metadata"]["uid"]: node_name}
    return engine(vmi), engine(pod)


def after(result: e.PassResult, before: Cluster) -> dict[str, e.Device]:
    merged = {d.name: d for d in before.devices}
    merged.update({d.name: d for d in result.devices})
    return merged


def of_set(result: e.PassResult, before: Cluster, vm: str) -> list[e.Device]:
    return [d for d in after(result, before).values() if d.vm_name == vm]


def then(result: e.PassResult, before: Cluster, minutes: int = 1) -> Cluster:
    """The cluster after ``result``, a little later."""
    return dataclasses.replace(
        before, devices=tuple(after(result, before).values()), now=before.now + timedelta(minutes=minutes)
    )


LENDER = (budget("t1", {"a10": 2}, borrowing={"a10": 4}),)


# -- budgets: the effective borrowing ---------------------------------------------------


def test_effective_borrowing_is_the_smallest_and_a_limiting_budget_without_an_entry_counts_zero() -> None:
    generous = budget("t1", {"a10": 4, "h100": 2}, name="a", borrowing={"a10": 8, "h100": 2})
    strict = budget("t1", {"a10": 6}, name="b", borrowing={"a10": 3})
    silent = budget("t1", {"h100": 1}, name="c")
    limits = effective_limits([generous, strict, silent], e.DefaultBudget.UNLIMITED)
    assert limits.limit("a10") == 4 and limits.allowance("a10") == 3
    assert limits.limit("h100") == 1 and limits.allowance("h100") == 0  # c limits h100 and names no borrowing
    assert effective_limits([generous], e.DefaultBudget.UNLIMITED).allowance("h100") == 2


# -- step 4: borrowing orders -----------------------------------------------------------


def test_an_order_over_its_limit_borrows_idle_gpus_within_limit_plus_borrowing() -> None:
    c = cluster(*order("t1", "big", 5), nodes=(node("n1", {A10: 8}),), budgets=LENDER)
    devices = of_set(full_pass(c), c, "big")
    assert {(d.phase, d.node, d.borrowed) for d in devices} == {(e.Phase.BOUND, "n1", True)}
    assert "borrowed" in devices[0].reason and "a10 by 3 (limit 2, borrowing 4)" in devices[0].reason
    # Without the borrowing the order waits over budget; beyond limit + borrowing too.
    plain = dataclasses.replace(c, budgets=(budget("t1", {"a10": 2}),))
    assert {d.phase for d in of_set(full_pass(plain), plain, "big")} == {e.Phase.PENDING}
    too_big = dataclasses.replace(c, devices=tuple(order("t1", "big", 7)))
    refused = of_set(full_pass(too_big), too_big, "big")
    assert {d.phase for d in refused} == {e.Phase.PENDING} and "over budget" in refused[0].reason


def test_a_class_with_limit_zero_is_used_by_borrowing_only() -> None:
    c = cluster(
        *order("t1", "vm", 2), nodes=(node("n1", {A10: 8}),), budgets=(budget("t1", {"a10": 0}, borrowing={"a10": 2}),)
    )
    assert {(d.phase, d.borrowed) for d in of_set(full_pass(c), c, "vm")} == {(e.Phase.BOUND, True)}


def test_within_budget_orders_are_bound_before_older_borrowing_orders() -> None:
    c = cluster(
        *order("t1", "borrower", 3, created="2026-11-01T00:00:00Z"),
        *order("t2", "entitled", 2, created="2026-11-25T00:00:00Z"),
        nodes=(node("n1", {A10: 2}),),
        budgets=LENDER,
    )
    result = full_pass(c)
    assert {d.phase for d in of_set(result, c, "entitled")} == {e.Phase.BOUND}
    assert {d.phase for d in of_set(result, c, "borrower")} == {e.Phase.PENDING}


def test_a_borrowing_order_takes_no_room_an_entitled_set_waits_for() -> None:
    # t2's order of 4 fits on n1 (allocatable 4) once its 2 busy units are free: it waits
    # for A10 room, so t1 may not borrow the 2 idle A10s on n2 that it could otherwise take.
    c = cluster(
        *held("t3", "busy", 2, "n1"),
        *order("t1", "borrower", 3, created="2026-11-01T00:00:00Z"),
        *order("t2", "entitled", 4),
        nodes=(node("n1", {A10: 4}), node("n2", {A10: 3})),
        budgets=LENDER,
    )
    borrower = of_set(full_pass(c), c, "borrower")
    assert {d.phase for d in borrower} == {e.Phase.PENDING}
    assert "entitled sets wait for nvidia.com/GA102GL_A10" in borrower[0].reason
    # An order no node could ever hold waits for nothing: then the GPUs are lent.
    huge = dataclasses.replace(
        c, devices=(*held("t3", "busy", 2, "n1"), *order("t1", "borrower", 3), *order("t2", "entitled", 9))
    )
    assert {(d.phase, d.borrowed) for d in of_set(full_pass(huge), huge, "borrower")} == {(e.Phase.BOUND, True)}


# -- repaid -----------------------------------------------------------------------------


def test_a_borrowed_set_is_repaid_oldest_first_once_the_tenants_own_usage_fits() -> None:
    c = cluster(
        *lent("t1", "old", 2, "n1", since="2026-11-20T00:00:00Z"),
        *lent("t1", "young", 2, "n1", since="2026-11-28T00:00:00Z"),
        nodes=(node("n1", {A10: 8}),),
        budgets=(budget("t1", {"a10": 2}, borrowing={"a10": 4}),),
    )
    result = full_pass(c)
    assert {(d.phase, d.node, d.borrowed) for d in of_set(result, c, "old")} == {(e.Phase.BOUND, "n1", False)}
    assert {d.borrowed for d in of_set(result, c, "young")} == {True}  # 2 own + 2 more would pass the limit
    assert "repaid" in of_set(result, c, "old")[0].reason
    repaid = [ch for ch in result.changes if ch.vm_name == "old"]
    assert repaid and all(ch.to_phase is e.Phase.BOUND and ch.to_node == "n1" for ch in repaid)
    assert result.budget_borrowed[("t1", "gpu-budget")] == {"a10": 2, A10: 2}


# -- reclaim ----------------------------------------------------------------------------


def test_a_waiting_entitled_set_marks_a_running_borrower_which_stays_bound() -> None:
    borrower = lent("t1", "borrower", 4, "n1")
    vmi, pod = running("t1", "borrower", borrower, "n1", 4)
    c = cluster(
        *borrower, *order("t2", "waiting", 4), nodes=(node("n1", {A10: 4}),), budgets=LENDER, vmis=(vmi,), pods=(pod,)
    )
    result = full_pass(c)
    assert {(d.phase, d.node, d.reclaim_for) for d in of_set(result, c, "borrower")} == {
        (e.Phase.BOUND, "n1", "t2/waiting")
    }
    waiting = of_set(result, c, "waiting")
    assert {d.phase for d in waiting} == {e.Phase.PENDING}
    assert (
        "waits for reclaim: t1/borrower on n1" in waiting[0].reason and "waits for its VM to stop" in waiting[0].reason
    )
    # The VM stops (its launcher pod finishes): the next pass releases the set and places t2.
    stopped = then(result, c)
    stopped = dataclasses.replace(stopped, pods=(dataclasses.replace(pod, phase="Succeeded"),))
    second = full_pass(stopped)
    released = of_set(second, stopped, "borrower")
    assert {(d.phase, d.node, d.borrowed, d.reclaim_for) for d in released} == {(e.Phase.PENDING, "", False, "")}
    assert "taken back for t2/waiting" in released[0].reason
    assert {(d.phase, d.node) for d in of_set(second, stopped, "waiting")} == {(e.Phase.BOUND, "n1")}


def test_a_stopped_borrower_is_released_and_the_waiting_set_placed_in_the_same_pass() -> None:
    # Only zone-a nodes take the waiting set; the released set could borrow on n2 at once,
    # but a set released in a pass is not placed again in that pass.
    c = cluster(
        *lent("t1", "borrower", 4, "n1"),
        *order("t2", "waiting", 4, cls="a10a"),
        nodes=(node("n1", {A10: 4}, labels={"zone": "a"}), node("n2", {A10: 4})),
        budgets=LENDER,
    )
    result = full_pass(c)
    assert {(d.phase, d.node) for d in of_set(result, c, "waiting")} == {(e.Phase.BOUND, "n1")}
    assert {(d.phase, d.borrowed) for d in of_set(result, c, "borrower")} == {(e.Phase.PENDING, False)}
    later = then(result, c)
    assert {(d.phase, d.node, d.borrowed) for d in of_set(full_pass(later), later, "borrower")} == {
        (e.Phase.BOUND, "n2", True)
    }


def test_reclaim_picks_the_node_releasing_fewest_units_then_fewest_sets_youngest_first() -> None:
    c = cluster(
        *lent("t1", "n1-big", 4, "n1", since="2026-11-28T00:00:00Z"),
        *lent("t1", "n2-a", 1, "n2", since="2026-11-28T00:00:00Z"),
        *lent("t1", "n2-b", 1, "n2", since="2026-11-28T00:00:00Z"),
        *lent("t1", "n3-old", 2, "n3", since="2026-11-20T00:00:00Z"),
        *lent("t1", "n3-young", 2, "n3", since="2026-11-28T00:00:00Z"),
        *order("t2", "waiting", 2),
        nodes=(node("n1", {A10: 4}), node("n2", {A10: 2}), node("n3", {A10: 4})),
        budgets=(budget("t1", {"a10": 0}, borrowing={"a10": 12}),),
    )
    pods, vmis = [], []
    for vm in ("n1-big", "n2-a", "n2-b", "n3-old", "n3-young"):
        members = [d for d in c.devices if d.vm_name == vm]
        vmi, pod = running("t1", vm, members, members[0].node, len(members))
        vmis.append(vmi)
        pods.append(pod)
    c = dataclasses.replace(c, vmis=tuple(vmis), pods=tuple(pods))
    result = full_pass(c)
    marks = {d.vm_name for d in after(result, c).values() if d.reclaim_for == "t2/waiting"}
    # n1 would release 4 units, n2 2 units in 2 sets, n3 2 units in 1 set: its youngest.
    assert marks == {"n3-young"}


def test_a_mark_is_dropped_when_the_set_it_was_for_is_gone() -> None:
    c = cluster(*lent("t1", "borrower", 3, "n1", mark="t2/deleted"), nodes=(node("n1", {A10: 4}),), budgets=LENDER)
    assert {(d.borrowed, d.reclaim_for) for d in of_set(full_pass(c), c, "borrower")} == {(True, "")}


def test_a_running_vms_set_is_never_released_by_reclaim() -> None:
    borrower = lent("t1", "borrower", 4, "n1")
    vmi, pod = running("t1", "borrower", borrower, "n1", 4)
    c = cluster(
        *borrower, *order("t2", "waiting", 4), nodes=(node("n1", {A10: 4}),), budgets=LENDER, vmis=(vmi,), pods=(pod,)
    )
    for _ in range(3):
        result = full_pass(c)
        assert {(d.phase, d.node) for d in of_set(result, c, "borrower")} == {(e.Phase.BOUND, "n1")}
        c = then(result, c)


def runs(ns: str, vm: str, devices: list[e.Device], node_name: str, resource: str) -> tuple[e.Vmi, e.Pod]:
    """As :func:`running`, the launcher requesting ``resource`` (as many as the set holds)."""
    vmi = vmi_obj(ns, vm, [d.name for d in devices], {}, node_name)
    pod = launcher_obj(vmi, resource, len(devices), node_name)
    vmi["status"]["activePods"] = {pod["metadata"]["uid"]: node_name}
    return engine(vmi), engine(pod)


def test_a_waiting_set_mixing_resources_marks_borrowed_sets_of_each_resource_it_lacks() -> None:
    # t2's order mixes 1 A10 and 2 H100s (no alternatives: a choice "as booked" may mix
    # classes). n1 has 1 H100 free; t1's borrowed sets hold its 2 A10s and the other H100.
    # Releasing both (and nothing on n2, whose borrowed A10s hold no H100) makes room.
    lent_a10 = lent("t1", "lent-a10", 2, "n1", since="2026-11-28T00:00:00Z")
    lent_h100 = lent("t1", "lent-h100", 1, "n1", cls="h100", since="2026-11-28T00:00:00Z")
    elsewhere = lent("t1", "lent-n2", 2, "n2", since="2026-11-29T00:00:00Z")
    mixed = [gpu("t2", "mixed-a", "a10", "mixed"), *(gpu("t2", f"mixed-h{i}", "h100", "mixed") for i in range(2))]
    launched = [
        runs("t1", "lent-a10", lent_a10, "n1", A10),
        runs("t1", "lent-h100", lent_h100, "n1", H100),
        runs("t1", "lent-n2", elsewhere, "n2", A10),
    ]
    c = cluster(
        *lent_a10,
        *lent_h100,
        *elsewhere,
        *mixed,
        nodes=(node("n1", {A10: 2, H100: 2}), node("n2", {A10: 2})),
        budgets=(budget("t1", {"a10": 0, "h100": 0}, borrowing={"a10": 8, "h100": 8}),),
        vmis=tuple(v for v, _ in launched),
        pods=tuple(p for _, p in launched),
    )
    result = full_pass(c)
    marks = {d.vm_name: d.reclaim_for for d in after(result, c).values() if d.borrowed}
    assert marks == {"lent-a10": "t2/mixed", "lent-h100": "t2/mixed", "lent-n2": ""}
    waiting = of_set(result, c, "mixed")
    assert {d.phase for d in waiting} == {e.Phase.PENDING}
    assert "waits for reclaim: t1/lent-a10, t1/lent-h100 on n1" in waiting[0].reason
    # Both VMs stop: both sets are released and the mixed set is placed on n1 in that pass.
    stopped = dataclasses.replace(
        then(result, c), pods=tuple(dataclasses.replace(p, phase="Succeeded") for p in c.pods[:2]) + c.pods[2:]
    )
    second = full_pass(stopped)
    assert {(d.phase, d.node) for d in of_set(second, stopped, "mixed")} == {(e.Phase.BOUND, "n1")}
    for vm in ("lent-a10", "lent-h100"):
        assert {(d.phase, d.borrowed) for d in of_set(second, stopped, vm)} == {(e.Phase.PENDING, False)}
    assert {(d.phase, d.node) for d in of_set(second, stopped, "lent-n2")} == {(e.Phase.BOUND, "n2")}


# -- step 2: a borrowed set that cannot stay -------------------------------------------


def test_a_borrowed_set_on_a_drained_node_is_released_never_lost() -> None:
    drained = node("n1", {A10: 4}, labels={"gpuplane.io/drain": "true"})
    c = cluster(*lent("t1", "borrower", 3, "n1"), nodes=(drained,), budgets=LENDER)
    devices = of_set(full_pass(c), c, "borrower")
    assert {(d.phase, d.borrowed) for d in devices} == {(e.Phase.PENDING, False)}
    assert "never sent to Lost" in devices[0].reason
    # With room elsewhere it moves there, still borrowed ...
    roomy = dataclasses.replace(c, nodes=(drained, node("n2", {A10: 4})))
    assert {(d.phase, d.node, d.borrowed) for d in of_set(full_pass(roomy), roomy, "borrower")} == {
        (e.Phase.BOUND, "n2", True)
    }
    # ... unless an entitled set waited for that room at the start of the pass (n2 has the
    # 3 units the borrower needs, but t2's order of 4 waits for n2's busy unit).
    waited = dataclasses.replace(
        roomy, devices=(*roomy.devices, *held("t3", "busy", 1, "n2"), *order("t2", "entitled", 4))
    )
    assert {d.phase for d in of_set(full_pass(waited), waited, "borrower")} == {e.Phase.PENDING}


# -- answer passes ----------------------------------------------------------------------


def requested(devices: list[e.Device], request: str = "req-1") -> list[e.Device]:
    return [dataclasses.replace(d, bind_request=request) for d in devices]


def test_an_answer_pass_releases_a_marked_set_and_places_it_as_an_order() -> None:
    marked = requested(lent("t1", "borrower", 2, "n1", mark="t2/waiting"))
    c = cluster(*marked, nodes=(node("n1", {A10: 2}), node("n2", {A10: 2})), budgets=LENDER)
    result = answer_pass(c)
    devices = of_set(result, c, "borrower")
    # Within its budget as an order (2 of limit 2): placed, no longer borrowed.
    assert {(d.phase, d.borrowed, d.reclaim_for) for d in devices} == {(e.Phase.BOUND, False, "")}
    assert devices[0].answer.startswith("bound:")


def test_an_answer_pass_refuses_a_marked_set_naming_the_set_its_gpus_went_to() -> None:
    marked = requested(lent("t1", "borrower", 4, "n1", mark="t2/waiting"))
    c = cluster(*marked, *order("t2", "waiting", 4), nodes=(node("n1", {A10: 4}),), budgets=LENDER)
    devices = of_set(answer_pass(c), c, "borrower")
    assert {(d.phase, d.node, d.borrowed) for d in devices} == {(e.Phase.PENDING, "", False)}
    assert devices[0].answer.startswith("refused:") and "t2/waiting" in devices[0].answer


# -- accounting -------------------------------------------------------------------------


def test_the_ledger_counts_borrowed_units_apart_from_own_usage() -> None:
    c = cluster(*lent("t1", "borrowed", 3, "n1"), *held("t1", "own", 2, "n1"), nodes=(node("n1", {A10: 8}),))
    ledger = ledger_for(c)
    assert ledger.used["t1"]["a10"] == 5 and ledger.borrowed["t1"]["a10"] == 3
    assert ledger.own_used("t1", "a10") == 2


# -- the webhook ------------------------------------------------------------------------


def test_the_webhook_does_not_pin_a_marked_set_and_lets_a_borrowing_order_ask_the_binder() -> None:
    from harness.factories import new_vmi, review
    from webhooks import admission
    from webhooks.admission import Action, MirrorView

    vmi = new_vmi("t1", "borrower", ["borrower-gpu0", "borrower-gpu1"])
    marked = lent("t1", "borrower", 2, "n1", mark="t2/waiting")
    view = MirrorView(namespace="t1", devices=tuple(marked), classes=(A10_CLASS,), nodes=(node("n1", {A10: 4}),))
    assert admission.decide(review(vmi), view).action is Action.BIND
    unmarked = dataclasses.replace(view, devices=tuple(lent("t1", "borrower", 2, "n1")))
    assert admission.decide(review(vmi), unmarked).action is Action.PATCH
    # An order over its limit that may borrow is the binder's to place; past limit +
    # borrowing the advisory check denies it at once.
    ordered = dataclasses.replace(
        view, devices=tuple(order("t1", "borrower", 2)), budgets=(budget("t1", {"a10": 1}, borrowing={"a10": 1}),)
    )
    assert admission.decide(review(vmi), ordered).action is Action.BIND
    too_far = dataclasses.replace(ordered, budgets=(budget("t1", {"a10": 0}, borrowing={"a10": 1}),))
    assert admission.decide(review(vmi), too_far).action is Action.DENY


# -- the catalog ------------------------------------------------------------------------


def test_the_catalog_says_what_could_be_borrowed_now_and_whether_an_order_would_borrow() -> None:
    from binder.engine.catalog import gpu_options, order_fit

    c = cluster(*held("t1", "own", 2, "n1"), nodes=(node("n1", {A10: 8}),), budgets=LENDER)
    (a10,) = [o for o in gpu_options(c, "t1") if o.name == "a10"]
    assert (a10.limit, a10.used, a10.remaining, a10.borrowing, a10.borrowable) == (2, 2, 0, 4, 4)
    fit = order_fit(c, "t1", 3, ["a10"])
    assert fit.fits and fit.borrowed
    assert not order_fit(c, "t1", 5, ["a10"]).fits  # past limit + borrowing
    # An entitled order waiting for A10 room: nothing may be borrowed now.
    waited = dataclasses.replace(c, devices=(*c.devices, *held("t3", "busy", 5, "n1"), *order("t2", "entitled", 4)))
    (a10,) = [o for o in gpu_options(waited, "t1") if o.name == "a10"]
    assert a10.borrowable == 0
    assert not order_fit(waited, "t1", 1, ["a10"]).fits
    # Limit 0 with borrowing: the class is listed (usable by borrowing only).
    zero = dataclasses.replace(c, devices=(), budgets=(budget("t1", {"a10": 0}, borrowing={"a10": 2}),))
    assert [o.borrowable for o in gpu_options(zero, "t1") if o.name == "a10"] == [2]

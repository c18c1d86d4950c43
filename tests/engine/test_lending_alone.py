"""The lending rules on their own: :class:`binder.engine.lending.Lending` over a bare
working state (a :class:`PlacingPass`, no steps of a pass around it).

A pass holds its lending rules and hands them its working state; these tests build that
state themselves and call one rule at a time, so each rule is seen doing its part alone
(repaying, judging what entitled sets wait for, reclaiming) and placing only through the
storey below it."""

from __future__ import annotations

from binder.engine import Cluster
from binder.engine import types as e
from binder.engine.ledger_records import SetKey
from binder.engine.lending import Lending
from binder.engine.pass_placing import PlacingPass
from harness.shapes import A10, NOW, budget, gpu, gpu_class, node

A10_CLASS = gpu_class("a10", A10)
LENDER = (budget("t1", {"a10": 2}, borrowing={"a10": 4}),)


def lent(ns: str, vm: str, n: int, node_name: str, since: str = "2026-11-29T10:00:00Z") -> list[e.Device]:
    return [
        gpu(ns, f"{vm}-gpu{i}", "a10", vm, phase="Bound", node=node_name, since=since, borrowed=True) for i in range(n)
    ]


def order(ns: str, vm: str, n: int) -> list[e.Device]:
    return [gpu(ns, f"{vm}-gpu{i}", "a10", vm, created="2026-11-20T10:00:00Z") for i in range(n)]


def state(*devices: e.Device, nodes: tuple[e.Node, ...], budgets: tuple[e.Budget, ...]) -> PlacingPass:
    return PlacingPass(Cluster(now=NOW, nodes=nodes, devices=devices, classes=(A10_CLASS,), budgets=budgets))


class Placings(PlacingPass):
    """A working state that notes which sets were placed through it, and how."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self.placed: list[tuple[str, SetKey]] = []

    def bind_order(self, key: SetKey) -> None:
        self.placed.append(("bind_order", key))
        super().bind_order(key)

    def rebind(self, key: SetKey) -> None:
        self.placed.append(("rebind", key))
        super().rebind(key)


def test_repay_alone_stops_the_oldest_borrowed_set_that_fits_its_tenants_own_usage() -> None:
    run = state(
        *lent("t1", "old", 2, "n1", since="2026-11-20T00:00:00Z"),
        *lent("t1", "young", 2, "n1", since="2026-11-28T00:00:00Z"),
        nodes=(node("n1", {A10: 8}),),
        budgets=LENDER,
    )
    lender = Lending(run)
    assert lender.active
    lender.repay()
    assert {(d.phase, d.node, d.borrowed) for d in run.members(("t1", "old"))} == {(e.Phase.BOUND, "n1", False)}
    assert {d.borrowed for d in run.members(("t1", "young"))} == {True}  # 2 own + 2 more: over the limit
    # The change is the working state's: its result records the set that stopped borrowing.
    assert {c.vm_name for c in run.result().changes} == {"old"}


def test_what_entitled_sets_wait_for_is_judged_over_the_state_it_was_handed() -> None:
    # t2's order is within its (default, unlimited) budget and n1 is full of t1's borrowed set.
    run = state(*lent("t1", "borrower", 4, "n1"), *order("t2", "waiting", 4), nodes=(node("n1", {A10: 4}),),
                budgets=LENDER)  # fmt: skip
    assert Lending(run).waiting_at_start() == {A10}
    # With the borrowed set gone there is room: nothing waits.
    empty = state(*order("t2", "waiting", 4), nodes=(node("n1", {A10: 4}),), budgets=LENDER)
    assert Lending(empty).waiting_at_start() == set()


def test_reclaim_alone_releases_a_stopped_borrower_and_places_the_waiting_set_through_the_state_below() -> None:
    run = Placings(
        Cluster(
            now=NOW,
            nodes=(node("n1", {A10: 4}),),
            devices=(*lent("t1", "borrower", 4, "n1"), *order("t2", "waiting", 4)),
            classes=(A10_CLASS,),
            budgets=LENDER,
        )
    )
    lender = Lending(run)
    lender.reclaim([("t2", "waiting")])
    borrower = run.members(("t1", "borrower"))
    # No launcher pod runs the borrower's VM: released in the same call, never placed again in it.
    assert {(d.phase, d.node, d.borrowed, d.reclaim_for) for d in borrower} == {(e.Phase.PENDING, "", False, "")}
    assert lender.released_now == {("t1", "borrower")}
    assert lender.released_for == {("t1", "borrower"): "t2/waiting"}
    assert {(d.phase, d.node) for d in run.members(("t2", "waiting"))} == {(e.Phase.BOUND, "n1")}
    # The waiting order was placed by the storey below (an order: bind_order), nothing else.
    assert run.placed == [("bind_order", ("t2", "waiting"))]


def test_no_borrowing_anywhere_leaves_the_rules_inactive() -> None:
    run = state(*order("t2", "waiting", 2), nodes=(node("n1", {A10: 4}),), budgets=())
    assert not Lending(run).active

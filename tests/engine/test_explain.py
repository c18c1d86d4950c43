"""binder.engine.explain with plain engine records: what a Lost or Pending set needs, the
largest gap a node that may take it has, who holds the rest, and what would fit."""

from __future__ import annotations

from datetime import UTC, datetime

from binder.engine import ledger_for
from binder.engine import types as e
from binder.engine.explain import class_gaps, explain_sets

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DOWN = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
H100 = "nvidia.com/H100"


def _cluster(*, nodes: list[e.Node], devices: list[e.Device], **rest: object) -> e.Cluster:
    return e.Cluster(
        now=NOW,
        classes=(e.GpuClass("h100", H100),),
        nodes=tuple(nodes),
        devices=tuple(devices),
        **rest,  # type: ignore[arg-type]
    )


def _set(ns: str, vm: str, n: int, *, phase: e.Phase = e.Phase.BOUND, node: str = "") -> list[e.Device]:
    return [e.Device(ns, f"{vm}-{i}", "h100", vm, phase=phase, node=node, reason="lost: no room") for i in range(n)]


def _demo_like() -> e.Cluster:
    """team-nlp/train (8) Lost off n5 (NotReady) whose launcher pod still books n5; n1 full;
    n4 cordoned with 6 free (a 2-device set holds the rest); n3 7 allocatable, 2 free."""
    pod = e.Pod("team-nlp", "virt-launcher-train", "uid-1", node="n5", requests={H100: 8}, owner_vmi="train")
    vmi = e.Vmi("team-nlp", "train", active_pods={"uid-1": "n5"}, node="n5", phase="Running")
    return _cluster(
        nodes=[
            e.Node("n1", {H100: 8}),
            e.Node("n3", {H100: 7}),
            e.Node("n4", {H100: 8}, unschedulable=True),
            e.Node("n5", {H100: 8}, ready=False, ready_since=DOWN),
        ],
        devices=[
            *_set("team-nlp", "train", 8, phase=e.Phase.LOST),
            *_set("team-a", "big", 6, node="n1"),
            *_set("team-b", "small", 2, node="n1"),
            *_set("team-c", "five", 5, node="n3"),
            *_set("team-nlp", "serve", 2, node="n4"),
        ],
        pods=(pod,),
        vmis=(vmi,),
    )


def test_a_lost_set_says_what_it_needs_the_largest_gap_and_who_holds_the_rest() -> None:
    why = explain_sets(_demo_like())[("team-nlp", "train")]
    assert why.phase is e.Phase.LOST
    (need,) = why.needs
    assert (need.units, need.gap_node, need.gap) == (8, "n1", 0)
    assert [(h.kind, h.namespace, h.name, h.units) for h in need.gap_holders] == [
        ("set", "team-a", "big", 6),
        ("set", "team-b", "small", 2),
    ]
    assert why.summary.startswith("needs 8 × h100 on one node; the largest gap is 0 on n1, 8 held by set team-a/big")
    # n3 can never hold 8 (7 allocatable), so it is no option
    assert [o.node for o in need.options] == ["n5", "n4", "n1"]


def test_the_vmis_notready_node_is_flagged_and_its_own_pod_counts_as_room() -> None:
    why = explain_sets(_demo_like())[("team-nlp", "train")]
    assert why.vmi_node == "n5" and why.vmi_node_not_ready
    assert "running on n5, which is NotReady since 2026-11-30T08:00:00+00:00" in why.vmi_note
    back, uncordon, free = why.needs[0].options
    assert (back.room, back.to_free) == (8, 0)  # its own launcher pod books n5: room for itself
    assert back.sentence().startswith("on n5: bring it back to Ready")
    assert back.sentence().endswith("; this set already books 8 units there")
    assert uncordon.sentence() == "on n4: uncordon it and free 2 (held by set team-nlp/serve (2))"
    assert free.to_free == 8
    assert "would fit: on n5: bring it back to Ready" in why.text()


def test_a_set_that_fits_now_says_so() -> None:
    cluster = _cluster(nodes=[e.Node("n1", {H100: 8})], devices=_set("t", "vm", 4, phase=e.Phase.LOST))
    why = explain_sets(cluster)[("t", "vm")]
    assert why.needs[0].gap == 8 and not why.needs[0].gap_holders
    assert why.steps == ("n1 has room now: a pass would bind it there (retry)",)


def test_pending_set_over_budget_and_unknown_class_and_missing_resource() -> None:
    cluster = e.Cluster(
        now=NOW,
        classes=(e.GpuClass("h100", H100), e.GpuClass("a10q", "nvidia.com/A10Q")),
        nodes=(e.Node("n1", {H100: 8}),),
        devices=(
            *_set("t", "over", 2, phase=e.Phase.PENDING),
            e.Device("t", "ghost-0", "l40s", "ghost"),
            e.Device("t", "vdi-0", "a10q", "vdi"),
        ),
        budgets=(e.Budget("t", "b", {"h100": 1}),),
    )
    why = explain_sets(cluster)
    assert why[("t", "over")].phase is e.Phase.PENDING
    assert why[("t", "over")].problems[0].startswith("over budget: class key h100 has limit 1")
    assert why[("t", "over")].steps == ()  # room would not help
    assert why[("t", "ghost")].summary == "class l40s does not exist"
    assert "no node has 1 nvidia.com/A10Q allocatable" in why[("t", "vdi")].summary


def test_class_gaps_count_only_nodes_that_may_take_the_class() -> None:
    cluster = _cluster(
        nodes=[
            e.Node("ok", {H100: 8}),
            e.Node("cordoned", {H100: 8}, unschedulable=True),
            e.Node("down", {H100: 8}, ready=False),
            e.Node("tainted", {H100: 8}, taints=(e.Taint("dedicated", "x"),)),
            e.Node("small", {H100: 4}),
        ],
        devices=_set("t", "vm", 3, node="ok"),
    )
    (gap,) = class_gaps(cluster, ledger_for(cluster))
    assert (gap.free, gap.largest, gap.node) == (5 + 4, 5, "ok")


# -- the explanation switches on the reason's code, never its words --------------------------


def _waiting_beside_a_marked_borrower(code: str, reason: str) -> e.Cluster:
    """t2/waiting (2, Pending) whose last reason is ``reason`` of kind ``code``, and t1/lent
    Bound on n1, borrowed and marked for it."""
    lent = [
        e.Device("t1", f"lent-{i}", "h100", "lent", phase=e.Phase.BOUND, node="n1", borrowed=True,
                 reclaim_for="t2/waiting", reason_code="Borrowed")
        for i in range(2)
    ]  # fmt: skip
    waiting = [e.Device("t2", f"waiting-{i}", "h100", "waiting", reason=reason, reason_code=code) for i in range(2)]
    return _cluster(nodes=[e.Node("n1", {H100: 2})], devices=[*lent, *waiting])


def test_a_set_whose_code_says_it_waits_for_reclaim_names_the_marked_sets_from_their_marks() -> None:
    # The words say nothing of reclaim: the code and the marks are what the board reads.
    c = _waiting_beside_a_marked_borrower("WaitsForReclaim", "pending: no room")
    explained = explain_sets(c, ledger_for(c))[("t2", "waiting")]
    assert explained.summary.startswith(
        "waits for reclaim: t1/lent on n1, borrowed and marked for it, waits for its VM to stop; "
    )


def test_a_reason_that_only_reads_like_a_reclaim_note_is_not_taken_for_one() -> None:
    words = "pending: no room; waits for reclaim: t9/other on n9, borrowed and marked for it, waits for its VM to stop"
    c = _waiting_beside_a_marked_borrower("NoRoom", words)
    explained = explain_sets(c, ledger_for(c))[("t2", "waiting")]
    assert "waits for reclaim" not in explained.summary
    assert explained.reason == words  # the sentence itself is still shown beside it

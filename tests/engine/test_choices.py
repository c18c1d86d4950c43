"""Orders that accept several GPU classes, in order of preference: the engine's rules.

Devices are built from the real GPU object shape with ``spec.alternativeClassNames``
(and ``status.className`` for held ones) and parsed by the project's parser, so the
converter's "book a held device by its held class" is exercised too.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from binder.engine import ANSWER_BOUND, Cluster, answer_pass, full_pass
from binder.engine import types as e
from binder.engine.catalog import order_fit
from binder.engine.explain import explain_sets
from binder.engine.fit import is_settled
from harness.shapes import A10, H100, NOW, budget, engine, gpu_class, gpu_obj, launcher_obj, node, vmi_obj

A100 = "nvidia.com/GA100_A100_SXM4_80GB"
CLASSES = (gpu_class("h100", H100), gpu_class("a100", A100), gpu_class("a10", A10))


def device(
    ns: str,
    name: str,
    vm: str,
    choices: tuple[str, ...],
    *,
    phase: str | None = None,
    node_name: str = "",
    held_as: str = "",
    created: str = "2026-11-20T10:00:00Z",
    since: str = "2026-11-29T10:00:00Z",
    bind_request: str = "",
) -> e.Device:
    obj = gpu_obj(
        ns, name, choices[0], vm, phase=phase, node=node_name, created=created, since=since, bind_request=bind_request
    )
    if len(choices) > 1:
        obj["spec"]["alternativeClassNames"] = list(choices[1:])
    if held_as:
        obj["status"]["className"] = held_as
    return engine(obj)  # type: ignore[no-any-return]


def order(ns: str, vm: str, n: int, choices: tuple[str, ...] = ("h100", "a100"), **kw: Any) -> list[e.Device]:
    return [device(ns, f"{vm}-gpu{i}", vm, choices, **kw) for i in range(n)]


def held(
    ns: str, vm: str, n: int, node_name: str, held_as: str, choices: tuple[str, ...] = ("h100", "a100"), **kw: Any
) -> list[e.Device]:
    phase = "Bound" if node_name else "Lost"
    return [
        device(ns, f"{vm}-gpu{i}", vm, choices, phase=phase, node_name=node_name, held_as=held_as, **kw)
        for i in range(n)
    ]


def cluster(*devices: e.Device, nodes: tuple[e.Node, ...], **kwargs: Any) -> Cluster:
    kwargs.setdefault("classes", CLASSES)
    return Cluster(now=NOW, nodes=nodes, devices=devices, **kwargs)


def after(result: e.PassResult, before: Cluster) -> dict[str, e.Device]:
    merged = {d.name: d for d in before.devices}
    merged.update({d.name: d for d in result.devices})
    return merged


def of_vm(result: e.PassResult, before: Cluster, vm: str) -> set[tuple[e.Phase, str, str]]:
    return {(d.phase, d.node, d.class_name) for d in after(result, before).values() if d.vm_name == vm}


# -- the parsed device --------------------------------------------------------------------------


def test_a_parsed_device_lists_its_choices_and_is_booked_by_its_held_class() -> None:
    pending = device("t1", "g", "vm", ("h100", "a100"))
    assert (pending.class_name, pending.choices) == ("h100", ("h100", "a100"))
    bound = device("t1", "g", "vm", ("h100", "a100"), phase="Bound", node_name="n1", held_as="a100")
    assert (bound.class_name, bound.choices) == ("a100", ("h100", "a100"))
    plain = device("t1", "g", "vm", ("h100",), phase="Bound", node_name="n1", held_as="h100")
    assert (plain.class_name, plain.choices) == ("h100", ())


# -- new orders ----------------------------------------------------------------------------------


def test_order_takes_its_first_choice_when_it_has_room() -> None:
    c = cluster(*order("t1", "vm", 2), nodes=(node("h", {H100: 8}), node("a", {A100: 8})))
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "h", "h100")}
    assert after(result, c)["vm-gpu0"].reason == "bound: fullest node with room"


def test_order_falls_back_to_the_next_choice_with_room() -> None:
    c = cluster(
        *held("t1", "big", 7, "h", "h100"),
        *order("t1", "vm", 2, created="2026-11-21T10:00:00Z"),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a", "a100")}
    reason = after(result, c)["vm-gpu0"].reason
    assert reason == (
        "bound: fullest node with room, as a100 (passed over h100: no h100 node has room for 2 x " + H100 + ")"
    )
    assert after(result, c)["vm-gpu0"].since == NOW


def test_preference_order_beats_fullness() -> None:
    """A later choice with a fuller node does not win over a first choice with room."""
    c = cluster(
        *held("t1", "other", 6, "a", "a100", choices=("a100",)),
        *order("t1", "vm", 2, choices=("h100", "a100")),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
    )
    assert of_vm(full_pass(c), c, "vm") == {(e.Phase.BOUND, "h", "h100")}


def test_within_the_chosen_class_the_fullest_node_wins_and_ties_go_by_name() -> None:
    c = cluster(
        *held("t1", "full", 8, "h1", "h100"),
        *held("t1", "some", 3, "a2", "a100", choices=("a100",)),
        *order("t1", "vm", 2, created="2026-11-21T10:00:00Z"),
        *order("t1", "tie", 1, choices=("a10", "h100"), created="2026-11-22T10:00:00Z"),
        nodes=(
            node("h1", {H100: 8}),
            node("a1", {A100: 8}),
            node("a2", {A100: 8}),
            node("a3", {A100: 8}),
            node("x2", {A10: 4}),
            node("x1", {A10: 4}),
        ),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a2", "a100")}
    assert of_vm(result, c, "tie") == {(e.Phase.BOUND, "x1", "a10")}


def test_order_over_budget_for_its_first_choice_takes_the_next() -> None:
    c = cluster(
        *order("t1", "vm", 2),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
        budgets=(budget("t1", {"h100": 1}),),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a", "a100")}
    reason = after(result, c)["vm-gpu0"].reason
    assert "as a100 (passed over h100: over budget: class key h100 has limit 1" in reason


def test_order_over_budget_for_every_choice_stays_pending_saying_why_for_each() -> None:
    c = cluster(
        *order("t1", "vm", 2),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
        budgets=(budget("t1", {"h100": 1, A100: 0}),),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.PENDING, "", "h100")}
    reason = after(result, c)["vm-gpu0"].reason
    assert reason.startswith("pending: none of the set's classes can take it: h100: over budget: class key h100")
    assert f"; a100: over budget: raw key {A100} has limit 0" in reason
    assert result.counts["refused"] == 1


def test_order_with_no_room_anywhere_names_every_choice() -> None:
    c = cluster(*order("t1", "vm", 4), nodes=(node("h", {H100: 2}), node("a", {A100: 2})))
    reason = after(full_pass(c), c)["vm-gpu0"].reason
    assert reason == (
        f"pending: none of the set's classes can take it: h100: no h100 node has room for 4 x {H100}; "
        f"a100: no a100 node has room for 4 x {A100}"
    )


def test_a_missing_first_choice_is_passed_over() -> None:
    c = cluster(*order("t1", "vm", 1, choices=("b200", "a100")), nodes=(node("a", {A100: 8}),))
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a", "a100")}
    assert "passed over b200: class b200 does not exist" in after(result, c)["vm-gpu0"].reason


def test_members_that_list_different_choices_stay_pending_naming_two() -> None:
    c = cluster(
        device("t1", "g0", "vm", ("h100", "a100")),
        device("t1", "g1", "vm", ("a100", "h100")),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.PENDING, "", "h100"), (e.Phase.PENDING, "", "a100")}
    reason = after(result, c)["g0"].reason
    assert reason.startswith("pending: members g0 (h100, a100) and g1 (a100, h100) list different classes")
    assert after(result, c)["g1"].reason == reason


def test_a_member_without_alternatives_disagrees_with_one_that_has_them() -> None:
    c = cluster(
        device("t1", "g0", "vm", ("h100",)),
        device("t1", "g1", "vm", ("h100", "a100")),
        nodes=(node("h", {H100: 8}),),
    )
    assert "members g0 (h100) and g1 (h100, a100) list different" in after(full_pass(c), c)["g0"].reason


# -- held sets -----------------------------------------------------------------------------------


def test_a_lost_set_is_rebound_to_its_second_choice() -> None:
    c = cluster(
        *held("t1", "full", 8, "h2", "h100", choices=("h100",)),
        *held("t1", "vm", 2, "", "h100"),
        nodes=(node("h2", {H100: 8}), node("a", {A100: 8})),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a", "a100")}
    assert after(result, c)["vm-gpu0"].reason.startswith("rebound: bound: fullest node with room, as a100")


def test_a_lost_set_with_no_room_for_any_choice_says_so_for_each() -> None:
    c = cluster(*held("t1", "vm", 4, "", "a100"), nodes=(node("h", {H100: 2}),))
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.LOST, "", "a100")}
    reason = after(result, c)["vm-gpu0"].reason
    assert reason.startswith("lost: none of the set's classes has a node with room for it: h100: no h100 node")
    assert "a100: no a100 node has room for 4 x" in reason


def test_a_moved_set_takes_its_first_choice_with_room() -> None:
    drained = node("a1", {A100: 8}, labels={"gpuplane.io/drain": "true"})
    c = cluster(*held("t1", "vm", 2, "a1", "a100"), nodes=(drained, node("a2", {A100: 8}), node("h", {H100: 8})))
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "h", "h100")}
    assert after(result, c)["vm-gpu0"].reason == "moved from a1: node a1 is labelled gpuplane.io/drain=true"


def test_a_set_whose_launcher_runs_keeps_its_class_when_it_moves() -> None:
    members = held("t1", "vm", 2, "a1", "a100")
    uid = "launcher-uid"
    vmi = vmi_obj("t1", "vm", [d.name for d in members], {uid: "a1"}, "a1")
    pod = launcher_obj(vmi, A100, 2, "a1", uid=uid)
    drained = node("a1", {A100: 8}, labels={"gpuplane.io/drain": "true"})
    c = cluster(
        *members,
        nodes=(drained, node("a2", {A100: 8}), node("h", {H100: 8})),
        vmis=(engine(vmi),),
        pods=(engine(pod),),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a2", "a100")}
    # With no other a100 node it goes Lost rather than change class under its launcher.
    c = dataclasses.replace(c, nodes=(drained, node("h", {H100: 8})))
    assert of_vm(full_pass(c), c, "vm") == {(e.Phase.LOST, "", "a100")}


def test_a_bound_set_is_left_on_its_second_choice() -> None:
    """Room on a preferred class never moves a set that is where it may stay."""
    c = cluster(*held("t1", "vm", 2, "a", "a100"), nodes=(node("a", {A100: 8}), node("h", {H100: 8})))
    result = full_pass(c)
    assert result.devices == () and result.changes == ()


def test_a_new_member_joins_as_the_class_the_set_is_held_as() -> None:
    c = cluster(
        *held("t1", "vm", 2, "a", "a100"),
        device("t1", "vm-gpu9", "vm", ("h100", "a100")),
        nodes=(node("a", {A100: 8}), node("h", {H100: 8})),
    )
    result = full_pass(c)
    assert of_vm(result, c, "vm") == {(e.Phase.BOUND, "a", "a100")}
    assert after(result, c)["vm-gpu9"].reason == "bound: the set grew on its node a"


def test_a_new_member_listing_other_choices_waits_saying_so() -> None:
    c = cluster(
        *held("t1", "vm", 2, "a", "a100"),
        device("t1", "vm-gpu9", "vm", ("a100",)),
        nodes=(node("a", {A100: 8}),),
    )
    result = full_pass(c)
    late = after(result, c)["vm-gpu9"]
    assert late.phase is e.Phase.PENDING
    assert "list different classes" in late.reason


def test_a_held_device_whose_class_is_deleted_returns_to_its_first_choice() -> None:
    c = cluster(
        *held("t1", "vm", 1, "a", "a100", choices=("h100", "a100")),
        nodes=(node("a", {A100: 8}),),
        classes=(CLASSES[0],),
    )
    result = full_pass(c)
    d = after(result, c)["vm-gpu0"]
    assert (d.phase, d.class_name) == (e.Phase.PENDING, "h100")


# -- answer pass, determinism --------------------------------------------------------------------


def test_answer_pass_places_an_order_on_a_later_choice() -> None:
    c = cluster(
        *held("t1", "big", 8, "h", "h100", choices=("h100",)),
        *order("t1", "vm", 2, bind_request="r1"),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
    )
    result = answer_pass(c)
    state = after(result, c)
    assert (state["vm-gpu0"].class_name, state["vm-gpu0"].answer) == ("a100", ANSWER_BOUND + "a")


def test_same_input_gives_the_same_decisions_whatever_the_order_of_the_input() -> None:
    devices = (
        *held("t1", "big", 7, "h", "h100"),
        *order("t1", "vm", 2, created="2026-11-21T10:00:00Z"),
        *order("t2", "vm", 2, choices=("a100", "h100"), created="2026-11-21T10:00:00Z"),
        *order("t3", "vm", 1, choices=("a10", "a100", "h100"), created="2026-11-21T10:00:00Z"),
    )
    nodes = (node("h", {H100: 8}), node("a", {A100: 3}), node("x", {A10: 1}))
    c = cluster(*devices, nodes=nodes)
    first = full_pass(c)
    assert full_pass(c) == first
    reordered = cluster(*reversed(devices), nodes=tuple(reversed(nodes)), classes=tuple(reversed(CLASSES)))
    assert full_pass(reordered) == first


# -- a set with one choice behaves exactly as before ---------------------------------------------

RESOURCES = (H100, A100)
PLAIN_CLASSES = (gpu_class("c0", H100), gpu_class("c1", A100), gpu_class("c2", H100, units=2))

placement = st.sampled_from(["pending", "pending", "lost"]) | st.tuples(st.just("bound"), st.integers(0, 3))
set_state = st.tuples(
    st.integers(0, 2),  # tenant
    st.sampled_from(["c0", "c1", "c2", "gone"]),
    st.integers(1, 4),
    placement,
    st.booleans(),  # an unanswered bind request
    st.sampled_from(["", "", "grow", "split", "lost"]),  # the last member: new, elsewhere, or Lost
    st.integers(0, 2),  # with alternatives: which choice a held set is held as
)
clusters = st.fixed_dictionaries(
    {
        "nodes": st.lists(
            st.tuples(st.sampled_from([0, 2, 4, 8]), st.sampled_from([0, 2, 4, 8]), st.booleans(), st.booleans()),
            min_size=1,
            max_size=4,
        ),
        "sets": st.lists(set_state, min_size=1, max_size=8),
        "budgets": st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["c0", "c1", H100]), st.integers(0, 8))),
    }
)


def _random_cluster(spec: dict[str, Any], alternatives: tuple[str, ...] | None) -> Cluster:
    """The drawn cluster; ``alternatives`` None: no device lists choices; else each set's
    choices are its class followed by these (minus its class)."""
    nodes = tuple(
        e.Node(f"n{i}", {H100: h, A100: a}, labels={}, ready=ready, unschedulable=cordoned)
        for i, (h, a, ready, cordoned) in enumerate(spec["nodes"])
    )
    devices = []
    for s, (tenant, cls, size, where, asks, odd, held_index) in enumerate(spec["sets"]):
        phase, node_name = e.Phase.PENDING, ""
        if where == "lost":
            phase = e.Phase.LOST
        elif isinstance(where, tuple):
            phase, node_name = e.Phase.BOUND, nodes[where[1] % len(nodes)].name
        choices: tuple[str, ...] = ()
        held_as = cls
        if alternatives is not None:
            choices = (cls, *(a for a in alternatives if a != cls))
            held_as = choices[held_index % len(choices)]
        for m in range(size):
            member_phase, member_node = phase, node_name
            if m == size - 1 and m > 0 and odd:
                if odd == "grow":
                    member_phase, member_node = e.Phase.PENDING, ""
                elif odd == "lost":
                    member_phase, member_node = e.Phase.LOST, ""
                else:
                    member_phase, member_node = e.Phase.BOUND, nodes[(s + 1) % len(nodes)].name
            devices.append(
                e.Device(
                    f"t{tenant}",
                    f"s{s}-g{m}",
                    held_as if member_phase is not e.Phase.PENDING else cls,
                    f"s{s}",
                    member_phase,
                    member_node,
                    since=NOW,
                    bind_request="req" if asks else "",
                    created=NOW,
                    choices=choices,
                )
            )
    budgets = tuple(
        e.Budget(f"t{tenant}", f"b{i}", {key: limit}) for i, (tenant, key, limit) in enumerate(spec["budgets"])
    )
    return Cluster(now=NOW, classes=PLAIN_CLASSES, nodes=nodes, devices=tuple(devices), budgets=budgets)


def _without_choices(result: e.PassResult) -> e.PassResult:
    return dataclasses.replace(result, devices=tuple(dataclasses.replace(d, choices=()) for d in result.devices))


@settings(max_examples=150, deadline=None)
@given(clusters)
def test_one_choice_behaves_exactly_as_no_choices(spec: dict[str, Any]) -> None:
    plain = _random_cluster(spec, None)
    single = dataclasses.replace(
        plain, devices=tuple(dataclasses.replace(d, choices=(d.class_name,)) for d in plain.devices)
    )
    assert _without_choices(full_pass(single)) == full_pass(plain)
    assert _without_choices(answer_pass(single)) == answer_pass(plain)


@settings(max_examples=300, deadline=None)
@given(clusters, st.permutations(["c0", "c1", "c2"]))
def test_sets_with_alternatives_stay_whole_and_within_capacity(spec: dict[str, Any], prefs: list[str]) -> None:
    """With alternatives: every held set is held as one of its choices, all members alike,
    on one node; no node the pass placed devices on is over-booked by devices; and a
    second pass changes nothing."""
    c = _random_cluster(spec, tuple(prefs))
    result = full_pass(c)
    # A worker passes only the unsettled sets: the same decisions.
    nodes = {n.name: n for n in c.nodes}
    classes = {cls.name: cls for cls in PLAIN_CLASSES}
    by_set: dict[tuple[str, str], list[e.Device]] = {}
    for d in c.devices:
        by_set.setdefault(d.set_key, []).append(d)
    scope = [key for key, members in by_set.items() if not is_settled(members, nodes, classes)]
    assert full_pass(c, scope=scope) == result
    state = {d.key: d for d in c.devices}
    state.update({d.key: d for d in result.devices})
    sets: dict[tuple[str, str], list[e.Device]] = {}
    for d in state.values():
        sets.setdefault(d.set_key, []).append(d)
    for members in sets.values():
        held_members = [d for d in members if d.held]
        if held_members:
            assert len({(d.phase, d.node, d.class_name) for d in held_members}) == 1, held_members
            assert held_members[0].class_name in held_members[0].choices
    placed = {c.to_node for c in result.changes if c.to_phase is e.Phase.BOUND}
    booked: dict[str, Counter[str]] = {}
    for d in state.values():
        if d.phase is e.Phase.BOUND and d.class_name in classes:
            cls = classes[d.class_name]
            booked.setdefault(d.node, Counter())[cls.resource_name] += cls.units_per_device
    allocatable = {n.name: n.allocatable for n in c.nodes}
    for name in placed:
        for resource, units in booked.get(name, Counter()).items():
            assert units <= allocatable[name].get(resource, 0), (name, resource)
    again = dataclasses.replace(c, devices=tuple(sorted(state.values(), key=lambda d: d.key)))
    second = full_pass(again)
    assert second.changes == ()


# -- the explanation of a waiting set --------------------------------------------------------------


def test_the_explanation_of_a_pending_order_covers_every_choice() -> None:
    c = cluster(
        *held("t2", "h-user", 6, "h", "h100", choices=("h100",)),
        *held("t2", "a-user", 5, "a", "a100", choices=("a100",)),
        *order("t1", "vm", 4, choices=("b200", "h100", "a100")),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
    )
    why = explain_sets(c)[("t1", "vm")]
    assert [(n.label, n.units, n.gap_node, n.gap) for n in why.needs] == [("h100", 4, "h", 2), ("a100", 4, "a", 3)]
    assert why.problems == ()


def test_the_explanation_names_a_budget_only_when_every_choice_is_over() -> None:
    nodes = (node("h", {H100: 2}), node("a", {A100: 3}))
    one = cluster(*order("t1", "vm", 4), nodes=nodes, budgets=(budget("t1", {"h100": 0}),))
    assert explain_sets(one)[("t1", "vm")].problems == ()
    both = cluster(*order("t1", "vm", 4), nodes=nodes, budgets=(budget("t1", {"h100": 0, "a100": 0}),))
    (problem,) = explain_sets(both)[("t1", "vm")].problems
    assert problem.startswith("over budget for every class the set accepts: h100: over budget")


# -- the catalog: would an order with these choices fit now? ---------------------------------------


def test_the_catalog_answers_an_order_with_choices_by_the_binders_rules() -> None:
    c = cluster(
        *held("t1", "big", 7, "h", "h100", choices=("h100",)),
        nodes=(node("h", {H100: 8}), node("a", {A100: 8})),
        budgets=(budget("t1", {"a100": 4}),),
    )
    fit = order_fit(c, "t1", 2, ["h100", "a100"])
    assert (fit.fits, fit.class_name, fit.node) == (True, "a100", "a")
    assert "passed over h100: no h100 node has room" in fit.reason
    assert [(b.key, b.limit, b.used, b.after) for b in fit.budget] == [("a100", 4, 0, 2), (A100, None, 0, 2)]
    one = order_fit(c, "t1", 1, ["h100", "a100"])
    assert (one.class_name, one.node, one.reason) == ("h100", "h", "bound: fullest node with room")
    refused = order_fit(c, "t1", 5, ["h100", "a100"])
    assert not refused.fits and refused.class_name == ""
    assert refused.reason.startswith("none of the set's classes can take it: h100: no h100 node has room")
    assert "a100: over budget: class key a100 has limit 4" in refused.reason
    # Asking changes nothing: the snapshot holds no trace of the probe.
    assert full_pass(c).devices == ()

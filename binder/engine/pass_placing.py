"""How a pass places one set: a new order, a Lost set, new members of a held set.

These are the moves every step of a pass and the lending rules make (binding an order in
step 4, rebinding a Lost set in step 3, growing a held set in step 1, placing a set whose
borrowed GPUs a reclaim freed), so they sit below both: the steps
(``binder.engine.placement``) and the lending rules (``binder.engine.lending``) call down
into them and nothing here calls up. Placing a set that accepts several classes goes
through :class:`~binder.engine.pass_choices.ChoosingPass`; the fullest node with room and
the ledger through :class:`~binder.engine.pass_state.PassState` (how the storeys fit:
``binder.engine.placement._Pass``).
"""

from __future__ import annotations

from collections.abc import Sequence

from binder.engine.choices import disagreement, has_alternatives, passed_over, placed_as
from binder.engine.fit import describe_units
from binder.engine.ledger_records import SetKey
from binder.engine.pass_choices import ChoosingPass
from binder.engine.pass_state import REASON_BOUND
from binder.engine.reasons import Code
from binder.engine.types import Outcome, Phase


class PlacingPass(ChoosingPass):
    """A pass's working state with the rules for placing one set."""

    def grow(self, key: SetKey, *, allow_move: bool, final: bool = True) -> None:
        """New Pending members of a Bound set: grow on its node, else move whole (step 1).

        Step 1 tries first (``final=False``: a refusal is not counted yet); the full pass
        tries again once steps 2-3 may have freed room, so a second pass has nothing left
        to do.
        """
        members = self.members(key)
        held = [d for d in members if d.held]
        joined = self.join_as_held(key, members, held)
        if joined is None:
            return
        members, held_as = joined
        fresh = [d for d in members if d.phase is Phase.PENDING and d.class_name in self.classes]
        if not held or not fresh or len({(d.phase, d.node) for d in held}) > 1:
            return
        if held[0].phase is Phase.LOST:
            reason = "pending: waiting for the rest of the set, which is Lost, to be rebound"
            self.with_reason(key, (d.name for d in fresh), reason, code=Code.WAITING_FOR_SET)
            return
        node = held[0].node
        names = {d.name for d in fresh}
        refusal = self.budget_refusal(key, self.bound_on(members, node, names))
        if refusal:
            self.with_reason(key, names, f"pending: {refusal}", code=Code.OVER_BUDGET)
            if final:
                self.refused.add(key)
            return
        if not self.cannot_take(node, fresh) and self.fit(key, self.bound_on(members, node, names), node) is not None:
            self.settle(
                key, fresh, Phase.BOUND, node, f"bound: the set grew on its node {node}", held_as, code=Code.GREW
            )
            self.counts[Outcome.BOUND] += 1
            return
        whole = held + fresh
        target = None
        if allow_move:
            if held_as:
                target = self.place_choosing(key, whole, (held_as,), exclude=[node])[0]
            else:
                target = self.place(key, whole, exclude=[node])
        if target is not None:
            why = f"moved from {node}: the set grew and {node} has no room"
            self.settle(key, held, Phase.BOUND, target, why, code=Code.MOVED)
            self.settle(key, fresh, Phase.BOUND, target, REASON_BOUND, held_as, code=Code.BOUND)
            self.counts[Outcome.MOVED] += 1
            self.room_freed = True
            return
        where = f"on {node} or any node with room for the whole set" if allow_move else f"on {node}"
        why = f"pending: no room for {describe_units(self.units(fresh))} {where}"
        self.with_reason(key, names, why, code=Code.NO_ROOM)
        if final:
            self.refused.add(key)

    def rebind(self, key: SetKey) -> None:
        """Place a Lost set, with its new members if their budget allows (no check for the rest)."""
        choices = self.move_choices(key)
        if choices is not None:
            self.rebind_choosing(key, choices)
            return
        members = self.members(key)
        held = [d for d in members if d.held]
        fresh = [d for d in members if d.phase is Phase.PENDING and d.class_name in self.classes]
        refusal = None
        if fresh:
            # Budget does not depend on the node: Bound and Lost both count.
            refusal = self.held_refusal(key, members, {d.name for d in fresh})
            if not refusal:
                node = self.place(key, held + fresh)
                if node is not None:
                    self.settle(key, held, Phase.BOUND, node, f"rebound: {REASON_BOUND}", code=Code.REBOUND)
                    self.settle(key, fresh, Phase.BOUND, node, REASON_BOUND, code=Code.BOUND)
                    self.counts[Outcome.BOUND] += 1
                    return
        node = self.place(key, held)
        if node is None:
            if not any(d.reason_code == Code.LOST for d in held):  # the first reason it went Lost for stays
                why = f"lost: no node has room for {describe_units(self.units(held))}"
                self.with_reason(key, (d.name for d in held), why, code=Code.LOST)
            if key not in self._lost_now:
                self.refused.add(key)
            return
        self.settle(key, held, Phase.BOUND, node, f"rebound: {REASON_BOUND}", code=Code.REBOUND)
        self.counts[Outcome.BOUND] += 1
        if fresh:
            if refusal:
                why, code = f"pending: {refusal}", Code.OVER_BUDGET
            else:
                why, code = f"pending: no room for new members next to the set on {node}", Code.NO_ROOM
            self.with_reason(key, (d.name for d in fresh), why, code=code)
            self.grow(key, allow_move=False)

    def bind_order(self, key: SetKey) -> None:
        members = self.members(key)
        if has_alternatives(members):
            self.bind_choosing(key, members)
            return
        missing = sorted({d.class_name for d in members if d.class_name not in self.classes})
        if missing:
            for device in members:
                if device.class_name in missing:
                    why, code = f"pending: class {device.class_name} does not exist", Code.CLASS_MISSING
                else:
                    why = f"pending: waiting for the set's devices of missing class {', '.join(missing)}"
                    code = Code.WAITING_FOR_SET
                self.with_reason(key, [device.name], why, code=code)
            self.refused.add(key)
            return
        names = {d.name for d in members}
        refusal = self.held_refusal(key, members, names)
        if refusal:
            self.with_reason(key, names, f"pending: {refusal}", code=Code.OVER_BUDGET)
            self.refused.add(key)
            return
        node = self.place(key, members)
        if node is None:
            self.with_reason(
                key,
                names,
                f"pending: no Ready, schedulable node matching the set's classes has room for "
                f"{describe_units(self.units(members))}{self.taint_note(members)}",
                code=Code.NO_ROOM,
            )
            self.refused.add(key)
            return
        self.settle(key, members, Phase.BOUND, node, REASON_BOUND, code=Code.BOUND)
        self.counts[Outcome.BOUND] += 1

    def rebind_choosing(self, key: SetKey, choices: Sequence[str]) -> None:
        """Rebind a Lost set with alternatives: with its new members where their budget
        allows, else alone (no budget check: it already counts), first choice first."""
        members = self.members(key)
        held = [d for d in members if d.held]
        fresh = [d for d in members if d.phase is Phase.PENDING] if not disagreement(members) else []
        if fresh:
            node, choice, notes = self.place_choosing(key, held + fresh, choices, budget=True)
            if node is not None:
                rebound = f"rebound: {REASON_BOUND}{placed_as(choice, notes)}"
                self.settle(key, held, Phase.BOUND, node, rebound, choice, code=Code.REBOUND)
                self.settle(
                    key, fresh, Phase.BOUND, node, REASON_BOUND + placed_as(choice, notes), choice, code=Code.BOUND
                )
                self.counts[Outcome.BOUND] += 1
                return
        node, choice, notes = self.place_choosing(key, held, choices)
        if node is None:
            if not any(d.reason_code == Code.LOST for d in held):
                why = f"lost: none of the set's classes has a node with room for it: {passed_over(notes)}"
                self.with_reason(key, (d.name for d in held), why, code=Code.LOST)
            if key not in self._lost_now:
                self.refused.add(key)
            return
        rebound = f"rebound: {REASON_BOUND}{placed_as(choice, notes)}"
        self.settle(key, held, Phase.BOUND, node, rebound, choice, code=Code.REBOUND)
        self.counts[Outcome.BOUND] += 1
        if fresh:
            why = f"pending: no room for new members next to the set on {node}"
            self.with_reason(key, (d.name for d in fresh), why, code=Code.NO_ROOM)
            self.grow(key, allow_move=False)

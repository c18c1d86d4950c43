"""How a pass handles sets whose devices accept several classes.

An order with alternatives binds as the first of its classes with room and budget; a
held set keeps the class it is held as while a launcher runs its VM, and its new members
join as that class. These are the pass's methods for it, on top of :class:`PassState` (how the layers of a
pass fit together: ``binder.engine.placement._Pass``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from binder.engine.choices import (
    choices_of,
    disagreement,
    has_alternatives,
    passed_over,
    placed_as,
    reclassed,
)
from binder.engine.fit import describe_units
from binder.engine.ledger_records import SetKey
from binder.engine.pass_state import REASON_BOUND, PassState
from binder.engine.reasons import Code
from binder.engine.types import (
    Device,
    Outcome,
    Phase,
)


class ChoosingPass(PassState):
    """A pass's working state with the rules for sets that accept several classes."""

    def launcher_holds(self, key: SetKey) -> bool:
        """Whether a launcher pod that has not finished runs the set's VM: it asked for
        the raw resource of the class the set is held as, so the set keeps that class."""
        return any(not pod.finished for pod, _ in self.ledger.launcher_pods.get(key, ()))

    def join_as_held(
        self, key: SetKey, members: tuple[Device, ...], held: Sequence[Device]
    ) -> tuple[tuple[Device, ...], str] | None:
        """New members of a held set with alternatives join as the class it is held as:
        ``members`` with them re-classed, and that class ("" when nothing changes). None
        when they list other choices than the rest: they wait, saying so."""
        if not held or len(held) == len(members) or not has_alternatives(members):
            return members, ""
        pending = {d.name for d in members if d.phase is Phase.PENDING}
        held_as = self.joining_class(key, members)
        if held_as:
            return reclassed(members, pending, held_as), held_as
        differ = disagreement(members)
        if differ:
            self.with_reason(key, pending, f"pending: {differ}", code=Code.CHOICES_DIFFER)
            return None
        return members, ""

    def joining_class(self, key: SetKey, members: Sequence[Device]) -> str:
        """The class new members of a held set with alternatives join as: the one the set
        is held as. Empty for a set without alternatives, or one held as several classes
        (a write that failed half way) or whose members list different choices."""
        if not has_alternatives(members) or disagreement(members):
            return ""
        held = {d.class_name for d in members if d.held}
        return next(iter(held)) if len(held) == 1 else ""

    def move_choices(self, key: SetKey) -> tuple[str, ...] | None:
        """The classes a held set with alternatives may take when it moves, is gathered or
        is rebound, in order; None for a set without alternatives (the single-class rules).

        A set whose launcher runs, or whose members list different choices, keeps the
        class it is held as.
        """
        members = self.members(key)
        if not has_alternatives(members):
            return None
        held = sorted({d.class_name for d in members if d.held})
        if disagreement(members) or self.launcher_holds(key):
            return (held[0],) if len(held) == 1 else None
        return choices_of(members[0])

    def place_choosing(
        self,
        key: SetKey,
        moving: Sequence[Device],
        choices: Sequence[str],
        *,
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
        budget: bool = False,
    ) -> tuple[str | None, str, list[tuple[str, str]]]:
        """The first of ``choices`` with a node that has room for ``moving`` booked as
        that class (and, with ``budget``, that the tenant's budget allows), and the
        fullest such node: (node, class, the classes passed over with why). The node is
        None when no choice fits."""
        notes: list[tuple[str, str]] = []
        names = {d.name for d in moving}
        for choice in choices:
            if choice not in self.classes:
                notes.append((choice, f"class {choice} does not exist"))
                continue
            members = reclassed(self.members(key), names, choice)
            as_choice = [d for d in members if d.name in names]
            if budget:
                refusal = self.held_refusal(key, members, names)
                if refusal:
                    notes.append((choice, refusal))
                    continue

            def placed_on(n: str, m: tuple[Device, ...] = members) -> tuple[Device, ...]:
                return self.bound_on(m, n, names)

            node = self.best_node(key, placed_on, as_choice, exclude=exclude, prefer=prefer)
            if node is not None:
                return node, choice, notes
            units = describe_units(self.units(as_choice))
            notes.append((choice, f"no {choice} node has room for {units}{self.taint_note(as_choice)}"))
        return None, "", notes

    def bind_choosing(self, key: SetKey, members: Sequence[Device]) -> None:
        """Bind a new order whose members list alternatives: the first choice with room
        and budget, else Pending saying why for every choice."""
        names = {d.name for d in members}
        differ = disagreement(members)
        if differ:
            self.with_reason(key, names, f"pending: {differ}", code=Code.CHOICES_DIFFER)
            self.refused.add(key)
            return
        node, choice, notes = self.place_choosing(key, members, choices_of(members[0]), budget=True)
        if node is None:
            why = f"pending: none of the set's classes can take it: {passed_over(notes)}"
            self.with_reason(key, names, why, code=Code.NO_CHOICE_FITS)
            self.refused.add(key)
            return
        self.settle(key, members, Phase.BOUND, node, REASON_BOUND + placed_as(choice, notes), choice, code=Code.BOUND)
        self.counts[Outcome.BOUND] += 1

"""Lending: idle GPUs lent beyond budgets, taken back only while the borrowing VM is stopped.

A budget's ``borrowing`` lets a tenant hold more than its limit on GPUs that no entitled
set (a Lost set, or an order within its budget) is waiting for. The binder never evicts a
running VM to get them back: it marks the borrowed sets a waiting set needs
(``reclaim_for``) and releases each one only in a pass that sees its VM not running, by
the launcher rule every consumer shares (:func:`binder.engine.launcher.launcher_of`,
through the ledger's launcher pods). :class:`Lending` holds these rules; a pass holds one
and hands it its working state, as Kueue's scheduler holds its preemptor. A cluster whose
budgets name no borrowing and whose devices hold nothing borrowed never reaches them, so
its decisions are those of a pass without lending.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

from binder.engine.choices import choices_of, disagreement, has_alternatives, reclassed, spec_class
from binder.engine.fit import borrow_terms, describe_overage, describe_units
from binder.engine.ledger_records import SetKey
from binder.engine.limits import class_units
from binder.engine.pass_placing import PlacingPass
from binder.engine.pass_state import REASON_BOUND
from binder.engine.reasons import Code
from binder.engine.types import Device, Outcome, Phase

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Where a waiting set's reason says which borrowed sets it waits to take back (its code
#: then says so: ``Code.WAITS_FOR_RECLAIM``).
RECLAIM_NOTE = "; waits for reclaim: "
#: How a released set's reason begins (``Code.RELEASED``).
RELEASED = "pending: released: "

#: A choice of a set: a class every member is booked as, or None: as the members are booked
#: (a set without alternatives, which may mix classes).
Choice = str | None


def set_id(key: SetKey) -> str:
    """``<namespace>/<vm>``: how ``status.reclaimFor`` and the reasons name a set."""
    return f"{key[0]}/{key[1]}"


class Lending:
    """The lending rules, over the working state of the pass that holds them.

    A pass holds one (``binder.engine.placement._Pass.lender``) and hands it its working
    state, a :class:`~binder.engine.pass_placing.PlacingPass`, when it is built: the rules
    read and change sets through that state (the ledger, the fullest node with room,
    settling a set, placing an order or a Lost set) and keep only what lending itself
    learns in a pass (the sets it released, what entitled sets waited for at the start).
    Nothing here calls back into the steps of a pass, so the rules can be run, and tested,
    over a bare :class:`PlacingPass`.
    """

    def __init__(self, run: PlacingPass) -> None:
        #: The pass's working state: every read and change of a set goes through it.
        self.run = run
        #: Resources entitled sets waited for at the start of the pass (worked out on first use).
        self._waiting_start: set[str] | None = None
        #: Sets released in this pass: not placed again in it.
        self.released_now: set[SetKey] = set()
        #: Released sets and the set their GPUs were taken back for (an answer's refusal names it).
        self.released_for: dict[SetKey, str] = {}
        #: Whether the pass sees every unsettled set (a full pass) or only requested ones.
        self.whole_view = True
        #: Nodes chosen for a waiting set in this pass (reclaim's marks): making room takes
        #: none of them, and sends no set there.
        self.chosen: set[str] = set()
        self._allocatable_memo: dict[tuple[int, str], int] = {}

    @property
    def active(self) -> bool:
        """Lending rules apply: some budget names a borrowing, or some set holds borrowed GPUs."""
        return self.run.lending

    # -- reading -------------------------------------------------------------------------

    def vm_running(self, key: SetKey) -> bool:
        """The set's VM runs: a pod that counts as its VMI's launcher (the shared reader's
        rule, through the ledger) is in a phase other than Succeeded or Failed."""
        return self.run.launcher_holds(key)

    def set_choices(self, key: SetKey, members: Sequence[Device]) -> tuple[Choice, ...]:
        """The choices of a set, in order: its classes when it lists alternatives, else None
        (as booked). A held set keeps its class while its launcher runs."""
        if has_alternatives(members):
            if disagreement(members):
                return ()
            if any(d.held for d in members):
                moving = self.run.move_choices(key)
                return tuple(moving) if moving else ()
            return choices_of(members[0])
        return (None,)

    def as_choice(self, members: tuple[Device, ...], names: set[str], choice: Choice) -> tuple[Device, ...]:
        return members if choice is None else reclassed(members, names, choice)

    def within_budget(self, key: SetKey, members: tuple[Device, ...], names: set[str]) -> bool:
        return self.run.held_refusal(key, members, names) is None

    def borrow_check(
        self, key: SetKey, members: tuple[Device, ...], names: set[str]
    ) -> tuple[str | None, dict[str, tuple[int, int, int]]]:
        """:func:`borrow_terms` of making the ``names`` members of ``members`` held."""
        run = self.run
        ledger = run.ledger
        if key in ledger.launcher_pods:
            more = ledger.used_delta(key, run.bound_on(members, "-", names))
        else:
            more = ledger.used_delta_from(key, class_units(members, run.classes, names))
        return borrow_terms(ledger, run.limits(key[0]), key, more)

    def waits_for(self, key: SetKey, moving: Sequence[Device], *, room_checked: bool = False) -> set[str]:
        """The resources ``moving`` (members of ``key``, booked as one choice) waits for room
        of: some node eligible for it has allocatable at least its units of the resource, but
        none has free room for the set (``room_checked``: the caller just found none)."""
        run = self.run
        need = run.units(moving)
        if not need or (not room_checked and run.place(key, moving) is not None):
            return set()
        eligible = run.eligible_nodes(moving)
        found = set()
        for resource, units in need.items():
            if self._most_allocatable(eligible, resource) >= units:
                found.add(resource)
        return found

    def _most_allocatable(self, eligible: set[str], resource: str) -> int:
        """The most allocatable units of ``resource`` on one of ``eligible`` (the node cache's
        set, the same object while nodes do not change): worked out once per pass."""
        key = (id(eligible), resource)
        most = self._allocatable_memo.get(key)
        if most is None:
            most = max((self.run.nodes[n].allocatable.get(resource, 0) for n in eligible), default=0)
            self._allocatable_memo[key] = most
        return most

    def entitled_waits(self, key: SetKey, *, room_checked: bool = False) -> set[str]:
        """What an unplaced entitled set waits for room of, judged now: a Lost set that is
        not borrowed (every choice), or an order for each choice within its budget.
        ``room_checked``: the pass just tried to place it and found no room."""
        run = self.run
        members = run.members(key)
        if not members or key in self.released_now:
            return set()
        held = [d for d in members if d.held]
        lost = bool(held) and all(d.phase is Phase.LOST for d in held)
        order = not held
        if not (lost and not any(d.borrowed for d in held)) and not order:
            return set()
        names = {d.name for d in (held if lost else members)}
        found: set[str] = set()
        for choice in self.set_choices(key, members):
            if choice is not None and choice not in run.classes:
                continue
            as_choice = self.as_choice(members, names, choice)
            if any(d.class_name not in run.classes for d in as_choice if d.name in names):
                continue
            if order and not self.within_budget(key, as_choice, names):
                continue
            found |= self.waits_for(key, [d for d in as_choice if d.name in names], room_checked=room_checked)
        return found

    def waiting_at_start(self) -> set[str]:
        """Resources entitled sets waited for at the start of the pass (step 2 and answer
        passes judge borrowing against these)."""
        run = self.run
        if self._waiting_start is None:
            keys: Iterable[SetKey] = run.set_keys() if self.whole_view else sorted(run.ledger.set_keys())
            found: set[str] = set()
            for key in keys:
                found |= self.entitled_waits(key)
            self._waiting_start = found
        return self._waiting_start

    def lost_sets(self) -> list[SetKey]:
        """The sets held Lost whole and not borrowed, oldest Lost first."""
        run = self.run
        lost: list[tuple[datetime, SetKey]] = []
        for key in run.set_keys():
            held = [d for d in run.members(key) if d.held]
            if held and all(d.phase is Phase.LOST and not d.borrowed for d in held):
                lost.append((min(d.since or _EPOCH for d in held), key))
        return [key for _, key in sorted(lost)]

    # -- changing ------------------------------------------------------------------------

    def lend(
        self, key: SetKey, *, borrowed: bool, mark: str, reason: str | None = None, code: str | None = None
    ) -> None:
        """Set the set's borrowed flag and mark (and, given, its reason and the reason's
        code) without moving it."""
        run = self.run
        members = run.members(key)
        if all(
            d.borrowed == borrowed
            and d.reclaim_for == mark
            and reason in (None, d.reason)
            and code in (None, d.reason_code)
            for d in members
        ):
            return
        run.apply(
            key,
            (
                d.placed(d.class_name, d.phase, d.node, d.since, d.reason if reason is None else reason,
                         borrowed=borrowed, reclaim_for=mark, reason_code=code)
                for d in members
            ),
        )  # fmt: skip

    def settle_lent(self, key: SetKey, members: Sequence[Device], node: str, reason: str, held_as: str) -> None:
        """:meth:`settle` of the whole set Bound on ``node`` as a borrowed set, in one change."""
        run = self.run
        run.refused.discard(key)
        run.apply(
            key,
            (
                d.placed(
                    held_as or d.class_name,
                    Phase.BOUND,
                    node,
                    run.now,
                    reason,
                    borrowed=True,
                    reclaim_for="",
                    reason_code=Code.BORROWED,
                )
                for d in members
            ),
        )

    def release(self, key: SetKey, why: str, made_room_for: str = "") -> None:
        """A borrowed set gives its GPUs back: Pending, no node, neither borrowed nor marked;
        not placed again in this pass."""
        run = self.run
        members = run.members(key)
        held_as = spec_class(members[0]) if has_alternatives(members) else ""
        run.settle(key, list(members), Phase.PENDING, "", RELEASED + why, held_as, code=Code.RELEASED)
        self.lend(key, borrowed=False, mark="")
        self.released_now.add(key)
        if made_room_for:
            self.released_for[key] = made_room_for

    # -- repaid (start of step 4) --------------------------------------------------------

    def repay(self) -> None:
        """Oldest borrowed set first: one that now fits its tenant's limits with the tenant's
        own usage stops being borrowed (its units join the own usage for the next).

        Tenants are independent (a repaid set moves only its tenant's own usage), so only
        tenants whose sets changed since repay last judged them, or whose budgets did, are
        judged (:attr:`Ledger.repay_due`): a tenant judged before kept only sets that did not
        fit, and with its usage and limits as they were, they still do not. The sets judged
        keep the order of every borrowed set by ``since``, so the decisions are those of
        judging every tenant."""
        run = self.run
        ledger = run.ledger
        due = ledger.repay_due
        judged = ledger.repay_judged
        default = run.settings.default_budget
        tenants: list[str] = []
        for namespace in ledger.lent_of:
            budgets = (default, tuple(run.budgets_by_ns.get(namespace, ())))
            if due is None or namespace in due or judged.get(namespace) != budgets:
                tenants.append(namespace)
                judged[namespace] = budgets
        lent_sets: list[tuple[datetime, SetKey]] = []
        for namespace in tenants:
            for key in ledger.lent_of[namespace]:
                members = run.members(key)
                if members and all(d.phase is Phase.BOUND for d in members):
                    lent_sets.append((min(d.since or _EPOCH for d in members), key))
        for _, key in sorted(lent_sets):
            units = ledger.borrowed_sets.get(key, {})
            limits = run.limits(key[0])
            if all(
                (limit := limits.limit(k)) is None or ledger.own_used(key[0], k) + n <= limit for k, n in units.items()
            ):
                node = run.members(key)[0].node
                self.lend(
                    key,
                    borrowed=False,
                    mark="",
                    reason=f"bound: repaid on {node}: the tenant's own usage now fits its limits with this set",
                    code=Code.REPAID,
                )
        ledger.repay_due = set()

    # -- step 4 with lending ------------------------------------------------------------

    def bind_orders(self, orders: Sequence[SetKey]) -> None:
        """Step 4 with lending: repay, then every within-budget order (oldest first), then
        the orders that may borrow, only onto room no entitled set still waits for; then
        reclaim for the entitled sets still waiting."""
        run = self.run
        self.repay()
        entitled: list[SetKey] = []
        borrowers: list[SetKey] = []
        for key in orders:
            if key in self.released_now:
                continue
            run.bind_order(key)
            if not all(d.phase is Phase.PENDING for d in run.members(key)):
                continue
            if self.entitled_order(key):
                entitled.append(key)
            if run.limits(key[0]).borrowing:
                # Its budgets lend: bind_borrowing judges its choices when its turn comes (usage
                # only grows until then, so a choice that may not borrow now never will here).
                borrowers.append(key)
        waiting: set[str] = set()
        for key in [*self.lost_sets(), *entitled]:
            # Each was just tried (step 3, or the orders above) and found no room.
            waiting |= self.entitled_waits(key, room_checked=True)
        for key in borrowers:
            if all(d.phase is Phase.PENDING for d in run.members(key)):
                self.bind_borrowing(key, waiting)
        self.reclaim(entitled)

    # -- step 4: borrowing orders --------------------------------------------------------

    def entitled_order(self, key: SetKey) -> bool:
        """An order within budget for at least one of its choices."""
        run = self.run
        members = run.members(key)
        names = {d.name for d in members}
        for choice in self.set_choices(key, members):
            if choice is not None and choice not in run.classes:
                continue
            as_choice = self.as_choice(members, names, choice)
            if all(d.class_name in run.classes for d in as_choice) and self.within_budget(key, as_choice, names):
                return True
        return False

    def borrow_choices(self, key: SetKey) -> list[tuple[Choice, dict[str, tuple[int, int, int]]]]:
        """The order's choices that may borrow now (over some limit, within limit plus
        borrowing on every such key), in preference order, with how far over each is."""
        run = self.run
        if not run.limits(key[0]).borrowing:
            return []  # the tenant's budgets lend it nothing
        members = run.members(key)
        names = {d.name for d in members}
        found = []
        for choice in self.set_choices(key, members):
            if choice is not None and choice not in run.classes:
                continue
            as_choice = self.as_choice(members, names, choice)
            if any(d.class_name not in run.classes for d in as_choice):
                continue
            refusal, over = self.borrow_check(key, as_choice, names)
            if refusal is None and over:
                found.append((choice, over))
        return found

    def bind_borrowing(self, key: SetKey, waiting: set[str]) -> bool:
        """Place the order ``key`` by borrowing: its borrowing choices in order, each only
        onto room of resources no entitled set waits for. True when placed."""
        run = self.run
        members = run.members(key)
        names = {d.name for d in members}
        notes = []
        for choice, _ in self.borrow_choices(key):
            as_choice = self.as_choice(members, names, choice)
            _, over = self.borrow_check(key, as_choice, names)  # usage moved since: judged now
            taken = sorted(set(run.units(as_choice)) & waiting)
            label = choice or "the set"
            if taken:
                notes.append(f"{label}: entitled sets wait for {', '.join(taken)}")
                continue

            def placed_on(n: str, m: tuple[Device, ...] = as_choice) -> tuple[Device, ...]:
                return run.bound_on(m, n, names)

            node = run.best_node(key, placed_on, as_choice)
            if node is None:
                notes.append(f"{label}: no node has room for {describe_units(run.units(as_choice))}")
                continue
            note = f", as {choice}" if choice is not None and has_alternatives(members) else ""
            reason = (
                f"{REASON_BOUND} (borrowed{note}: over its limits on {describe_overage(over)}; "
                "it may be taken back while its VM is not running)"
            )
            self.settle_lent(key, as_choice, node, reason, choice or "")
            run.counts[Outcome.BOUND] += 1
            return True
        if notes:
            first = run.members(key)[0]
            taken_back = self.released_for.get(key)
            extra = f"; its borrowed GPUs were taken back for {taken_back}" if taken_back else ""
            why = f"{first.reason}; could borrow, but {'; '.join(notes)}{extra}"
            run.with_reason(key, names, why, code=first.reason_code)  # still refused for the same reason
        return False

    # -- reclaim (after step 4) ----------------------------------------------------------

    def reclaim(self, waiting_orders: Sequence[SetKey]) -> None:
        """Each entitled set still waiting for room marks borrowed sets to take back (Lost
        sets first, then orders, each oldest first); marked sets whose VM is not running are
        released, and a waiting set whose marks are all released is placed. Marks no waiting
        set needs any more are dropped."""
        run = self.run
        waiting = [*self.lost_sets()]
        waiting.extend(k for k in waiting_orders if all(d.phase is Phase.PENDING for d in run.members(k)))
        marks: dict[SetKey, str] = {}
        chosen = self.chosen
        ready: list[SetKey] = []
        for key in waiting:
            plan = self.reclaim_plan(key, chosen, marks)
            if plan is None:
                continue
            node, taken = plan
            chosen.add(node)
            me = set_id(key)
            for other in taken:
                marks[other] = me
                self.lend(other, borrowed=True, mark=me)
            running = [o for o in taken if self.vm_running(o)]
            for other in taken:
                if other not in running:
                    self.release(other, f"its borrowed GPUs on {node} were taken back for {me}, which waited for "
                                 "them, while its VM was not running", made_room_for=me)  # fmt: skip
            if running:
                sets = ", ".join(set_id(o) for o in running)
                self._reclaim_note(key, f"{sets} on {node}, borrowed and marked for it, waits for its VM to stop")
            else:
                ready.append(key)
        for key in sorted(run.ledger.marked_sets - marks.keys()):
            self.lend(key, borrowed=True, mark="")
        for key in ready:
            held = [d for d in run.members(key) if d.held]
            if held:
                run.rebind(key)
            else:
                run.bind_order(key)

    def _reclaim_note(self, key: SetKey, note: str) -> None:
        """The waiting set's unplaced members' reason says which marked sets it waits for
        (``note``), and its code that it waits for reclaim.

        The note is added to a reason this pass wrote afresh, never cut out of an older
        one: a waiting order's reason was just written by binding it, and a Lost set's by
        rebinding it (which keeps only a reason whose code is ``Code.LOST``, never one with
        a note). A waiting set that no longer waits for reclaim so says nothing of it."""
        run = self.run
        for device in run.members(key):
            if device.phase is Phase.BOUND or device.reason_code == Code.WAITS_FOR_RECLAIM:
                continue
            run.with_reason(key, [device.name], device.reason + RECLAIM_NOTE + note, code=Code.WAITS_FOR_RECLAIM)

    def reclaim_plan(self, key: SetKey, chosen: set[str], marks: dict[SetKey, str]) -> tuple[str, list[SetKey]] | None:
        """The node and the borrowed sets (youngest first) whose release would make room for
        the waiting set ``key``: per choice in preference order, on every eligible node not
        chosen for an earlier waiting set, its borrowed sets of the choice's resources (a set
        whose members mix classes may need several) not marked for another set, until the
        node would have room for all of it; the node releasing the fewest units of those
        resources, then the fewest sets, then by name. A plan already marked for the set and
        still enough is kept. Borrowed sets come from the ledger's index
        (:attr:`Ledger.lent_on`: Bound whole on one node), kept as sets change."""
        run = self.run
        members = run.members(key)
        held = [d for d in members if d.held]
        names = {d.name for d in (held or members)}
        me = set_id(key)

        def free_for_me(other: SetKey) -> bool:
            if other in marks or other in self.released_now or other == key:
                return False
            mark = run.members(other)[0].reclaim_for
            return not mark or mark == me  # marked for another waiting set earlier: it stays so

        lent_on = run.ledger.lent_on
        for choice in self.set_choices(key, members):
            if choice is not None and choice not in run.classes:
                continue
            as_choice = self.as_choice(members, names, choice)
            if not held and not self.within_budget(key, as_choice, names):
                continue
            moving = [d for d in as_choice if d.name in names]
            need = dict(run.units(moving))
            if not need or all(resource not in lent_on for resource in need):
                continue
            plan = self._plan_on_nodes(me, need, run.eligible_nodes(moving), chosen, free_for_me)
            if plan is not None:
                return plan
        return None

    def _plan_on_nodes(
        self,
        me: str,
        need: dict[str, int],
        eligible: set[str],
        chosen: set[str],
        usable: Callable[[SetKey], bool],
    ) -> tuple[str, list[SetKey]] | None:
        """:meth:`reclaim_plan` for one choice: ``need`` (resource -> units) for the set ``me``."""
        run = self.run
        by_node = [run.ledger.lent_on.get(resource, {}) for resource in need]
        nodes = sorted({node for on in by_node for node in on if node in eligible and node not in chosen})
        best: tuple[int, int, str, list[SetKey]] | None = None
        for node in nodes:  # by name
            short = {r: units - run.ledger.free(node, r) for r, units in need.items()}
            lent = sorted({k for on in by_node for k in on.get(node, ()) if usable(k)})
            kept = [k for k in lent if run.members(k)[0].reclaim_for == me]
            if kept:
                kept_units = run.units(d for k in kept for d in run.members(k))
                if all(kept_units[r] >= units for r, units in short.items()):
                    return node, kept  # still enough: the marks stay as they are
            taken = self._youngest_until_room(lent, short)
            if taken is None:
                continue
            freed = run.units(d for k in taken for d in run.members(k))
            released = sum(freed[r] for r in need)
            if best is None or (released, len(taken), node) < best[:3]:
                best = (released, len(taken), node, taken)
        return (best[2], best[3]) if best is not None else None

    def _youngest_until_room(self, lent: Sequence[SetKey], short: dict[str, int]) -> list[SetKey] | None:
        """Borrowed sets from ``lent`` that hold a resource still ``short`` (resource -> units
        the node lacks), youngest first (latest ``since``; equal ``since`` by namespace, then
        VM name), until none is short; None when all of them do not free enough."""
        run = self.run
        short = {r: units for r, units in short.items() if units > 0}
        if not short:
            return None  # room already: nothing to take back for it here
        taken: list[SetKey] = []
        for other in sorted(lent, key=lambda k: (-_ts(run.members(k)), k[0], k[1])):
            units = run.units(run.members(other))
            if not any(units[r] for r in short):
                continue
            taken.append(other)
            for r in list(short):
                short[r] -= units[r]
                if short[r] <= 0:
                    del short[r]
            if not short:
                return taken
        return None

    # -- step 2: a borrowed set that cannot stay --------------------------------------------

    def move_borrowed(
        self,
        key: SetKey,
        held: Sequence[Device],
        placed: Callable[[str], str],
        lost: str,
        code: str,
        *,
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
    ) -> None:
        """A borrowed set that would move goes only onto room no entitled set waited for at
        the start of the pass (``placed(node)`` says so, of kind ``code``); else it is
        released (``lost`` says why it cannot stay), never sent to Lost (a Lost set would
        outrank entitled orders)."""
        run = self.run
        members = run.members(key)
        names = {d.name for d in held}
        waiting = self.waiting_at_start()
        for choice in self.set_choices(key, members):
            if choice is not None and choice not in run.classes:
                continue
            as_choice = self.as_choice(members, names, choice)
            moving = [d for d in as_choice if d.name in names]
            if set(run.units(moving)) & waiting:
                continue

            def placed_on(n: str, m: tuple[Device, ...] = as_choice) -> tuple[Device, ...]:
                return run.bound_on(m, n, names)

            node = run.best_node(key, placed_on, moving, exclude=exclude, prefer=prefer)
            if node is not None:
                run.settle(key, moving, Phase.BOUND, node, f"{placed(node)} (still borrowed)", choice or "", code=code)
                run.counts[Outcome.MOVED] += 1
                return
        self.release(key, f"{lost}; no room that no entitled set waits for, and a borrowed set is never sent to Lost")


def _ts(members: Sequence[Device]) -> float:
    return max((d.since or _EPOCH) for d in members).timestamp()

"""Making room: a stopped VM's set moves to another node so that a waiting set fits.

gpuplane keeps a VM's GPUs booked while the VM is stopped; scattered stopped sets then leave
no node with room for a big order while whole nodes' worth of units sit idle. A stopped VM runs
nothing, so its booking can move at no cost to anyone: its next start is pinned wherever its set
is then. After Reclaim, each entitled set still waiting for room (Lost sets first, then orders
within budget, each oldest first) for which Reclaim marked nothing may have the movable sets of
one node moved elsewhere, each to the fullest other node its VM's template allows, and is then
placed by the usual rules in the same pass (SPEC §4 "Making room").

A set is **movable** when no VMI of its VM's name exists, a ``VirtualMachine`` of that name does
(its template says where the VM may start), no member waits for an answer, the pass did not place
or move it, it was not admitted in the last ``GPUPLANE_MOVE_GRACE_SECONDS``, it is neither
borrowed nor marked (lending handles those) and no member is annotated
``gpuplane.io/keep-node: "true"``. At most ``GPUPLANE_MOVES_PER_PASS`` sets move in one pass;
a waiting set whose plan would go past that makes no room in that pass.

:class:`MakingRoom` is, like :class:`~binder.engine.lending.Lending`, an object the pass holds
and hands its working state (a :class:`~binder.engine.pass_placing.PlacingPass`): it reads and
changes sets through that state and never calls back into the steps of a pass, so it runs, and
is tested, over a bare working state too. Deterministic: nodes by name, sets by stable keys.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from binder.engine.fit import describe_units
from binder.engine.ledger_records import SetKey
from binder.engine.lending import Lending, set_id
from binder.engine.matching import term_matches
from binder.engine.pass_placing import PlacingPass
from binder.engine.reasons import Code
from binder.engine.types import Node, Outcome, Phase, Toleration, VirtualMachine

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The annotation that keeps a VM's set on its node (``Device.keep_node``).
KEEP_NODE_ANNOTATION = "gpuplane.io/keep-node"
#: Keys of :attr:`PassResult.counts` beside the outcomes: sets moved to make room, and waiting
#: sets whose plan the per-pass limit refused.
MADE_ROOM = "made_room"
ROOM_REFUSED = "room_refused"
#: Where a placed waiting set's reason names the moves that made its room.
ROOM_NOTE = "; room made by moving "
#: Where a waiting set's reason says the per-pass limit refused its plan.
LIMIT_NOTE = "; making room would move "


@dataclass(frozen=True, slots=True)
class Move:
    """One set of a plan: where it is and where it goes."""

    key: SetKey
    source: str
    destination: str


@dataclass(frozen=True, slots=True)
class Plan:
    """The moves that would make room for a waiting set on ``node``, in the order taken."""

    node: str
    moves: tuple[Move, ...]
    units: int
    """Units of the waiting set's resources the moves take off ``node``."""
    need: Counter[str]
    """What the waiting set needs on ``node`` (resource -> units)."""

    def describe(self) -> str:
        """``t1/a (to n2), t1/b (to n3) off n1``."""
        moved = ", ".join(f"{set_id(m.key)} (to {m.destination})" for m in self.moves)
        return f"{moved} off {self.node}"


def template_refusal(vm: VirtualMachine, node: Node, class_tolerations: Iterable[Toleration] = ()) -> str | None:
    """Why the VM's template would not let it start on ``node``, or None: its nodeSelector, its
    required node affinity (any term), and every NoSchedule/NoExecute taint tolerated by the
    template or by the set's class (the webhook adds the class's tolerations to the VMI)."""
    for label, value in sorted(vm.node_selector.items()):
        if node.labels.get(label) != value:
            return f"the VM's nodeSelector needs node label {label}={value}"
    if vm.affinity is not None and not any(term_matches(t, node) for t in vm.affinity):
        return "the VM's required node affinity does not match"
    tolerations = (*vm.tolerations, *class_tolerations)
    for taint in node.taints:
        if taint.blocks_new and not any(t.tolerates(taint) for t in tolerations):
            return f"node has taint {taint}, which the VM does not tolerate"
    return None


class MakingRoom:
    """The making-room rule, over the working state of the pass that holds it (beside its
    :class:`Lending`, whose terms it shares: entitled sets, what they wait for, reclaim's marks)."""

    def __init__(self, run: PlacingPass, lender: Lending) -> None:
        #: The pass's working state: every read and change of a set goes through it.
        self.run = run
        #: The lending rules of the same pass: who is entitled, what reclaim chose and marked.
        self.lender = lender
        #: Sets moved to make room in this pass (at most ``moves_per_pass``).
        self.moved: list[SetKey] = []
        #: Waiting sets whose plan the per-pass limit refused in this pass.
        self.refused: list[SetKey] = []
        #: Plans made in this pass, by the waiting set they made room for.
        self.plans: dict[SetKey, Plan] = {}
        self._vmi_keys: set[SetKey] | None = None
        self._vms: dict[SetKey, VirtualMachine] | None = None
        #: Plans looked for since the last move: (eligible nodes, need) -> plan or None. A
        #: second waiting set of the same shape finds what the first found (nothing moved).
        self._memo: dict[tuple[int, tuple[tuple[str, int], ...]], Plan | None] = {}

    # -- reading -------------------------------------------------------------------------

    def vm_of(self, key: SetKey) -> VirtualMachine | None:
        if self._vms is None:
            self._vms = {vm.key: vm for vm in self.run.virtual_machines}
        return self._vms.get(key)

    def has_vmi(self, key: SetKey) -> bool:
        if self._vmi_keys is None:
            self._vmi_keys = {(v.namespace, v.name) for v in self.run.vmis}
        return key in self._vmi_keys

    def movable(self, key: SetKey) -> str | None:
        """Why the set may not move to make room, or None when it may (every member Bound on
        one node; see the module doc)."""
        run = self.run
        members = run.members(key)
        if not members or any(d.phase is not Phase.BOUND for d in members) or len({d.node for d in members}) > 1:
            return "it is not Bound whole on one node"
        if self.has_vmi(key):
            return "its VM runs (a VMI exists)"
        if self.vm_of(key) is None:
            return "no VirtualMachine of its name says where it may start"
        if any(d.wants_answer for d in members):
            return "a bind request waits for an answer"
        if any(d.borrowed or d.reclaim_for for d in members):
            return "it is borrowed"
        if any(d.keep_node for d in members):
            return f'it is annotated {KEEP_NODE_ANNOTATION}: "true"'
        if any(d.class_name not in run.classes for d in members):
            return "a member's class does not exist"
        admitted = max((d.admitted for d in members if d.admitted is not None), default=None)
        grace = run.settings.move_grace_seconds
        if admitted is not None and (run.now - admitted).total_seconds() < grace:
            # Only the clock changes that: a pass after it may decide otherwise.
            wake = admitted + timedelta(seconds=grace)
            run.wake_at = wake if run.wake_at is None else min(run.wake_at, wake)
            return f"it was admitted less than {grace}s ago"
        if run.placed_in_pass(key):
            return "it was placed or moved in this pass"
        return None

    def waiting_sets(self) -> list[SetKey]:
        """Entitled sets still waiting for room, for which reclaim marked nothing: Lost sets
        first (oldest Lost first), then orders within budget (oldest first)."""
        run, lender = self.run, self.lender
        marked_for = {run.members(k)[0].reclaim_for for k in run.ledger.marked_sets if run.members(k)}
        orders: list[tuple[datetime, SetKey]] = []
        for key in run.set_keys():
            members = run.members(key)
            if members and all(d.phase is Phase.PENDING for d in members) and key not in lender.released_now:
                orders.append((min(d.created or _EPOCH for d in members), key))
        candidates = [*lender.lost_sets(), *(k for _, k in sorted(orders) if lender.entitled_order(k))]
        return [k for k in candidates if set_id(k) not in marked_for and lender.entitled_waits(k)]

    # -- the plan ------------------------------------------------------------------------

    def plan(self, key: SetKey) -> Plan | None:
        """The moves that would make room for the waiting set ``key``: for its choices in
        preference order (an order's within budget only), on every node eligible for the
        choice but for free room (not chosen for another waiting set in this pass, holding
        no set marked for reclaim), its movable sets of the choice's resources, youngest
        first, until it would have room, each with a destination; the node moving the fewest
        units, then the fewest sets, then by name. None when no node can be freed so."""
        run, lender = self.run, self.lender
        members = run.members(key)
        held = [d for d in members if d.held]
        names = {d.name for d in (held or members)}
        for choice in lender.set_choices(key, members):
            if choice is not None and choice not in run.classes:
                continue
            as_choice = lender.as_choice(members, names, choice)
            if any(d.class_name not in run.classes for d in as_choice if d.name in names):
                continue
            if not held and not lender.within_budget(key, as_choice, names):
                continue  # no set moves so that another may borrow
            moving = [d for d in as_choice if d.name in names]
            need = run.units(moving)
            if not need:
                continue
            eligible = run.eligible_nodes(moving)
            memo_key = (id(eligible), tuple(sorted(need.items())))
            if memo_key not in self._memo:
                self._memo[memo_key] = self._plan_on_nodes(dict(need), eligible)
            found = self._memo[memo_key]
            if found is not None:
                return found
        return None

    def _closed_nodes(self) -> set[str]:
        """Nodes no plan frees and no moved set goes to: chosen for a waiting set in this
        pass (by reclaim or here), or holding sets marked for reclaim."""
        run = self.run
        closed = set(self.lender.chosen)
        for key in run.ledger.marked_sets:
            closed |= {d.node for d in run.members(key) if d.phase is Phase.BOUND}
        return closed

    def _plan_on_nodes(self, need: dict[str, int], eligible: set[str]) -> Plan | None:
        run = self.run
        ledger = run.ledger
        closed = self._closed_nodes()
        best: tuple[int, int, str, Plan] | None = None
        for node in sorted(eligible - closed):
            allocatable = run.nodes[node].allocatable
            if any(allocatable.get(r, 0) < units for r, units in need.items()):
                continue  # never enough here, whatever moves
            short = {r: units - ledger.free(node, r) for r, units in need.items()}
            short = {r: n for r, n in short.items() if n > 0}
            if not short:
                continue  # room already: the set is not waiting for this node
            taken = self._youngest_until_room(node, short)
            if taken is None:
                continue
            moves = self._destinations(node, taken, closed)
            if moves is None:
                continue
            units = sum(run.units(d for k in taken for d in run.members(k))[r] for r in need)
            plan = Plan(node, moves, units, Counter(need))
            if best is None or (units, len(moves), node) < best[:3]:
                best = (units, len(moves), node, plan)
        return best[3] if best is not None else None

    def _youngest_until_room(self, node: str, short: dict[str, int]) -> list[SetKey] | None:
        """The node's movable sets holding a resource still short, youngest first (latest
        ``since``; equal ``since`` by namespace, then VM name), until none is short."""
        run = self.run
        candidates = []
        for key in run.ledger.sets_on.get(node, ()):
            units = run.units(run.members(key))
            if any(units[r] for r in short) and self.movable(key) is None:
                since = max(d.since or _EPOCH for d in run.members(key))
                candidates.append((-since.timestamp(), key[0], key[1], units))
        taken: list[SetKey] = []
        left = dict(short)
        for _, namespace, vm, units in sorted(candidates, key=lambda c: (c[0], c[1], c[2])):
            if not any(units[r] for r in left):
                continue
            taken.append((namespace, vm))
            for r in list(left):
                left[r] -= units[r]
                if left[r] <= 0:
                    del left[r]
            if not left:
                return taken
        return None

    def _destinations(self, source: str, taken: Sequence[SetKey], closed: set[str]) -> tuple[Move, ...] | None:
        """A destination for each of ``taken`` (leaving ``source``), in order, each judged
        with the ones before it; None when one has none."""
        extra: Counter[tuple[str, str]] = Counter()
        moves = []
        for key in taken:
            destination = self.destination(key, source, closed, extra)
            if destination is None:
                return None
            for r, units in self.run.units(self.run.members(key)).items():
                extra[(destination, r)] += units
            moves.append(Move(key, source, destination))
        return tuple(moves)

    def destination(
        self, key: SetKey, source: str, closed: set[str], extra: Mapping[tuple[str, str], int] | None = None
    ) -> str | None:
        """The fullest other node with room for the set ``key`` by step 4's rules for its held
        class, that its VM's template allows (nodeSelector, required node affinity, taints),
        not ``source`` nor ``closed``; ``extra``: units already planned onto nodes. Ties by name."""
        run = self.run
        members = run.members(key)
        vm = self.vm_of(key)
        if vm is None:
            return None
        need = run.units(members)
        eligible = run.eligible_nodes(members)
        tolerations = [t for name in sorted({d.class_name for d in members}) for t in run.classes[name].tolerations]
        planned = extra or {}
        planned_nodes = {n for (n, _), units in planned.items() if units}

        def allowed(name: str) -> bool:
            return (
                name in eligible
                and name != source
                and name not in closed
                and template_refusal(vm, run.nodes[name], tolerations) is None
            )

        def left(name: str) -> int | None:
            total = 0
            for r, units in need.items():
                after = run.ledger.free(name, r) - planned.get((name, r), 0) - units
                if after < 0:
                    return None
                total += after
            return total

        best: tuple[int, str] | None = None
        for name in sorted(planned_nodes):
            if allowed(name) and (room := left(name)) is not None and (best is None or (room, name) < best):
                best = (room, name)
        fewest = min(need, key=lambda r: (run.ledger.room_count(r, need[r]), r))
        for name in run.ledger.fullest_with_room(fewest, need[fewest]):
            if name in planned_nodes or not allowed(name):
                continue
            room = left(name)
            if room is not None and (best is None or (room, name) < best):
                best = (room, name)
                if len(need) == 1:
                    break  # one resource: the index's order is the fullest first
        return best[1] if best is not None else None

    # -- changing ------------------------------------------------------------------------

    def make_room(self) -> None:
        """Every waiting set in turn (:meth:`waiting_sets`): plan, and within the per-pass limit
        move the plan's sets to their destinations and place the waiting set."""
        run = self.run
        limit = run.settings.moves_per_pass
        if limit <= 0 or not run.virtual_machines:
            return  # off, or no stopped VM could move: a pass without VirtualMachines pays nothing
        for key in self.waiting_sets():
            if not self._still_waiting(key):
                continue
            plan = self.plan(key)
            if plan is None:
                continue
            if len(self.moved) + len(plan.moves) > limit:
                self.refused.append(key)
                run.counts[ROOM_REFUSED] += 1
                left = limit - len(self.moved)
                self._note(key, f"{LIMIT_NOTE}{len(plan.moves)} stopped VMs' sets ({plan.describe()}), more than "
                           f"the {left} of GPUPLANE_MOVES_PER_PASS={limit} left in this pass")  # fmt: skip
                continue
            self.apply(key, plan)

    def apply(self, key: SetKey, plan: Plan) -> None:
        """Move the plan's sets, each whole and keeping its held class, then place ``key``."""
        run = self.run
        me = set_id(key)
        for move in plan.moves:
            members = run.members(move.key)
            units = describe_units(plan.need)
            why = (
                f"moved from {move.source}: made room there for {me}, which waited for {units}; "
                "its VM is stopped (no VMI), so it will start where its set is now"
            )
            run.settle(move.key, list(members), Phase.BOUND, move.destination, why, code=Code.MADE_ROOM)
            run.counts[Outcome.MOVED] += 1
            run.counts[MADE_ROOM] += 1
            self.moved.append(move.key)
        self.lender.chosen.add(plan.node)
        self.plans[key] = plan
        run.room_plans[key] = tuple(m.key for m in plan.moves)
        self._memo.clear()
        held = [d for d in run.members(key) if d.held]
        if held:
            run.rebind(key)
        else:
            run.bind_order(key)
        placed = [d.name for d in run.members(key) if d.phase is Phase.BOUND]
        if placed:
            first = next(d for d in run.members(key) if d.phase is Phase.BOUND)
            note = ROOM_NOTE + plan.describe()
            if note not in first.reason:
                run.with_reason(key, placed, first.reason + note, code=first.reason_code)

    def _still_waiting(self, key: SetKey) -> bool:
        members = self.run.members(key)
        held = [d for d in members if d.held]
        if held:
            return all(d.phase is Phase.LOST for d in held)
        return bool(members)

    def _note(self, key: SetKey, note: str) -> None:
        """Add ``note`` to the reason of the waiting order's members (a reason this pass wrote
        afresh by binding it, as reclaim's note; the code stays). A Lost set keeps the first
        reason it went Lost for, so it gets no note."""
        run = self.run
        for device in run.members(key):
            if device.phase is not Phase.PENDING or device.reason.endswith(note):
                continue
            run.with_reason(key, [device.name], device.reason + note, code=device.reason_code)

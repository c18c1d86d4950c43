"""The binder's passes: where every GPU set lives, decided in one place.

The binder is the only writer of placement, and a pass sees the whole cluster at one
moment, so capacity and budget checks here cannot be raced past. The rules run in a
fixed order (restore sets, move sets off nodes that cannot keep them, rebind Lost sets,
bind new orders, answer bind requests) over sets sorted by stable keys, so the same
input always gives the same decisions. Each step changes whole sets only: step 1
first makes every set whole again, whatever a half-failed write left behind.

``full_pass`` and ``answer_pass`` take a :class:`Cluster` and return a
:class:`PassResult`; they never mutate their input and never do I/O.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

from binder.engine.accounting import Ledger
from binder.engine.choices import (
    passed_over,
    placed_as,
    spec_class,
)
from binder.engine.fit import (
    NodeCache,
)
from binder.engine.ledger_records import SetKey
from binder.engine.lending import Lending
from binder.engine.making_room import MakingRoom
from binder.engine.pass_placing import PlacingPass
from binder.engine.reasons import Code, refusal
from binder.engine.types import (
    Cluster,
    Device,
    Outcome,
    PassResult,
    Phase,
)

__all__ = ["ANSWER_BOUND", "ANSWER_REFUSED", "answer_pass", "full_pass", "try_order", "waiting_resources"]

#: Answer prefixes written to ``status.answer``; the webhook reads them.
ANSWER_BOUND = "bound:"
ANSWER_REFUSED = "refused:"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The reason code of a set a step placed, by how the step counts it.
_CODES = {Outcome.RESTORED: Code.RESTORED, Outcome.MOVED: Code.MOVED}


def full_pass(
    cluster: Cluster,
    ledger: Ledger | None = None,
    cache: NodeCache | None = None,
    scope: Iterable[SetKey] | None = None,
) -> PassResult:
    """Run every step of a full pass over the whole cluster.

    ``ledger``, when given, must be ``ledger_for(cluster)`` (a worker keeps one between
    passes instead of rebuilding it); the pass moves sets in it, so afterwards it is the
    ledger of the result. ``cache``, when given, is a :class:`NodeCache` the caller keeps
    between passes and replaces whenever a node or a class changes. ``scope``, when
    given, lists the sets the steps visit: it must hold every set that is not
    :func:`is_settled` (more does no harm), and the result is then the same as over
    every set, at the cost of the sets that can change.
    """
    run = _Pass(cluster, ledger, cache, scope)
    if cluster.settings.enabled:
        run.restore_sets()
        run.move_off_unfit_nodes()
        # Step 3, then the growth step 1 could not do yet. A growing set that moves whole
        # frees room on its old node: Lost sets get it first, then growth again. Each
        # round places a Pending or Lost device, so this ends; new orders come last, so
        # a second pass finds nothing left to place.
        run.rebind_lost_sets()
        while True:
            run.room_freed = False
            run.grow_sets()
            if not run.room_freed:
                break
            run.rebind_lost_sets()
        run.bind_orders()
        run.room.make_room()
        run.answer_requests(run.set_keys())
    return run.result()


def answer_pass(cluster: Cluster, ledger: Ledger | None = None, cache: NodeCache | None = None) -> PassResult:
    """Answer unanswered bind requests, placing only the requested sets; nothing else.

    With ``ledger`` (the ledger of the whole cluster, moved in place), ``cluster`` needs
    to hold only the requested sets (whole), their tenants' budgets, the nodes and the
    classes: booked units and usage come from the ledger (an answer pass reads only what
    it needs). ``cache`` as for :func:`full_pass`.
    """
    run = _Pass(cluster, ledger, cache)
    run.lender.whole_view = False
    if cluster.settings.enabled:
        keys = sorted({d.set_key for d in cluster.devices if d.wants_answer})
        for key in keys:
            run.settle_requested_set(key)
        run.answer_requests(keys)
    return run.result(with_status=False)


def try_order(cluster: Cluster, key: SetKey, ledger: Ledger | None = None) -> tuple[Device, ...]:
    """The members of the order ``key`` (all Pending, in ``cluster`` or in ``ledger``, which
    the pass changes) as binding new orders would place them now, with nothing else moved:
    the catalog's "would it fit, and as which class" answered by the binder's own rules
    (borrowing, as an answer pass would, only onto room no entitled set waits for)."""
    run = _Pass(cluster, ledger=ledger, scope=[key])
    lender = run.lender
    lender.whole_view = False
    if cluster.settings.enabled:
        waiting = lender.waiting_at_start() if run.lending else set()
        run.bind_order(key)
        if run.lending and all(d.phase is Phase.PENDING for d in run.members(key)) and lender.borrow_choices(key):
            lender.bind_borrowing(key, waiting)
    return run.members(key)


def waiting_resources(cluster: Cluster, ledger: Ledger | None = None) -> set[str]:
    """The resources entitled sets (Lost sets, orders within budget) wait for room of now:
    what a borrowing order may not take (the catalog's "what could be borrowed now")."""
    lender = Lending(PlacingPass(cluster, ledger=ledger))
    lender.whole_view = False
    return lender.waiting_at_start()


class _Pass(PlacingPass):
    """One pass: the steps, in order, over the working state, with the lending rules it holds.

    The one place that says how a pass is put together. Its working state is built in
    three storeys, each a module of its own, each adding methods over the same state and
    calling only the storeys below it:

    1. :class:`~binder.engine.pass_state.PassState` (``pass_state``): the cluster as read,
       the ledger, choosing the fullest node, changing a set, the result;
    2. :class:`~binder.engine.pass_choices.ChoosingPass` (``pass_choices``): placing a set
       that accepts several classes (``place_choosing``, ``bind_choosing``);
    3. :class:`~binder.engine.pass_placing.PlacingPass` (``pass_placing``): placing one
       set (``bind_order``, ``rebind``, ``grow``).

    On top, this class: the steps of a pass in order (restore, move, rebind, bind,
    answer) with ``gather``, ``relieve`` and ``move_off_unfit_nodes``. Beside it, making
    room (:class:`~binder.engine.making_room.MakingRoom`, :attr:`room`: moving stopped VMs'
    sets so a waiting set fits, after reclaim) is a second collaborator like lending, and the
    lending rules (:class:`~binder.engine.lending.Lending`, ``lending``: borrowing beyond
    a budget, repaying, reclaim marks and releases) are an object the pass holds
    (:attr:`lender`) and hands this working state, as Kueue's scheduler holds its
    preemptor: a reclaim places the set it freed room for through the storeys below
    (``rebind``, ``bind_order``) and never calls back into the steps.

    Why the storeys inherit and lending does not: every storey reads and writes the same
    working state (the devices, the ledger, the node cache, the notes) many times per set,
    on the hottest path of a pass, and none of them is useful alone; the lending rules are
    a concern of their own, reached only when some budget lends or some set borrows, and
    keep state of their own for a pass (what they released, what entitled sets waited
    for). Reading ``gather``: its step is here, placing is ``pass_placing`` and
    ``pass_choices``, the ledger and node choice are ``pass_state``.
    """

    def __init__(
        self,
        cluster: Cluster,
        ledger: Ledger | None = None,
        cache: NodeCache | None = None,
        scope: Iterable[SetKey] | None = None,
    ) -> None:
        super().__init__(cluster, ledger, cache, scope)
        #: The lending rules, over this pass's working state.
        self.lender = Lending(self)
        #: Making room (after reclaim, in full passes): moving stopped VMs' sets, beside lending.
        self.room = MakingRoom(self, self.lender)

    # -- step 1: restore sets ------------------------------------------------------------

    def restore_sets(self) -> None:
        for key in self.set_keys():
            self.release_classless(key)
            held = [d for d in self.members(key) if d.held]
            if len({(d.phase, d.node) for d in held}) > 1:
                self.gather(key)
            self.grow(key, allow_move=True, final=False)

    def grow_sets(self) -> None:
        """Retry growing sets whose new members step 1 could not place (before new orders)."""
        for key in self.set_keys():
            self.grow(key, allow_move=True)

    def release_classless(self, key: SetKey) -> None:
        """Devices whose class does not exist hold nothing and wait, Pending, saying why."""
        for device in self.members(key):
            if device.class_name in self.classes:
                continue
            if device.phase is Phase.PENDING and len(device.choices) > 1:
                continue  # its order's reason covers every choice
            missing = f"pending: class {device.class_name} does not exist"
            if device.phase is not Phase.PENDING:
                released = f"{missing}; the device's units were released"
                self.settle(key, [device], Phase.PENDING, "", released, spec_class(device), code=Code.CLASS_MISSING)
            elif device.reason_code != Code.CLASS_MISSING:
                self.with_reason(key, [device.name], missing, code=Code.CLASS_MISSING)

    def gather(self, key: SetKey) -> None:
        held = [d for d in self.members(key) if d.held]
        layout = sorted({d.node if d.phase is Phase.BOUND else "Lost" for d in held})
        split = f"it was split across {', '.join(layout)}"
        prefer: Counter[str] = Counter()
        for device in held:
            if device.phase is Phase.BOUND:
                prefer[device.node] += self.units([device]).total()
        self.place_or_lose(
            key,
            held,
            Outcome.RESTORED,
            lambda node: f"restored: set gathered onto {node} ({split})",
            f"no node has room for the whole set ({split})",
            prefer=prefer,
        )

    # -- step 2: move held sets off nodes that cannot keep them --------------------------

    def move_off_unfit_nodes(self) -> None:
        for key in self.set_keys():
            held = [d for d in self.members(key) if d.phase is Phase.BOUND]
            if held and len({d.node for d in held}) == 1:
                why = self.cannot_keep(held[0].node, held)
                if why:
                    self.move(key, held[0].node, why)
        # Over-booked nodes in name order, each judged when its turn comes (as a sweep of
        # every node would): a set moved off one node can leave its launcher pod booking
        # raw units on another.
        last = ""
        while True:
            later = [n for n in self.ledger.over_booked_nodes() if n > last and n in self.nodes]
            if not later:
                break
            last = later[0]
            self.relieve(last)

    def relieve(self, node: str) -> None:
        """Evict the most recently bound sets from an over-booked node until it fits."""
        if not self.ledger.over_booked(node):
            return
        residents: list[tuple[datetime, SetKey]] = []
        for key in sorted(self.ledger.sets_on.get(node, ())):
            bound = [d for d in self.members(key) if d.phase is Phase.BOUND and d.node == node]
            if bound:
                residents.append((max(d.since or _EPOCH for d in bound), key))
        # First the sets whose leaving frees units here, newest first. A set whose VM's
        # launcher pod runs here frees nothing by leaving (the pod keeps booking its
        # units), so it is moved only if the devices alone still do not fit.
        for frees_units in (True, False):
            for _, key in sorted(residents, reverse=True):
                over = self.ledger.over_booked(node)
                if not over:
                    return
                held = [d for d in self.members(key) if d.held]
                holds = self.units(d for d in held if d.phase is Phase.BOUND and d.node == node)
                if not holds:
                    continue  # already moved
                vmi = self.live_vmi(key)
                starting = (vmi is not None and vmi.node in ("", node)) or self.admitted_recently(key)
                if frees_units and starting:
                    # Its VMI is pinned here: moving the set would leave the VMI pinned to a node
                    # its devices left, its launcher never to start anywhere. It stays, saying why
                    # (unless the node cannot hold its devices at all: the second round).
                    self.crowded(key, node, over)
                    continue
                lifted = tuple(
                    dataclasses.replace(d, phase=Phase.LOST, node="") if d.held else d for d in self.members(key)
                )
                delta = self.ledger.delta(key, lifted)
                allocatable = self.nodes[node].allocatable
                if frees_units:
                    if not any(delta.booked[(node, r)] < 0 for r in over):
                        continue
                else:
                    devices_over = {r for r in over if self.ledger.device_booked[node][r] > allocatable.get(r, 0)}
                    if not any(holds[r] for r in devices_over):
                        continue
                detail = ", ".join(
                    f"{r} allocatable {allocatable.get(r, 0)}, booked {self.ledger.booked[node][r]}" for r in over
                )
                self.move(key, node, f"node {node} is over-booked ({detail})", held=held)

    def crowded(self, key: SetKey, node: str, over: Iterable[str]) -> None:
        """Keep a set whose VMI is pinned to over-booked ``node``, its reason naming the raw usage
        its launcher waits for."""
        allocatable = self.nodes[node].allocatable
        detail = ", ".join(
            f"{r} allocatable {allocatable.get(r, 0)}, booked {self.ledger.booked[node][r]}" for r in sorted(over)
        )
        raw = {r: self.ledger.booked[node][r] - self.ledger.device_booked[node][r] for r in sorted(over)}
        why = (
            f"kept on {node}, which is over-booked ({detail}): its VMI {key[0]}/{key[1]} is pinned there, "
            "so moving the set would strand it"
        )
        if any(raw.values()):
            pods = ", ".join(f"{units} of {r}" for r, units in raw.items() if units)
            why += f"; pods asking kube-scheduler directly use {pods} there, and its launcher waits for them to end"
        names = [d.name for d in self.members(key) if d.phase is Phase.BOUND and d.node == node]
        self.with_reason(key, names, f"bound: {why}", code=Code.CROWDED)

    def move(self, key: SetKey, from_node: str, why: str, held: Sequence[Device] | None = None) -> None:
        held = list(held) if held is not None else [d for d in self.members(key) if d.held]
        self.place_or_lose(
            key,
            held,
            Outcome.MOVED,
            lambda _: f"moved from {from_node}: {why}",
            f"{why}; no other node has room for the set",
            exclude=[from_node],
        )

    def place_or_lose(
        self,
        key: SetKey,
        held: Sequence[Device],
        outcome: Outcome,
        placed: Callable[[str], str],
        lost: str,
        *,
        exclude: Iterable[str] = (),
        prefer: Counter[str] | None = None,
    ) -> None:
        """Put the held members of ``key`` on the best node (``placed(node)`` says so), or
        send them all to Lost (``lost`` says why: "lost: " comes first).

        A set with alternatives tries its choices in order (keeping its class when a
        launcher holds it): the first one with room wins. A borrowed set is never Lost
        (:meth:`Lending.move_borrowed`)."""
        if self.lending and any(d.borrowed for d in held):
            self.lender.move_borrowed(key, held, placed, lost, _CODES[outcome], exclude=exclude, prefer=prefer)
            return
        choices = self.move_choices(key)
        choice, notes = "", list[tuple[str, str]]()
        if choices is None:
            node = self.place(key, held, exclude=exclude, prefer=prefer)
        else:
            node, choice, notes = self.place_choosing(key, held, choices, exclude=exclude, prefer=prefer)
        if node is not None:
            self.settle(
                key, held, Phase.BOUND, node, placed(node) + placed_as(choice, notes), choice, code=_CODES[outcome]
            )
            self.counts[outcome] += 1
        else:
            why = f"lost: {lost}" + (f" ({passed_over(notes)})" if notes else "")
            self.settle(key, held, Phase.LOST, "", why, code=Code.LOST)
            self.counts[Outcome.LOST] += 1
            self._lost_now.add(key)

    # -- step 3: rebind Lost sets --------------------------------------------------------

    def rebind_lost_sets(self) -> None:
        lost: list[tuple[datetime, SetKey]] = []
        for key in self.set_keys():
            held = [d for d in self.members(key) if d.held]
            if held and all(d.phase is Phase.LOST for d in held):
                lost.append((min(d.since or _EPOCH for d in held), key))
        for _, key in sorted(lost):
            self.rebind(key)

    # -- step 4: bind new orders ---------------------------------------------------------

    def bind_orders(self) -> None:
        orders: list[tuple[datetime, SetKey]] = []
        for key in self.set_keys():
            members = self.members(key)
            if all(d.phase is Phase.PENDING for d in members):
                orders.append((min(d.created or _EPOCH for d in members), key))
        if not self.lending:
            for _, key in sorted(orders):
                self.bind_order(key)
            return
        self.lender.bind_orders([key for _, key in sorted(orders)])

    # -- answer pass ---------------------------------------------------------------------

    def settle_requested_set(self, key: SetKey) -> None:
        """Answer-pass placement of one requested set: no moves of held sets."""
        members = self.members(key)
        held = [d for d in members if d.held]
        if len({(d.phase, d.node) for d in held}) > 1:
            return
        lender = self.lender
        if self.lending and held and any(d.reclaim_for for d in held) and not lender.vm_running(key):
            # A marked set whose VM starts again gives its GPUs to the set they were marked
            # for, and is placed as an order (borrowing only where nobody waits).
            mark = next(d.reclaim_for for d in held if d.reclaim_for)
            lender.waiting_at_start()  # judged before the release frees the room
            lender.release(key, f"its borrowed GPUs were taken back for {mark}, which waited for them", mark)
            held = []
        if held and held[0].phase is Phase.BOUND:
            self.grow(key, allow_move=False)
        elif held:
            self.rebind(key)
        else:
            self.bind_order(key)
            members = self.members(key)
            if self.lending and all(d.phase is Phase.PENDING for d in members) and lender.borrow_choices(key):
                lender.bind_borrowing(key, lender.waiting_at_start())

    # -- step 5: answer ------------------------------------------------------------------

    def answer_requests(self, keys: Iterable[SetKey]) -> None:
        for key in keys:
            members = self.members(key)
            if not any(d.wants_answer for d in members):
                continue
            nodes = {d.node for d in members}
            whole = all(d.phase is Phase.BOUND for d in members) and len(nodes) == 1
            answered = []
            for device in members:
                if device.wants_answer:
                    if whole:
                        answer = ANSWER_BOUND + device.node
                    elif len({(d.phase, d.node) for d in members if d.held}) > 1:
                        answer = (
                            ANSWER_REFUSED + "the set is split across nodes; the next full pass restores it; try again"
                        )
                    else:
                        answer = ANSWER_REFUSED + (_first_refusal(members) or "the set is not placed")
                    device = device.placed(
                        device.class_name,
                        device.phase,
                        device.node,
                        device.since,
                        device.reason,
                        answered_request=device.bind_request,
                        answer=answer,
                    )
                    self.answered.append(device.key)
                answered.append(device)
            self.apply(key, answered)


def _first_refusal(members: Iterable[Device]) -> str:
    for device in members:
        if device.phase is not Phase.BOUND and device.reason:
            return refusal(device)
    return ""

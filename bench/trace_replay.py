"""Replay a real GPU trace through the engine: how much capacity orders with alternatives fill.

Not a test: it prints figures for docs/benchmarks.md. The trace is Alibaba's
``cluster-trace-gpu-v2023`` (``bench/traces/alibaba-gpu-v2023``, see its SOURCE.md): a
node list (GPU model and count per node) and pod lists, a third of whose whole-GPU pods
name several GPU models they would accept.

    .venv/bin/python -m bench.trace_replay \\
        --nodes bench/traces/alibaba-gpu-v2023/openb_node_list_gpu_node.csv \\
        --pods bench/traces/alibaba-gpu-v2023/openb_pod_list_gpuspec33.csv --demand 0.9,1.0 --json

The whole-GPU tasks (``num_gpu >= 1`` and ``gpu_milli == 1000``) are taken in creation
order, the list copied again as often as needed until the GPUs they ask for reach each
demand level (a share of the nodes' GPUs). Each task is one order (one set of
``num_gpu`` one-unit devices) and goes through the real engine's ``full_pass``, with one
class per GPU model, one node per trace node and no budgets, in batches of about 1% of
capacity per pass (a worker keeps its ledger and node cache between passes, as the
binder does). Two modes: ``single_class`` (each task takes only the first model it names;
a task that names none gets one by a round robin weighted by capacity) and
``alternatives`` (the models it names, in that order; a task that names none accepts
every model, by name). Per level and mode it prints the share of GPU capacity
allocated, the tasks refused (still Pending at the end) and the engine time; with
``--json`` one JSON object as the last line.

``--time`` replays the trace in time instead, to measure making room (SPEC §4): each task
arrives at its creation time and runs for its own duration (``deletion_time`` less
``scheduled_time``); when it ends its VM stops, and a share of the VMs (``--kept``) keep their
set, Bound with no VMI, for a while (``--keep-for``: as long as the VM ran, or seconds) before
the order is deleted. The tasks of the trace's last days (``--window-days``) are copied back to
back (``--copies``; the first copy warms up, the last cools down) and their arrivals sped up
until the GPUs the orders would book, had each been placed on arrival, average each demand
level over the measured copies. The trace's pods would load all of its nodes only at a speed-up
where every VM still runs when the run ends, so the cluster is one node in ``--node-sample`` of
each shape. Simulated time is the engine's ``now`` (admission grace, ``since``). Each demand and
kept share runs twice, making room off and on, and prints for 8- and 4-GPU orders the share
placed and their wait (p50 / p99 of those placed), the GPUs allocated, the sets moved to make
room and per placed order, and the running VMs whose set moved: the bench exits 1 unless that
is 0 in every run.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import heapq
import io
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from binder.engine import Budget, Cluster, Device, GpuClass, Node, Phase, Pod, Settings, Vmi, full_pass, ledger_for
from binder.engine.accounting import Ledger
from binder.engine.fit import NodeCache
from binder.engine.making_room import MADE_ROOM, ROOM_REFUSED
from binder.engine.types import VirtualMachine

NAMESPACE = "trace"
MODES = ("single_class", "alternatives")
_START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Task:
    """One whole-GPU pod of the trace: how many GPUs and which models it names (maybe none)."""

    name: str
    gpus: int
    models: tuple[str, ...]
    created: int = 0
    """``creation_time`` in the trace (seconds)."""
    duration: int = 0
    """How long it ran in the trace: ``deletion_time`` less ``scheduled_time`` (less
    ``creation_time`` when it was never scheduled), at least 1 s."""


def _rows(path: Path) -> Iterator[dict[str, str]]:
    """CSV rows of ``path``, or of ``path.gz`` when only the compressed copy is stored."""
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    if path.suffix == ".gz":
        with gzip.open(path, "rt", newline="") as handle:
            yield from csv.DictReader(io.StringIO(handle.read()))
    else:
        with path.open(newline="") as handle:
            yield from csv.DictReader(handle)


def read_nodes(path: Path) -> list[tuple[str, str, int]]:
    """(node name, GPU model, GPUs) of every node with a GPU."""
    nodes = [(row["sn"], row["model"], int(row["gpu"])) for row in _rows(path)]
    return [n for n in nodes if n[2] > 0 and n[1]]


def read_tasks(path: Path, known: set[str]) -> list[Task]:
    """The whole-GPU tasks in creation order (file order breaks ties), models deduplicated
    in the order named; models no node has are dropped."""
    tasks: list[tuple[int, int, Task]] = []
    for index, row in enumerate(_rows(path)):
        gpus, milli = int(row["num_gpu"]), int(row["gpu_milli"])
        if gpus < 1 or milli != 1000:
            continue
        named = [m for m in (row.get("gpu_spec") or "").split("|") if m in known]
        models = tuple(dict.fromkeys(named))
        created = int(row.get("creation_time") or 0)
        started = int(row.get("scheduled_time") or created)
        duration = max(1, int(row.get("deletion_time") or started) - started)
        tasks.append((created, index, Task(row["name"], gpus, models, created, duration)))
    return [t for _, _, t in sorted(tasks, key=lambda t: (t[0], t[1]))]


def demand_list(tasks: Sequence[Task], target: int) -> list[tuple[str, Task]]:
    """Tasks in order, the list copied again as often as needed, until the GPUs asked for
    reach ``target``; each with a name unique across copies."""
    out: list[tuple[str, Task]] = []
    total, copy = 0, 0
    while total < target and tasks:
        for task in tasks:
            if total >= target:
                break
            out.append((f"{task.name}-c{copy}", task))
            total += task.gpus
        copy += 1
    return out


def weighted_round_robin(weights: dict[str, int]) -> Iterator[str]:
    """Smooth weighted round robin (deterministic): each name as often as its weight."""
    current = dict.fromkeys(weights, 0)
    total = sum(weights.values())
    while True:
        for name, weight in weights.items():
            current[name] += weight
        pick = max(sorted(current), key=lambda n: current[n])
        current[pick] -= total
        yield pick


def class_of(model: str) -> str:
    return model.lower()


def replay(
    nodes: Sequence[tuple[str, str, int]], orders: Sequence[tuple[str, Task]], mode: str
) -> tuple[dict[str, float | int], str]:
    """Run the orders through the engine in batches of ~1% of capacity; the figures, and a
    hash of where every order ended (two engines that place alike print the same one)."""
    capacity: dict[str, int] = defaultdict(int)
    for _, model, gpus in nodes:
        capacity[model] += gpus
    total = sum(capacity.values())
    models = sorted(capacity)
    classes = tuple(GpuClass(class_of(m), f"alibaba.com/{m}") for m in models)
    engine_nodes = tuple(Node(name, {f"alibaba.com/{model}": gpus}) for name, model, gpus in nodes)
    rr = weighted_round_robin({m: capacity[m] for m in models})
    every = tuple(class_of(m) for m in models)

    base = Cluster(now=_START, classes=classes, nodes=engine_nodes)
    ledger = ledger_for(base)
    cache = NodeCache()
    pending: set[tuple[str, str]] = set()
    batch_size = max(1, total // 100)
    engine_s = 0.0
    index = 0
    seq = 0
    while index < len(orders):
        asked = 0
        while index < len(orders) and (asked == 0 or asked + orders[index][1].gpus <= batch_size):
            vm, task = orders[index]
            index += 1
            asked += task.gpus
            if mode == "single_class":
                choices: tuple[str, ...] = ()
                first = class_of(task.models[0]) if task.models else class_of(next(rr))
            else:
                named = tuple(class_of(m) for m in task.models) or every
                first, choices = named[0], (named if len(named) > 1 else ())
            created = _START + timedelta(seconds=seq)
            seq += 1
            devices = tuple(
                Device(NAMESPACE, f"{vm}-g{i}", first, vm, created=created, choices=choices) for i in range(task.gpus)
            )
            ledger.commit((NAMESPACE, vm), devices)
            pending.add((NAMESPACE, vm))
        scope = sorted(pending)
        view = Cluster(
            now=_START + timedelta(seconds=seq),
            classes=classes,
            nodes=engine_nodes,
            devices=tuple(d for key in scope for d in ledger.devices(key)),
        )
        started = time.perf_counter()
        full_pass(view, ledger, cache, scope)
        engine_s += time.perf_counter() - started
        pending = {key for key in scope if any(d.phase is not Phase.BOUND for d in ledger.devices(key))}
    bound = sum(units for resource_units in ledger.device_booked.values() for units in resource_units.values())
    digest = hashlib.sha256()
    for key, _ in orders:
        for device in ledger.devices((NAMESPACE, key)):
            digest.update(f"{device.name} {device.phase} {device.node} {device.class_name} {device.reason}\n".encode())
    return {
        "allocated_pct": round(100.0 * bound / total, 2),
        "refused": len(pending),
        "engine_s": round(engine_s, 3),
    }, digest.hexdigest()[:16]


#: The lending run: tasks dealt to this many tenants; the even ones have budgets.
LENDING_TENANTS = 10


def _tenant(index: int) -> str:
    """Three tasks in four go to the limited (even) tenants, round robin, the fourth to an
    unlimited (odd) one: the limited half asks for more than its fair share while the others
    leave GPUs idle, which is when lending matters."""
    half = LENDING_TENANTS // 2
    if index % 4 == 3:
        return f"t{2 * ((index // 4) % half) + 1}"
    return f"t{2 * (index % half)}"


def lending_budgets(capacity: dict[str, int], borrowing: bool) -> tuple[Budget, ...]:
    """Half the tenants (the even ones) limited to their fair share of every model (its
    GPUs / tenants), with or without a borrowing allowance of the whole model beyond it."""
    limits = {class_of(m): units // LENDING_TENANTS for m, units in capacity.items()}
    lend = {class_of(m): units for m, units in capacity.items()} if borrowing else {}
    return tuple(Budget(_tenant(i), "fair-share", limits, lend) for i in range(0, LENDING_TENANTS, 2))


def _order(vm: str, ns: str, task: Task, first: str, created: datetime) -> tuple[Device, ...]:
    return tuple(Device(ns, f"{vm}-g{i}", first, vm, created=created) for i in range(task.gpus))


def _running(ledger: Ledger, key: tuple[str, str], phase: str) -> None:
    """Give set ``key`` a launcher pod in ``phase`` (Running: its VM runs; Succeeded: stopped)
    that its VMI's activePods names: what the binder reads through the shared launcher rule."""
    devices = ledger.devices(key)
    node = devices[0].node
    resource = ledger.classes[devices[0].class_name].resource_name
    uid = f"pod-{key[1]}"
    vmi = Vmi(key[0], key[1], f"vmi-{key[1]}", {uid: node}, node, "Running", tuple(d.name for d in devices))
    pod = Pod(key[0], f"virt-launcher-{key[1]}", uid, node, phase, {resource: len(devices)}, key[1])
    ledger.launcher_pods[key] = [(pod, vmi)]
    ledger.commit(key, devices)


def lending_replay(  # noqa: C901 - one bench run: the replay, then the burst, each a loop
    nodes: Sequence[tuple[str, str, int]],
    orders: Sequence[tuple[str, Task]],
    burst: Sequence[tuple[str, Task]],
    *,
    borrowing: bool,
    stop_every: int,
    passes: int,
) -> dict[str, float | int]:
    """The trace through the engine with budgets (single class, tasks dealt to tenants), in
    batches of ~1% of capacity; with ``borrowing``, then a burst of entitled orders (of the
    unlimited tenants) while the borrowed sets' VMs run, one in ``stop_every`` of those still
    running stopping before each pass, for at most ``passes`` passes."""
    capacity: dict[str, int] = defaultdict(int)
    for _, model, gpus in nodes:
        capacity[model] += gpus
    total = sum(capacity.values())
    models = sorted(capacity)
    classes = tuple(GpuClass(class_of(m), f"alibaba.com/{m}") for m in models)
    engine_nodes = tuple(Node(name, {f"alibaba.com/{model}": gpus}) for name, model, gpus in nodes)
    budgets = lending_budgets(dict(capacity), borrowing)
    rr = weighted_round_robin({m: capacity[m] for m in models})
    ledger = ledger_for(Cluster(now=_START, classes=classes, nodes=engine_nodes))
    cache = NodeCache()
    pending: set[tuple[str, str]] = set()
    batch_size = max(1, total // 100)
    seq = 0

    def run(now: datetime) -> None:
        scope = sorted(pending | set(ledger.borrowed_sets))
        view = Cluster(
            now=now,
            classes=classes,
            nodes=engine_nodes,
            devices=tuple(d for key in scope for d in ledger.devices(key)),
            budgets=budgets,
        )
        full_pass(view, ledger, cache, scope)
        pending.intersection_update({k for k in scope if any(d.phase is not Phase.BOUND for d in ledger.devices(k))})
        pending.update(k for k in scope if any(d.phase is not Phase.BOUND for d in ledger.devices(k)))

    started = time.perf_counter()
    index = 0
    while index < len(orders):
        asked = 0
        while index < len(orders) and (asked == 0 or asked + orders[index][1].gpus <= batch_size):
            vm, task = orders[index]
            first = class_of(task.models[0]) if task.models else class_of(next(rr))
            key = (_tenant(index), vm)
            index += 1
            asked += task.gpus
            seq += 1
            ledger.commit(key, _order(vm, key[0], task, first, _START + timedelta(seconds=seq)))
            pending.add(key)
        run(_START + timedelta(seconds=seq))
    bound = sum(units for resource_units in ledger.device_booked.values() for units in resource_units.values())
    lent_sets = sorted(ledger.borrowed_sets)
    figures: dict[str, float | int] = {
        "allocated_pct": round(100.0 * bound / total, 2),
        "refused": len(pending),
        "borrowed_sets": len(lent_sets),
        "borrowed_gpus": sum(len(ledger.devices(k)) for k in lent_sets),
    }
    if not borrowing:
        figures["engine_s"] = round(time.perf_counter() - started, 3)
        return figures
    # The burst: entitled orders of the unlimited tenants, while every borrowed VM runs.
    running = set(lent_sets)
    for key in lent_sets:
        _running(ledger, key, "Running")
    burst_keys = []
    for i, (vm, task) in enumerate(burst):
        first = class_of(task.models[0]) if task.models else class_of(next(rr))
        key = (_tenant(4 * i + 3), f"burst-{vm}")
        seq += 1
        ledger.commit(key, _order(key[1], key[0], task, first, _START + timedelta(seconds=seq)))
        pending.add(key)
        burst_keys.append(key)
    marked: set[tuple[str, str]] = set()
    released: set[tuple[str, str]] = set()
    used_passes = 0
    for number in range(1, passes + 1):
        used_passes = number
        if number > 1:
            # One in ``stop_every`` of the borrowed VMs still running stops (deterministic).
            for key in sorted(running)[:: max(1, stop_every)]:
                running.discard(key)
                if ledger.devices(key) and ledger.devices(key)[0].phase is Phase.BOUND:
                    _running(ledger, key, "Succeeded")
        was_lent = set(ledger.borrowed_sets)
        run(_START + timedelta(seconds=seq + number))
        marked |= {k for k in ledger.borrowed_sets if any(d.reclaim_for for d in ledger.devices(k))}
        released |= {
            k for k in was_lent if k not in ledger.borrowed_sets and ledger.devices(k)[0].phase is Phase.PENDING
        }
        if all(all(d.phase is Phase.BOUND for d in ledger.devices(k)) for k in burst_keys):
            break
    placed = [k for k in burst_keys if all(d.phase is Phase.BOUND for d in ledger.devices(k))]
    figures.update(
        burst_orders=len(burst_keys),
        burst_gpus=sum(len(ledger.devices(k)) for k in burst_keys),
        burst_placed=len(placed),
        burst_placed_gpus=sum(len(ledger.devices(k)) for k in placed),
        marked_sets=len(marked),
        reclaimed_sets=len(released),
        reclaimed_running=len(released - (set(lent_sets) - running)),
        burst_passes=used_passes,
        engine_s=round(time.perf_counter() - started, 3),
    )
    return figures


# -- the timed replay: making room for big orders among stopped VMs' sets ---------------------------

DAY = 86400
#: The sizes whose placement the timed replay reports.
REPORTED_SIZES = (8, 4)


def sample_nodes(nodes: Sequence[tuple[str, str, int]], every: int) -> list[tuple[str, str, int]]:
    """One node in ``every`` of each shape (model and GPU count), in file order, the first of each
    shape always: a smaller cluster with the same mix."""
    seen: Counter[tuple[str, int]] = Counter()
    out = []
    for node in nodes:
        shape = (node[1], node[2])
        if seen[shape] % every == 0:
            out.append(node)
        seen[shape] += 1
    return out


@dataclass(frozen=True, slots=True)
class TimedOrder:
    """One order of the timed replay: a trace task arriving at ``at`` (simulated seconds)."""

    vm: str
    task: Task
    at: float
    kept: bool
    """Whether its VM's set is kept (booked, stopped) after it ends, for ``keep`` seconds."""
    keep: float
    measured: bool
    """Arrived in a measured copy (neither the warm-up nor the cool-down): counted in the figures."""


def keeps(vm: str, share: float) -> bool:
    """Whether the VM named ``vm`` is one of the ``share`` kept after it ends: a hash of its name,
    so the same VMs are kept with making room off and on, and about ``share`` of them."""
    if share >= 1:
        return True
    draw = int.from_bytes(hashlib.sha256(vm.encode()).digest()[:8], "big") / 2**64
    return draw < share


def window_tasks(tasks: Sequence[Task], days: float, limit: int | None) -> tuple[list[Task], int, float]:
    """The tasks created in the trace's last ``days`` (before that its arrivals are sparse),
    ``limit`` of them taken evenly through it when given; the window's start and length (seconds,
    at least 1)."""
    first, last = min(t.created for t in tasks), max(t.created for t in tasks)
    start = max(first, last - round(days * DAY))
    chosen = [t for t in tasks if t.created >= start]
    if limit is not None and limit < len(chosen):
        chosen = [chosen[i * len(chosen) // limit] for i in range(limit)]
    return chosen, start, float(max(1, last - start))


def measured_copy(copy: int, copies: int) -> bool:
    """The first of several copies warms the cluster up and the last of three or more cools it
    down (its orders keep the load up while the measured ones still wait): neither counts."""
    return not (copies >= 2 and copy == 0) and not (copies >= 3 and copy == copies - 1)


def timed_orders(
    tasks: Sequence[Task], start: int, period: float, copies: int, scale: float, share: float, keep_for: float | None
) -> list[TimedOrder]:
    """``copies`` copies of the window back to back, its arrival times divided by ``scale``
    (durations as they are)."""
    out = []
    for copy in range(copies):
        measured = measured_copy(copy, copies)
        for task in tasks:
            vm = f"{task.name}-c{copy}"
            at = (copy * period + task.created - start) / scale
            kept = keeps(vm, share)
            keep = (float(task.duration) if keep_for is None else keep_for) if kept else 0.0
            out.append(TimedOrder(vm, task, at, kept, keep, measured))
    return out


def offered_demand(orders: Sequence[TimedOrder], begin: float, end: float, capacity: int) -> float:
    """The GPUs the orders would book on average over [begin, end] (running, then kept) had
    each been placed on arrival, as a share of ``capacity``."""
    if end <= begin:
        return 0.0
    booked = 0.0
    for order in orders:
        until = order.at + order.task.duration + order.keep
        overlap = min(until, end) - max(order.at, begin)
        if overlap > 0:
            booked += order.task.gpus * overlap
    return booked / (capacity * (end - begin))


@dataclass(frozen=True, slots=True)
class Timeline:
    """The orders of one timed run and the times that frame it (simulated seconds): the run
    ends at ``horizon``, the figures cover [``measure_from``, ``measure_to``]."""

    orders: list[TimedOrder]
    scale: float
    measure_from: float
    measure_to: float
    horizon: float
    demand: float


def timeline(
    tasks: Sequence[Task],
    capacity: int,
    *,
    demand: float,
    days: float,
    copies: int,
    share: float,
    keep_for: float | None,
    limit: int | None,
) -> Timeline:
    """The speed-up of the window's arrivals at which its tasks, copied ``copies`` times, offer
    ``demand`` over the measured copies (bisection: the offered demand grows with the speed-up)."""
    chosen, start, period = window_tasks(tasks, days, limit)
    first = 1 if copies >= 2 else 0
    last = copies - 1 if copies >= 3 else copies

    def at(scale: float) -> Timeline:
        orders = timed_orders(chosen, start, period, copies, scale, share, keep_for)
        begin, end = first * period / scale, last * period / scale
        offered = offered_demand(orders, begin, end, capacity)
        return Timeline(orders, scale, begin, end, copies * period / scale, offered)

    low, high = 1.0, 1.0
    while at(high).demand < demand:
        low, high = high, high * 2
        if high > 1e9:
            raise ValueError(
                f"demand {demand} is out of reach: the tasks never ask for that share of {capacity} GPUs at once"
            )
    while at(low).demand > demand and low > 1e-9:
        low /= 2
    for _ in range(40):
        middle = (low * high) ** 0.5
        if at(middle).demand < demand:
            low = middle
        else:
            high = middle
    return at(high)


def percentile(values: Sequence[float], share: float) -> float | None:
    """Nearest-rank percentile (``share`` in 0..1) of ``values``, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


class TimedReplay:
    """Orders arriving and ending in simulated time through the engine's full pass, which reads
    that time as ``now``.

    An order (one ``VirtualMachine`` and its set of one-GPU devices, each task's models as its
    choices) is placed by a pass; its VM then starts there (a VMI, the webhook admitting it at
    that pass) and runs for the task's duration. When it ends its VMI goes; a kept VM's set stays
    Bound with no VMI (a stopped VM) for its keep time, then the order is deleted, as is a VM not
    kept when it ends. A pass runs at most every ``pass_every`` simulated seconds, seeing every
    change since the one before: when something changed, or the last pass changed something, or
    a set's admission grace that held back a move has ended; never while no order waits."""

    def __init__(
        self,
        nodes: Sequence[tuple[str, str, int]],
        line: Timeline,
        settings: Settings,
        pass_every: float,
    ) -> None:
        capacity: dict[str, int] = defaultdict(int)
        for _, model, gpus in nodes:
            capacity[model] += gpus
        self.capacity = sum(capacity.values())
        models = sorted(capacity)
        self.classes = tuple(GpuClass(class_of(m), f"alibaba.com/{m}") for m in models)
        self.every = tuple(class_of(m) for m in models)
        self.nodes = tuple(Node(name, {f"alibaba.com/{model}": gpus}) for name, model, gpus in nodes)
        self.line = line
        self.settings = settings
        self.pass_every = pass_every
        self.ledger = ledger_for(Cluster(now=_START, classes=self.classes, nodes=self.nodes))
        self.cache = NodeCache()
        self.orders = {(NAMESPACE, o.vm): o for o in line.orders}
        self.pending: set[tuple[str, str]] = set()
        self.vms: dict[tuple[str, str], VirtualMachine] = {}
        self.vmis: dict[tuple[str, str], Vmi] = {}
        self.placed_at: dict[tuple[str, str], float] = {}
        self.events: list[tuple[float, int, str, tuple[str, str]]] = []
        self.seq = 0
        self.clock = 0.0
        self.wake: datetime | None = None
        #: GPUs held Bound, and of those the running VMs', now; their integrals over the measured time.
        self.booked = 0
        self.running = 0
        self.booked_seconds = 0.0
        self.running_seconds = 0.0
        #: Measured time: sets moved to make room, by the size of the set they made room for;
        #: plans the per-pass limit refused; orders placed.
        self.moves = 0
        self.moves_for: Counter[int] = Counter()
        self.plans_refused = 0
        self.placed_in_window = 0
        #: Running VMs whose set a pass moved, released or sent to Lost: must stay empty.
        self.running_moved: set[tuple[str, str]] = set()
        self.passes = 0
        self.engine_s = 0.0

    def measuring(self, now: float) -> bool:
        return self.line.measure_from <= now <= self.line.measure_to

    def _push(self, when: float, kind: str, key: tuple[str, str]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, key))

    def _arrive(self, order: TimedOrder) -> None:
        task = order.task
        named = tuple(class_of(m) for m in task.models) or self.every
        first, choices = named[0], (named if len(named) > 1 else ())
        created = _START + timedelta(seconds=order.at)
        devices = tuple(
            Device(NAMESPACE, f"{order.vm}-g{i}", first, order.vm, created=created, choices=choices)
            for i in range(task.gpus)
        )
        key = (NAMESPACE, order.vm)
        self.ledger.commit(key, devices)
        self.pending.add(key)
        self.vms[key] = VirtualMachine(NAMESPACE, order.vm)

    def _delete(self, key: tuple[str, str]) -> None:
        """The order is deleted: its devices and its VirtualMachine go."""
        if any(d.phase is Phase.BOUND for d in self.ledger.devices(key)):
            self.booked -= len(self.ledger.devices(key))
        self.ledger.commit(key, ())
        self.vms.pop(key, None)

    def _stop(self, key: tuple[str, str], when: float) -> None:
        """The task ended: its VM stops (the VMI goes); kept, its set stays for a while."""
        if self.vmis.pop(key, None) is not None:
            self.running -= self.orders[key].task.gpus
        order = self.orders[key]
        if order.kept:
            self._push(when + order.keep, "delete", key)
        else:
            self._delete(key)

    def _start(self, key: tuple[str, str], now: float) -> None:
        """The pass placed the order: its VM starts there, the webhook admitting its VMI now."""
        devices = self.ledger.devices(key)
        first = min(devices, key=lambda d: d.name)
        admitted = tuple(replace(d, admitted=_START + timedelta(seconds=now)) if d is first else d for d in devices)
        self.ledger.commit(key, admitted)
        names = tuple(d.name for d in devices)
        self.vmis[key] = Vmi(NAMESPACE, key[1], f"vmi-{key[1]}", {}, first.node, "Running", names)
        self.pending.discard(key)
        self.placed_at[key] = now
        self.booked += len(devices)
        self.running += len(devices)
        if self.measuring(now):
            self.placed_in_window += 1
        self._push(now + self.orders[key].task.duration, "stop", key)

    def _full_pass(self, now: float) -> bool:
        """One full pass at simulated time ``now``; whether it changed any set's placement."""
        scope = sorted(self.pending)
        view = Cluster(
            now=_START + timedelta(seconds=now),
            classes=self.classes,
            nodes=self.nodes,
            devices=tuple(d for key in scope for d in self.ledger.devices(key)),
            vmis=tuple(self.vmis.values()),
            settings=self.settings,
            virtual_machines=tuple(self.vms.values()),
        )
        started = time.perf_counter()
        result = full_pass(view, self.ledger, self.cache, scope)
        self.engine_s += time.perf_counter() - started
        self.passes += 1
        for change in result.changes:
            key = (change.namespace, change.vm_name)
            if key in self.vmis and (change.from_phase, change.from_node) != (change.to_phase, change.to_node):
                self.running_moved.add(key)
        if self.measuring(now):
            self.moves += result.counts.get(MADE_ROOM, 0)
            self.plans_refused += result.counts.get(ROOM_REFUSED, 0)
            for waiting, sets in result.room_plans.items():
                self.moves_for[self.orders[waiting].task.gpus] += len(sets)
        for key in scope:
            devices = self.ledger.devices(key)
            if devices and all(d.phase is Phase.BOUND for d in devices):
                self._start(key, now)
        self.wake = result.wake_at
        return bool(result.changes)

    def _advance(self, until: float) -> None:
        """Count the booked and running GPUs from the last tick to ``until``, in measured time."""
        begin = max(self.clock, self.line.measure_from)
        end = min(until, self.line.measure_to)
        if end > begin:
            self.booked_seconds += self.booked * (end - begin)
            self.running_seconds += self.running * (end - begin)
        self.clock = until

    def _next_tick(self, arrival: float | None, due: bool) -> float:
        """The next moment a pass may run: the first tick (a multiple of ``pass_every`` after
        the last) at or after the next arrival, end, deletion or wake, or right after the last
        pass when it changed something."""
        step = self.pass_every
        upcoming = [self.line.horizon + step]
        if arrival is not None:
            upcoming.append(arrival)
        if self.events:
            upcoming.append(self.events[0][0])
        if self.wake is not None and self.pending:
            upcoming.append((self.wake - _START).total_seconds())
        if due:
            upcoming.append(self.clock + step)
        return max(self.clock + step, math.ceil(min(upcoming) / step) * step)

    def run(self) -> dict[str, object]:
        started = time.perf_counter()
        arrivals = sorted(self.line.orders, key=lambda o: (o.at, o.vm))
        index, due = 0, False
        while True:
            tick = self._next_tick(arrivals[index].at if index < len(arrivals) else None, due)
            if tick > self.line.horizon:
                break
            self._advance(tick)
            while index < len(arrivals) and arrivals[index].at <= tick:
                self._arrive(arrivals[index])
                index += 1
            while self.events and self.events[0][0] <= tick:
                when, _, kind, key = heapq.heappop(self.events)
                if kind == "stop":
                    self._stop(key, when)
                else:
                    self._delete(key)
            due = bool(self.pending) and self._full_pass(tick)
        self._advance(self.line.horizon)
        return self.figures(time.perf_counter() - started)

    def figures(self, wall: float) -> dict[str, object]:
        span = max(1e-9, self.line.measure_to - self.line.measure_from)
        out: dict[str, object] = {
            "allocated_pct": round(100.0 * self.booked_seconds / (self.capacity * span), 2),
            "running_pct": round(100.0 * self.running_seconds / (self.capacity * span), 2),
        }
        measured = [(k, o) for k, o in self.orders.items() if o.measured]
        for size in REPORTED_SIZES:
            mine = [k for k, o in measured if o.task.gpus == size]
            waits = [self.placed_at[k] - self.orders[k].at for k in mine if k in self.placed_at]
            p50, p99 = percentile(waits, 0.5), percentile(waits, 0.99)
            out[f"gpu{size}"] = {
                "orders": len(mine),
                "placed": len(waits),
                "placed_pct": round(100.0 * len(waits) / len(mine), 1) if mine else None,
                "wait_p50_s": None if p50 is None else round(p50),
                "wait_p99_s": None if p99 is None else round(p99),
            }
        out.update(
            orders=len(measured),
            placed=sum(1 for k, _ in measured if k in self.placed_at),
            moves=self.moves,
            moves_per_placed=round(self.moves / self.placed_in_window, 4) if self.placed_in_window else 0.0,
            moves_for={str(size): n for size, n in sorted(self.moves_for.items())},
            plans_refused=self.plans_refused,
            waiting_at_end=len(self.pending),
            running_moved=len(self.running_moved),
            passes=self.passes,
            engine_s=round(self.engine_s, 2),
            wall_s=round(wall, 2),
        )
        return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=Path, required=True, help="node list CSV (sn, gpu, model)")
    parser.add_argument("--pods", type=Path, required=True, help="pod list CSV (num_gpu, gpu_milli, gpu_spec, ...)")
    parser.add_argument("--demand", default="0.9,1.0", help="comma-separated demand levels (share of GPU capacity)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    parser.add_argument(
        "--lending",
        action="store_true",
        help="also the lending run at demand 1.0: half the tenants at fair-share limits, with and without "
        "borrowing, then a burst of entitled orders reclaiming borrowed sets as their VMs stop",
    )
    parser.add_argument("--burst", type=float, default=0.1, help="lending: the burst's GPUs, a share of capacity")
    parser.add_argument(
        "--stop-every", type=int, default=5, help="lending: before each burst pass, 1 in N running borrowed VMs stops"
    )
    parser.add_argument("--burst-passes", type=int, default=30, help="lending: passes the burst may take at most")
    timed = parser.add_argument_group(
        "timed replay (--time)",
        "orders arrive and end in simulated time; ended VMs stop and a share keep their sets for a while; "
        "making room off and on side by side",
    )
    timed.add_argument(
        "--time", action="store_true", help="run the timed replay instead of the placement replay (not with --lending)"
    )
    timed.add_argument(
        "--kept",
        default="0.5,1.0",
        help="comma-separated shares of ended VMs whose sets are kept (default %(default)s)",
    )
    timed.add_argument(
        "--keep-for",
        default="ran",
        help="how long an ended VM's set is kept: 'ran' (as long as it ran; the default) or seconds",
    )
    timed.add_argument(
        "--copies",
        type=int,
        default=5,
        help="copies of the window back to back; the first warms up and the last cools down, neither counted "
        "(default %(default)s)",
    )
    timed.add_argument(
        "--node-sample",
        type=int,
        default=10,
        help="keep one node in N of each model and GPU count (the trace's tasks load a smaller cluster at a "
        "slower speed-up, so VMs run, stop and end many times over; default %(default)s)",
    )
    timed.add_argument(
        "--window-days",
        type=float,
        default=35.0,
        help="replay the tasks created in the trace's last N days (default %(default)s)",
    )
    timed.add_argument(
        "--pass-every",
        type=float,
        default=60.0,
        help="simulated seconds between full passes, at most (default %(default)s)",
    )
    timed.add_argument(
        "--limit", type=int, help="replay only N of the window's tasks, taken evenly (for trying it out)"
    )
    timed.add_argument(
        "--moves-per-pass",
        type=int,
        default=Settings().moves_per_pass,
        help="GPUPLANE_MOVES_PER_PASS with making room on (default %(default)s)",
    )
    timed.add_argument(
        "--move-grace",
        type=int,
        default=Settings().move_grace_seconds,
        help="GPUPLANE_MOVE_GRACE_SECONDS (default %(default)s)",
    )
    args = parser.parse_args(argv)
    tokens = [x.strip() for x in args.demand.split(",") if x.strip()]
    try:
        levels = [float(x) for x in tokens]
    except ValueError:
        parser.error(f"--demand must be comma-separated numbers, got {args.demand!r}")
    if not levels or any(level <= 0 for level in levels):
        parser.error("--demand needs at least one level above 0")
    options = timed_options(parser, args) if args.time else None
    nodes = read_nodes(args.nodes)
    if not nodes:
        parser.error(f"{args.nodes}: no node with a GPU")
    if options is not None and options.node_sample > 1:
        print(f"timed: one node in {options.node_sample} of each model and GPU count, of {len(nodes)}")
        nodes = sample_nodes(nodes, options.node_sample)
    tasks = read_tasks(args.pods, {model for _, model, _ in nodes})
    if not tasks:
        parser.error(f"{args.pods}: no whole-GPU task")
    capacity = sum(gpus for _, _, gpus in nodes)
    with_models = sum(1 for t in tasks if len(t.models) > 1)
    print(
        f"{len(nodes)} nodes, {capacity} GPUs; {len(tasks)} whole-GPU tasks "
        f"({sum(t.gpus for t in tasks)} GPUs), {with_models} naming several models"
    )
    if options is not None:
        try:
            out, moved = timed_run(nodes, tasks, list(zip(tokens, levels, strict=True)), options)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        if args.json:
            print(json.dumps(out, sort_keys=True))
        if moved:
            runs = ", ".join(f"{n} in {run}" for run, n in moved.items())
            parser.exit(1, f"{parser.prog}: error: running VMs' sets were moved, which must never happen: {runs}\n")
        return
    static_run(nodes, tasks, capacity, list(zip(tokens, levels, strict=True)), args)


def static_run(
    nodes: Sequence[tuple[str, str, int]],
    tasks: Sequence[Task],
    capacity: int,
    levels: Sequence[tuple[str, float]],
    args: argparse.Namespace,
) -> None:
    """The placement replay (each level, both modes), then the lending run when asked."""
    print(f"{'demand':>6}  {'mode':<13} {'allocated':>9} {'refused':>8} {'engine s':>9}  placement hash")
    figures: dict[str, dict[str, dict[str, float | int]]] = {}
    for token, level in levels:
        orders = demand_list(tasks, round(level * capacity))
        row: dict[str, dict[str, float | int]] = {}
        for mode in MODES:
            result, placed = replay(nodes, orders, mode)
            row[mode] = result
            print(
                f"{token:>6}  {mode:<13} {result['allocated_pct']:>8.2f}% {result['refused']:>8} "
                f"{result['engine_s']:>9.3f}  {placed}"
            )
        figures[token] = row
    out: dict[str, object] = dict(figures)
    if args.lending:
        out["lending"] = lending_run(nodes, tasks, capacity, args.burst, args.stop_every, args.burst_passes)
    if args.json:
        print(json.dumps(out, sort_keys=True))


@dataclass(frozen=True, slots=True)
class TimedOptions:
    """The timed replay's flags, checked."""

    kept: list[tuple[str, float]]
    keep_for: float | None
    copies: int
    days: float
    pass_every: float
    limit: int | None
    node_sample: int
    moves_per_pass: int
    move_grace: int


def timed_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TimedOptions:  # noqa: C901 - one check a flag
    """The timed replay's flags, or a clear argparse error."""
    if args.lending:
        parser.error("--time and --lending are separate runs: give one of them")
    tokens = [x.strip() for x in args.kept.split(",") if x.strip()]
    try:
        shares = [float(x) for x in tokens]
    except ValueError:
        parser.error(f"--kept must be comma-separated shares between 0 and 1, got {args.kept!r}")
    if not shares or any(not 0 <= s <= 1 for s in shares):
        parser.error(f"--kept must be comma-separated shares between 0 and 1, got {args.kept!r}")
    keep_for: float | None = None
    if args.keep_for != "ran":
        try:
            keep_for = float(args.keep_for)
        except ValueError:
            parser.error(f"--keep-for must be 'ran' or a number of seconds, got {args.keep_for!r}")
        if not math.isfinite(keep_for) or keep_for < 0:
            parser.error(f"--keep-for must be 'ran' or a number of seconds >= 0, got {args.keep_for!r}")
    if args.copies < 1:
        parser.error("--copies must be at least 1")
    if not args.window_days > 0:
        parser.error("--window-days must be above 0")
    if not args.pass_every > 0:
        parser.error("--pass-every must be above 0 seconds")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.node_sample < 1:
        parser.error("--node-sample must be at least 1 (1: every node)")
    if args.moves_per_pass < 1:
        parser.error("--moves-per-pass must be at least 1 (making room off is the other column of every row)")
    if args.move_grace < 0:
        parser.error("--move-grace must be 0 or more seconds")
    return TimedOptions(
        list(zip(tokens, shares, strict=True)),
        keep_for,
        args.copies,
        args.window_days,
        args.pass_every,
        args.limit,
        args.node_sample,
        args.moves_per_pass,
        args.move_grace,
    )


#: The two columns of every timed row: making room off (no set moves) and on.
ROOM_MODES = ("off", "on")


def _duration(seconds: float | None) -> str:
    """``45 s``, ``12 min``, ``3.4 h``; ``-`` for none."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _size_cell(figures: dict[str, object], size: int) -> str:
    row = figures[f"gpu{size}"]
    assert isinstance(row, dict)
    if not row["orders"]:
        return "-"
    return (
        f"{row['placed_pct']:.1f}% of {row['orders']}, wait "
        f"{_duration(row['wait_p50_s'])} / {_duration(row['wait_p99_s'])}"
    )


def timed_run(
    nodes: Sequence[tuple[str, str, int]],
    tasks: Sequence[Task],
    levels: Sequence[tuple[str, float]],
    options: TimedOptions,
) -> tuple[dict[str, dict[str, dict[str, object]]], dict[str, int]]:
    """Every demand level and kept share, making room off and on, printed; their figures, and the
    runs in which some running VM's set moved (how many; none ever should)."""
    capacity = sum(gpus for _, _, gpus in nodes)
    keep = "as long as it ran" if options.keep_for is None else f"{options.keep_for:g} s"
    counted = "all counted"
    if options.copies == 2:
        counted = "the first warms up, not counted"
    elif options.copies >= 3:
        counted = "the first warms up and the last cools down, neither counted"
    print(
        f"timed: the tasks created in the trace's last {options.days:g} days, {options.copies} "
        f"{'copy' if options.copies == 1 else 'copies back to back'} "
        f"({counted}), arrivals sped up to reach each demand, durations as in the trace; ended VMs' sets "
        f"kept for {keep}; a full pass at most every {options.pass_every:g} s; "
        f"GPUPLANE_MOVES_PER_PASS={options.moves_per_pass}, GPUPLANE_MOVE_GRACE_SECONDS={options.move_grace}"
    )
    header = (
        f"{'demand':>6} {'kept':>5} {'room':>4}  {'8-GPU placed, wait p50 / p99':<34} "
        f"{'4-GPU placed, wait p50 / p99':<34} {'alloc':>7} {'moves':>6} {'/placed':>7} {'run.moved':>9} {'wall s':>7}"
    )
    out: dict[str, dict[str, dict[str, object]]] = {}
    moved: dict[str, int] = {}
    for token, level in levels:
        out[token] = {}
        for kept_token, share in options.kept:
            line = timeline(
                tasks,
                capacity,
                demand=level,
                days=options.days,
                copies=options.copies,
                share=share,
                keep_for=options.keep_for,
                limit=options.limit,
            )
            per_copy = (line.horizon / options.copies) / 3600
            measured = [o for o in line.orders if o.measured]
            print(
                f"demand {token}, kept {kept_token}: {len(line.orders)} orders ({len(measured)} counted) over "
                f"{line.horizon / 3600:.1f} h simulated, arrivals x{line.scale:.1f} (a copy in {per_copy:.1f} h), "
                f"{sum(1 for o in line.orders if o.kept)} VMs kept after they end"
            )
            print(header)
            row: dict[str, object] = {
                "speed_up": round(line.scale, 3),
                "horizon_s": round(line.horizon),
                "measured_s": [round(line.measure_from), round(line.measure_to)],
                "offered_demand": round(line.demand, 4),
            }
            for room in ROOM_MODES:
                moves = options.moves_per_pass if room == "on" else 0
                settings = Settings(moves_per_pass=moves, move_grace_seconds=options.move_grace)
                replay_run = TimedReplay(nodes, line, settings, options.pass_every)
                figures = replay_run.run()
                row[room] = figures
                if replay_run.running_moved:
                    moved[f"demand {token} kept {kept_token} room {room}"] = len(replay_run.running_moved)
                print(
                    f"{token:>6} {kept_token:>5} {room:>4}  {_size_cell(figures, 8):<34} {_size_cell(figures, 4):<34} "
                    f"{figures['allocated_pct']:>6.2f}% {figures['moves']:>6} {figures['moves_per_placed']:>7.3f} "
                    f"{figures['running_moved']:>9} {figures['wall_s']:>7.1f}"
                )
            out[token][kept_token] = row
    return out, moved


def lending_run(
    nodes: Sequence[tuple[str, str, int]],
    tasks: Sequence[Task],
    capacity: int,
    burst: float,
    stop_every: int,
    passes: int,
) -> dict[str, dict[str, float | int]]:
    """The lending run at demand 1.0, printed, and its figures."""
    orders = demand_list(tasks, capacity)
    extra = [(f"b{i}", task) for i, (_, task) in enumerate(demand_list(tasks[::-1], round(burst * capacity)))]
    print(
        f"lending, demand 1.0: {LENDING_TENANTS} tenants, the even ones limited to a fair share of every model; "
        f"burst of {sum(t.gpus for _, t in extra)} GPUs ({len(extra)} entitled orders), 1 in {stop_every} running "
        f"borrowed VMs stopping before each pass"
    )
    result = {}
    for name, lend in (("without", False), ("with", True)):
        result[name] = lending_replay(nodes, orders, extra, borrowing=lend, stop_every=stop_every, passes=passes)
        row = result[name]
        print(
            f"  {name:<8} lending: {row['allocated_pct']:>6.2f}% allocated, {row['refused']} orders refused, "
            f"{row['borrowed_sets']} borrowed sets ({row['borrowed_gpus']} GPUs), {row['engine_s']:.3f} s"
        )
    lent = result["with"]
    print(
        f"  burst: {lent['burst_placed']}/{lent['burst_orders']} orders ({lent['burst_placed_gpus']}/"
        f"{lent['burst_gpus']} GPUs) placed in {lent['burst_passes']} passes; {lent['marked_sets']} borrowed sets "
        f"marked, {lent['reclaimed_sets']} reclaimed, {lent['reclaimed_running']} of them while running"
    )
    return result


if __name__ == "__main__":
    main()

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
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from binder.engine import Budget, Cluster, Device, GpuClass, Node, Phase, Pod, Vmi, full_pass, ledger_for
from binder.engine.accounting import Ledger
from binder.engine.fit import NodeCache

NAMESPACE = "trace"
MODES = ("single_class", "alternatives")
_START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Task:
    """One whole-GPU pod of the trace: how many GPUs and which models it names (maybe none)."""

    name: str
    gpus: int
    models: tuple[str, ...]


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
        tasks.append((int(row.get("creation_time") or 0), index, Task(row["name"], gpus, models)))
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
    args = parser.parse_args(argv)
    tokens = [x.strip() for x in args.demand.split(",") if x.strip()]
    try:
        levels = [float(x) for x in tokens]
    except ValueError:
        parser.error(f"--demand must be comma-separated numbers, got {args.demand!r}")
    if not levels or any(level <= 0 for level in levels):
        parser.error("--demand needs at least one level above 0")
    nodes = read_nodes(args.nodes)
    if not nodes:
        parser.error(f"{args.nodes}: no node with a GPU")
    tasks = read_tasks(args.pods, {model for _, model, _ in nodes})
    if not tasks:
        parser.error(f"{args.pods}: no whole-GPU task")
    capacity = sum(gpus for _, _, gpus in nodes)
    with_models = sum(1 for t in tasks if len(t.models) > 1)
    print(
        f"{len(nodes)} nodes, {capacity} GPUs; {len(tasks)} whole-GPU tasks "
        f"({sum(t.gpus for t in tasks)} GPUs), {with_models} naming several models"
    )
    print(f"{'demand':>6}  {'mode':<13} {'allocated':>9} {'refused':>8} {'engine s':>9}  placement hash")
    figures: dict[str, dict[str, dict[str, float | int]]] = {}
    for token, level in zip(tokens, levels, strict=True):
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

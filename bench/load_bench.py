"""Load the VMI admission webhook: 200 calls/s for 60 s, open loop.

Not a test: it prints a markdown table for docs/benchmarks.md. It generates the 10k-node
synthetic cluster of ``bench/cluster_bench.py`` into its own database
(``gpuplane_load_bench``, dropped at the end unless ``--keep``), runs one full pass to
settle it, then starts the real parts as subprocesses, as ``bench/webhook_bench.py``
does: the webhook server (``deploy/webhook_server.py``, granian, 2 workers x 16 threads,
the deployment default, plain HTTP on a free loopback port) and one Celery worker started with the
README's command (``celery -A gpuplane worker -Q binder --concurrency 1 -l info``) on
Redis database 12 under a key prefix of its own.

The load is OPEN LOOP: call ``i`` is due at ``start + i / rate`` on a fixed clock
(asyncio + aiohttp, one task per call, an unlimited connection pool with keep-alive),
whether or not earlier calls have answered, so slow answers never lower the offered
rate. Latency counts from the call's due time (a late send counts against the server,
not hidden), and every call gives up after 10 s, the webhook's ``timeoutSeconds``: the
kube-apiserver would fail the VMI CREATE then. The mix (of calls):

* ``bound`` (default 80%): a VMI naming the whole set of a random set Bound on one
  node, the common case on a busy cluster (a VM restart): the webhook answers with the
  pinning patch from the namespace's slice of the mirror, no binder involved;
* ``pending`` (default 10%): a new order, a Pending set of 1/2/4/8 devices
  (``cluster_bench.insert_sets``) in a tenant without a tight budget, inserted 0.2 s
  before its call (untimed; inserted earlier, a full pass would place it first): the
  webhook writes bind requests, queues an answer pass on the worker and waits for the
  answer (LISTEN/NOTIFY, up to ``GPUPLANE_BIND_WAIT_SECONDS`` = 8 s, then it denies
  with "try again");
* ``plain`` (the rest, 10%): a VMI naming no gpuplane devices (the captured fedora06
  naming ``nvidia.com/GA102GL_A10`` directly): allowed untouched, no query.

Reviews are the real AdmissionReview shape (``harness.factories.new_vmi`` / ``review``,
the Bound ones from ``webhook_bench.bound_bodies``). A progress line every 5 s.
Afterwards, once the worker is idle, the database is checked for double bookings with
the project's own ledger (``binder.mirror.read.read_cluster`` + ``binder.engine.ledger_for``):
no node's booked units above allocatable for any resource, every set whole (held
members share one phase and one node), every device once, and every allowed call's
pinned node the node its devices are Bound on.

    .venv/bin/python -m bench.load_bench                       # generate, load, check, drop
    .venv/bin/python -m bench.load_bench --keep                 # keep gpuplane_load_bench
    .venv/bin/python -m bench.load_bench --skip-generate --keep # reuse it
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import database_name, drop_database, ensure_database, pct, setup_django, wait_idle
from bench.servers import REDIS_URL, child_env, start_celery, start_server, stop
from bench.synth import SIZE_WEIGHTS, SIZES, bound_bodies, generate, generous_tenants, insert_sets

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/gpuplane_load_bench"
PREFIX = "loadbench-"  # vm names of every set and VMI this bench makes up
CASES = ("bound", "pending", "plain")
#: What a denial that a retry may cure says (the webhook's wording).
TRY_AGAIN = "try again"
#: Threads inserting the new orders' sets ahead of their calls.
INSERTERS = 4


# -- the real parts ------------------------------------------------------------------------


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    """The binder worker exactly as docs/operations.md runs it (prefork, one child), plus a node name.

    ``webhook_bench.start_worker`` runs the solo pool; this bench runs the documented command.
    """
    return start_celery(["--concurrency", "1", "-n", f"loadbench-{os.getpid()}@%h"], env, log)


def family(pid: int) -> list[int]:
    """``pid`` and its children (gunicorn's workers, the prefork pool's child)."""
    out = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (those still alive)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (every engineer's work)."""
    tick = os.sysconf("SC_CLK_TCK")
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / tick, sum(values) / tick


def postgres_pids(database: str) -> list[int]:
    """The PostgreSQL backends connected to ``database`` (by their process title)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("postgres: ") and f" {database} " in title:
                out.append(int(entry.name))
    return out


class Cpu:
    """CPU seconds per part over the run, from /proc: the webhook server and Celery process
    families, the PostgreSQL backends of this database, this process, and the machine as a
    whole (everyone's work). A thread samples every 0.5 s, so a backend that ends during
    the run (Django recycles connections after ``CONN_MAX_AGE``) still counts up to its
    last sample; one that starts during the run counts from zero."""

    def __init__(self, parts: dict[str, Callable[[], list[int]]]) -> None:
        self.parts = parts
        self.first: dict[int, float] = {}
        self.last: dict[str, dict[int, float]] = {name: {} for name in parts}
        self._sample(initial=True)
        self.bench = time.process_time()
        self.machine = machine_cpu()
        self.wall = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self, initial: bool = False) -> None:
        for name, pids in self.parts.items():
            for pid in pids():
                seconds = cpu_seconds([pid])
                if pid not in self.first:
                    self.first[pid] = seconds if initial else 0.0
                self.last[name][pid] = seconds

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def used(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall = time.monotonic() - self.wall
        out = {}
        for name, last in self.last.items():
            out[f"{name} (cores)"] = sum(seconds - self.first[pid] for pid, seconds in last.items()) / wall
        out["load generator (cores)"] = (time.process_time() - self.bench) / wall
        busy, total = machine_cpu()
        ours = sum(out.values())
        out["whole machine (cores)"] = (busy - self.machine[0]) / (total - self.machine[1]) * (os.cpu_count() or 1)
        out["everything else (cores)"] = max(0.0, out["whole machine (cores)"] - ours)
        return out


# -- the calls -----------------------------------------------------------------------------


@dataclass
class Call:
    case: str
    due: float  # loop time the call is due
    body: bytes
    uid: str
    key: tuple[str, str] = ("", "")  # (namespace, vm) of its set
    pending: int = 0  # devices of a Pending set to insert before the call
    sent: float = 0.0
    done: float = 0.0
    status: str = ""  # HTTP status code, or "connection error" / "client timeout (10 s)"
    outcome: str = ""  # allowed / denied / error
    message: str = ""
    node: str = ""  # the node an allowed patch pins to
    ns_id: int = 0  # namespace row id of a Pending set
    inserted: Any = None  # a future, done once the Pending set is inserted

    @property
    def latency(self) -> float:
        return self.done - self.due


def plain_bodies(count: int, namespaces: list[str], rng: random.Random) -> list[tuple[tuple[str, str], dict]]:
    """VMIs naming no gpuplane devices: the captured fedora06 (raw ``nvidia.com/GA102GL_A10``)."""
    from harness.factories import review
    from harness.shapes import real

    out = []
    for i in range(count):
        vmi = real("vmi-with-gpus.yaml", 0)
        ns, vm = rng.choice(namespaces), f"{PREFIX}plain-{i:05d}"
        vmi["metadata"].update(namespace=ns, name=vm)
        for key in ("uid", "resourceVersion", "generation", "finalizers"):
            vmi["metadata"].pop(key, None)
        vmi["status"] = {}
        out.append(((ns, vm), review(vmi)))
    return out


def plan(args: argparse.Namespace, tag: str, rate: float, seconds: float, rng: random.Random) -> list[Call]:
    """The calls of one run, each due on the fixed clock, the cases shuffled in."""
    from binder import models
    from harness.factories import new_vmi, review

    dues = schedule(rate, seconds, args.burst_rate if tag == "run" else 0, args.burst_at, args.burst_seconds)
    total = len(dues)
    n_pending = round(total * args.pending_share)
    n_plain = round(total * args.plain_share)
    n_bound = total - n_pending - n_plain
    cases = ["bound"] * n_bound + ["pending"] * n_pending + ["plain"] * n_plain
    rng.shuffle(cases)
    bound = iter(bound_bodies(n_bound))
    names = dict(models.Namespace.objects.values_list("id", "name"))
    generous = generous_tenants()
    plain = iter(plain_bodies(n_plain, sorted(names.values()), rng))
    calls = []
    for i, case in enumerate(cases):
        due = dues[i]
        if case == "bound":
            body = next(bound)
            obj = body["request"]["object"]["metadata"]
            key = (obj["namespace"], obj["name"])
            calls.append(Call(case, due, json.dumps(body).encode(), body["request"]["uid"], key))
        elif case == "plain":
            key, body = next(plain)
            calls.append(Call(case, due, json.dumps(body).encode(), body["request"]["uid"], key))
        else:
            ns_id = rng.choice(generous)
            size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
            vm = f"{PREFIX}{tag}-{i:05d}-00000"  # insert_sets names its one set <prefix>-00000
            body = review(new_vmi(names[ns_id], vm, [f"{vm}-gpu{j}" for j in range(size)]))
            key = (names[ns_id], vm)
            calls.append(Call(case, due, json.dumps(body).encode(), body["request"]["uid"], key, size, ns_id=ns_id))
    return calls


def schedule(rate: float, seconds: float, burst_rate: float, burst_at: float, burst_seconds: float) -> list[float]:
    """When each call is due (seconds from the start): ``rate`` per second for ``seconds``,
    and, with ``burst_rate``, that rate instead from ``burst_at`` for ``burst_seconds``."""
    if not burst_rate:
        return [i / rate for i in range(round(rate * seconds))]
    end = burst_at + burst_seconds
    dues = [i / rate for i in range(round(rate * burst_at))]
    dues += [burst_at + i / burst_rate for i in range(round(burst_rate * burst_seconds))]
    dues += [end + i / rate for i in range(round(rate * (seconds - end)))]
    return dues


def read_answer(call: Call, status: int, raw: bytes) -> None:
    call.status = str(status)
    if status >= 500:
        call.outcome, call.message = "error", raw[:200].decode(errors="replace")
        return
    try:
        answer = json.loads(raw)["response"]
    except (ValueError, KeyError, TypeError):
        call.outcome, call.message = "error", f"HTTP {status}: {raw[:200].decode(errors='replace')}"
        return
    if answer.get("uid") != call.uid:
        call.outcome, call.message = "error", "uid not echoed"
    elif answer.get("allowed"):
        call.outcome = "allowed"
        if answer.get("patch"):
            for op in json.loads(base64.b64decode(answer["patch"])):
                if op["path"] == "/spec/nodeSelector":
                    call.node = op["value"]["kubernetes.io/hostname"]
                elif op["path"] == "/spec/nodeSelector/kubernetes.io~1hostname":
                    call.node = op["value"]
    else:
        call.outcome, call.message = "denied", answer.get("status", {}).get("message", "")


class Load:
    """One open-loop run: every call started at its due time on the loop's clock."""

    def __init__(self, url: str, calls: list[Call], timeout: float, inserter: ThreadPoolExecutor, console: Any):
        self.url = f"{url}/webhooks/vmi?timeout={timeout:g}s"  # the kube-apiserver appends its deadline
        self.calls = calls
        self.timeout = timeout
        self.inserter = inserter
        self.console = console
        self.finished: list[Call] = []
        self.lead = 0.2  # a Pending set is inserted this long before its call
        self.late_inserts = 0
        self.loadavg: list[float] = []  # the 1-minute load average at each progress line

    async def run(self, report_every: float | None) -> float:
        import aiohttp

        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=25)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = loop.time() + 0.5
            for call in self.calls:
                call.due += start
            for call in self.calls:
                if call.pending:
                    call.inserted = loop.create_future()
            tasks = []
            reporter = asyncio.create_task(self.progress(start, report_every)) if report_every else None
            inserts = asyncio.create_task(self.insert_ahead(loop))
            for call in self.calls:
                delay = call.due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self.one(session, call, loop)))
            await asyncio.gather(*tasks)
            await inserts
            if reporter is not None:
                reporter.cancel()
        return start

    async def insert_ahead(self, loop: asyncio.AbstractEventLoop) -> None:
        """Insert each Pending set ``lead`` seconds before its call, in the inserter threads
        (Django ORM; several at once: one thread waiting for each commit fell behind at 100
        new orders a second)."""
        started = []
        for call in self.calls:
            if not call.pending:
                continue
            delay = call.due - self.lead - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            started.append(asyncio.ensure_future(self._insert(loop, call)))
        await asyncio.gather(*started)

    async def _insert(self, loop: asyncio.AbstractEventLoop, call: Call) -> None:
        await loop.run_in_executor(self.inserter, insert_pending, call)
        call.inserted.set_result(None)

    async def one(self, session: Any, call: Call, loop: asyncio.AbstractEventLoop) -> None:
        import aiohttp

        if call.pending and not call.inserted.done():
            self.late_inserts += 1
            await call.inserted
        call.sent = loop.time()
        try:
            async with session.post(self.url, data=call.body, headers={"Content-Type": "application/json"}) as resp:
                raw = await resp.read()
                call.done = loop.time()
                read_answer(call, resp.status, raw)
        except TimeoutError:
            call.done = loop.time()
            call.status, call.outcome, call.message = f"client timeout ({self.timeout:g} s)", "error", ""
        except aiohttp.ClientError as exc:
            call.done = loop.time()
            call.status, call.outcome, call.message = "connection error", "error", f"{type(exc).__name__}: {exc}"
        self.finished.append(call)

    async def progress(self, start: float, every: float) -> None:
        loop = asyncio.get_running_loop()
        tick = 0
        seen = 0
        while True:
            tick += 1
            await asyncio.sleep(max(0.0, start + tick * every - loop.time()))
            now = loop.time()
            sent = sum(1 for c in self.calls if c.sent and c.sent <= now)
            recent = self.finished[seen:]
            seen = len(self.finished)
            by_case = defaultdict(list)
            for c in recent:
                by_case[c.case].append(c.latency)
            errors = sum(1 for c in self.finished if c.outcome == "error")
            denied = sum(1 for c in self.finished if c.outcome == "denied")
            p99 = ", ".join(f"{k} {pct(v, 99) * 1000:.0f}" for k, v in sorted(by_case.items()))
            self.loadavg.append(os.getloadavg()[0])
            self.console.print(
                f"{now - start:5.1f} s: sent {sent} ({sent / (now - start):.0f}/s), answered {len(self.finished)} "
                f"(last {every:g} s: {len(recent) / every:.0f}/s), in flight {sent - len(self.finished)}, "
                f"denied {denied}, errors {errors}; p99 of the last {every:g} s (ms): {p99 or '-'}; "
                f"load average {self.loadavg[-1]:.2f}",
                highlight=False,
                soft_wrap=True,
            )


_INSERT_RNG = random.Random(8)


def insert_pending(call: Call) -> None:
    """Insert the Pending set a call names (in the inserter thread)."""
    prefix = call.key[1].removesuffix("-00000")
    insert_sets(prefix, 1, _INSERT_RNG, [call.ns_id], size=call.pending)


# -- after the run -------------------------------------------------------------------------


def check_bookings(calls: list[Call]) -> dict[str, Any]:
    """Double bookings, from the database through the project's own ledger."""
    from django.db import connection
    from django.utils import timezone

    from binder import models
    from binder.engine import Phase, ledger_for
    from binder.mirror.read import read_cluster

    cluster, _ = read_cluster(timezone.now())
    ledger = ledger_for(cluster)
    over = {n.name: ledger.over_booked(n.name) for n in cluster.nodes}
    over = {
        name: {r: f"{ledger.booked[name][r]}/{ledger.nodes[name].allocatable.get(r, 0)}" for r in res}
        for name, res in over.items()
        if res
    }
    sets: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for device in cluster.devices:
        sets[device.set_key].append(device)
    split = []
    for key, members in sets.items():
        held = {(d.phase, d.node if d.phase is Phase.BOUND else "") for d in members if d.phase is not Phase.PENDING}
        if len(held) > 1:
            split.append(key)
    # A device row twice (the unique constraint forbids it; checked anyway, it is cheap).
    table = models.GpuDevice._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {table} GROUP BY namespace_id, name HAVING count(*) > 1) d"  # noqa: S608
        )
        twice = cursor.fetchone()[0]
    # Every allowed call that was pinned: its set is Bound, whole, on that node now.
    where = {key: {(d.phase, d.node) for d in members} for key, members in sets.items()}
    elsewhere = [
        (call.case, call.key, call.node, sorted(map(str, where.get(call.key, ()))))
        for call in calls
        if call.outcome == "allowed" and call.node and where.get(call.key) != {(Phase.BOUND, call.node)}
    ]
    pinned: dict[tuple[str, str], set[str]] = defaultdict(set)
    for call in calls:
        if call.outcome == "allowed" and call.node:
            pinned[call.key].add(call.node)
    return {
        "nodes": len(cluster.nodes),
        "devices": len(cluster.devices),
        "sets": len(sets),
        "over_booked_nodes": over,
        "split_sets": split[:20],
        "split_sets_count": len(split),
        "device_rows_twice": twice,
        "allowed_not_where_pinned": elsewhere[:20],
        "allowed_not_where_pinned_count": len(elsewhere),
        "sets_pinned_to_two_nodes": sum(1 for nodes in pinned.values() if len(nodes) > 1),
        "pinned_calls_checked": sum(1 for c in calls if c.outcome == "allowed" and c.node),
    }


def pass_stats(since: Any) -> dict[str, Any]:
    """The binder's passes and bind answers since ``since`` (its own records)."""
    from binder import models

    out: dict[str, Any] = {}
    for kind in ("answer", "full"):
        runs = list(models.PassRun.objects.filter(kind=kind, started__gte=since).values_list("duration_ms", "bound"))
        durations = [d for d, _ in runs if d is not None]
        out[kind] = {
            "count": len(runs),
            "median_ms": statistics.median(durations) if durations else None,
            "max_ms": max(durations) if durations else None,
            "bound": sum(b for _, b in runs),
        }
    rows = models.BindAnswer.objects.filter(answered_at__gte=since).values_list("allowed", "latency_ms", "request")
    answers = [(allowed, ms) for allowed, ms, _ in rows]
    latencies = [ms for _, ms in answers if ms is not None]
    # One request per set (all its devices share it): the seconds webhook calls spent
    # waiting for the binder, each holding a webhook server thread.
    per_request = {request: ms for _, ms, request in rows if ms is not None}
    out["bind_answers"] = {
        "count": len(answers),
        "allowed": sum(1 for a, _ in answers if a),
        "p50_ms": pct(latencies, 50) if latencies else None,
        "p99_ms": pct(latencies, 99) if latencies else None,
        "max_ms": max(latencies) if latencies else None,
        "requests": len(per_request),
        "wait_s": sum(per_request.values()) / 1000,
    }
    return out


def reason(message: str) -> str:
    """A denial message with the names taken out, so equal reasons group together."""
    message = re.sub(r"VMI [\w.-]+/[\w.()-]+", "VMI <ns>/<vm>", message)
    message = re.sub(r"gpuplane\.io/[\w.-]+", "gpuplane.io/<device>", message)
    message = re.sub(r"\bgpu-\w+-\d+\b", "<node>", message)
    return re.sub(r"\b\d+\b", "N", message)


def healthy(rows: list[Call], limit: float) -> bool:
    """A window of calls the server kept up with: no errors, no "try again", p99 within ``limit``."""
    return (
        bool(rows)
        and all(c.outcome in ("allowed", "denied") and TRY_AGAIN not in c.message for c in rows)
        and pct([c.latency for c in rows], 99) <= limit
    )


def burst_figures(calls: list[Call], start: float, args: argparse.Namespace) -> dict[str, Any]:
    """The overload: what the calls due during the burst got, and how long after its end
    the server was healthy again (:func:`healthy` for every 1 s window of calls, by due
    time, from then to the end, against twice the p99 before the burst, at least 100 ms)."""
    begin, end = start + args.burst_at, start + args.burst_at + args.burst_seconds
    before = [c for c in calls if c.due < begin]
    during = [c for c in calls if begin <= c.due < end]
    after = [c for c in calls if c.due >= end]
    limit = max(0.1, 2 * pct([c.latency for c in before], 99)) if before else 0.1
    shed = [c for c in during if c.outcome == "denied" and TRY_AGAIN in c.message]
    windows: list[list[Call]] = []
    for c in after:
        index = int(c.due - end)
        while len(windows) <= index:
            windows.append([])
        windows[index].append(c)
    recovered: float | None = None
    for i in range(len(windows)):
        if all(healthy(w, limit) for w in windows[i:] if w):
            recovered = float(i)
            break

    def cases(rows: list[Call]) -> dict[str, Any]:
        out = {}
        for case in ("all", *CASES):
            mine = [c for c in rows if case in ("all", c.case)]
            if mine:
                out[case] = {
                    "calls": len(mine),
                    "allowed": sum(1 for c in mine if c.outcome == "allowed"),
                    "try_again": sum(1 for c in mine if c.outcome == "denied" and TRY_AGAIN in c.message),
                    "errors": sum(1 for c in mine if c.outcome == "error"),
                    "p50": pct([c.latency for c in mine], 50),
                    "p99": pct([c.latency for c in mine], 99),
                }
        return out

    return {
        "rate": args.burst_rate,
        "at_s": args.burst_at,
        "seconds": args.burst_seconds,
        "healthy_p99_limit_ms": limit * 1000,
        "before": cases(before),
        "during": cases(during),
        "after": cases(after),
        "try_again_p50_ms": pct([c.latency for c in shed], 50) * 1000 if shed else None,
        "try_again_p99_ms": pct([c.latency for c in shed], 99) * 1000 if shed else None,
        # Where a shed call spent its time: late in the load generator (due -> sent) or
        # between the send and the answer (the server, and the client's own event loop).
        "try_again_send_lag_p99_ms": pct([c.sent - c.due for c in shed], 99) * 1000 if shed else None,
        "try_again_from_send_p50_ms": pct([c.done - c.sent for c in shed], 50) * 1000 if shed else None,
        "try_again_from_send_p99_ms": pct([c.done - c.sent for c in shed], 99) * 1000 if shed else None,
        "recovered_after_s": recovered,
        "windows_after": [
            {"calls": len(w), "healthy": healthy(w, limit), "p99_ms": pct([c.latency for c in w], 99) * 1000}
            for w in windows
            if w
        ],
    }


def summarize(calls: list[Call], start: float, seconds: float) -> dict[str, Any]:
    sent = [c.sent for c in calls]
    done = [c.done for c in calls]
    ok = [c for c in calls if c.outcome in ("allowed", "denied")]
    lag = [c.sent - c.due for c in calls]
    out: dict[str, Any] = {
        "calls": len(calls),
        "offered_rate": len(calls) / seconds,
        "sent_rate": (len(calls) - 1) / (max(sent) - min(sent)) if len(calls) > 1 else 0.0,
        "send_lag_p99_ms": pct(lag, 99) * 1000,
        "send_lag_max_ms": max(lag) * 1000,
        "answered_in_window": sum(1 for c in ok if c.done <= start + seconds),
        "achieved_rate": len(ok) / (max(done) - start),
        "last_answer_s": max(done) - start,
        "status": dict(Counter(c.status for c in calls).most_common()),
        "errors": sum(1 for c in calls if c.outcome == "error"),
        "allowed": sum(1 for c in calls if c.outcome == "allowed"),
        "denied": sum(1 for c in calls if c.outcome == "denied"),
        "try_again": sum(1 for c in calls if c.outcome == "denied" and TRY_AGAIN in c.message),
        "reasons": dict(Counter(reason(c.message) for c in calls if c.outcome == "denied").most_common()),
        "error_messages": dict(Counter(reason(c.message)[:160] for c in calls if c.outcome == "error").most_common(5)),
        "cases": {},
    }
    out["error_rate"] = out["errors"] / len(calls)
    for case in ("all", *CASES):
        rows = [c for c in calls if case in ("all", c.case)]
        if not rows:
            continue
        latencies = [c.latency for c in rows]
        out["cases"][case] = {
            "calls": len(rows),
            "allowed": sum(1 for c in rows if c.outcome == "allowed"),
            "denied": sum(1 for c in rows if c.outcome == "denied"),
            "try_again": sum(1 for c in rows if c.outcome == "denied" and TRY_AGAIN in c.message),
            "errors": sum(1 for c in rows if c.outcome == "error"),
            "p50": pct(latencies, 50),
            "p95": pct(latencies, 95),
            "p99": pct(latencies, 99),
            "max": max(latencies),
            "p99_from_send": pct([c.done - c.sent for c in rows], 99),
        }
    return out


# -- the run -------------------------------------------------------------------------------


def generation_args(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments ``cluster_bench.generate`` reads, at that bench's defaults."""
    return argparse.Namespace(
        nodes=args.nodes,
        devices=args.devices,
        tenants=args.tenants,
        gpus_per_node=16,
        launcher_fraction=0.3,
        raw_pods=max(1, args.nodes // 20),
        forged_pods=max(1, args.nodes // 4),
        loader="copy",
        seed=args.seed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("LOAD_BENCH_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=200, help="calls per second (open loop)")
    parser.add_argument("--duration", type=float, default=60, help="seconds of load")
    parser.add_argument("--pending-share", type=float, default=0.10, help="share of calls for new Pending sets")
    parser.add_argument("--plain-share", type=float, default=0.10, help="share of calls naming no gpuplane device")
    parser.add_argument("--timeout", type=float, default=10, help="client timeout (the webhook's timeoutSeconds)")
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--web-threads", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=5, help="seconds of unreported load at a quarter of the rate")
    parser.add_argument("--logs", type=Path, help="copy the server's and the worker's logs into this directory")
    parser.add_argument("--burst-rate", type=float, default=0, help="an overload: this many calls/s for a while")
    parser.add_argument("--burst-at", type=float, default=10, help="seconds into the run the burst starts")
    parser.add_argument("--burst-seconds", type=float, default=5, help="how long the burst lasts")
    parser.add_argument("--skip-generate", action="store_true", help="reuse the cluster in the database")
    parser.add_argument("--keep", action="store_true", help="keep the database (default: drop it)")
    args = parser.parse_args()
    if database_name(args.database_url) in {"gpuplane_bench", "gpuplane_bench_1k"} and not args.keep:
        raise SystemExit("this bench drops its database: give one of its own (or --keep)")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    ensure_database(args.database_url)
    setup_django(args.database_url, migrate=True)
    try:
        figures = run(args, console, Progress, (TextColumn("{task.description}"), BarColumn(),
                                                MofNCompleteColumn(), TimeElapsedColumn()))  # fmt: skip
    finally:
        if not args.keep:
            drop_database(args.database_url)
            console.print(f"dropped database {database_name(args.database_url)}")
    report(args, figures)


def run(args: argparse.Namespace, console: Any, progress_class: Any, columns: tuple[Any, ...]) -> dict[str, Any]:
    import redis
    from django.db import connection
    from django.utils import timezone

    from binder import models
    from binder.runtime.passes import run_pass

    figures: dict[str, Any] = {"loadavg_before": os.getloadavg()}
    if not args.skip_generate:
        with progress_class(*columns, console=console) as progress:
            figures["generate"] = generate(generation_args(args), progress)
        clock = time.perf_counter()
        run_pass("full")  # settle class and budget status, open the usage records
        figures["prime_pass_s"] = time.perf_counter() - clock
    if models.GpuDevice.objects.filter(vm_name__startswith=PREFIX).delete()[0]:  # leftovers of a --keep run
        run_pass("full")  # re-settle the class and budget status
    figures["counts"] = {
        "nodes": models.Node.objects.count(),
        "devices": models.GpuDevice.objects.count(),
        "sets": models.GpuDevice.objects.values("namespace_id", "vm_name").distinct().count(),
        "pods": models.Pod.objects.count(),
        "namespaces": models.Namespace.objects.count(),
    }
    figures["before"] = check_bookings([])
    console.print(f"cluster: {figures['counts']}; before the run: {summary_line(figures['before'])}")

    key_prefix = f"gpuplane-load-bench-{os.getpid()}:"
    broker = redis.Redis.from_url(REDIS_URL)
    broker.ping()
    rng = random.Random(args.seed)
    server = worker = None
    inserter = ThreadPoolExecutor(max_workers=INSERTERS, thread_name_prefix="inserter")
    calls: list[Call] = []
    with tempfile.TemporaryDirectory(prefix="loadbench-") as tmp:
        var = Path(tmp)
        env = child_env(args, key_prefix, var)
        try:
            server, url = start_server(env, var / "webhook-server.log", args.web_workers, args.web_threads)
            worker = start_worker(env, var / "worker.log")
            if args.warmup:
                console.print(f"warm-up: {args.warmup:g} s at {args.rate / 4:g} calls/s (not reported)")
                warm = plan(args, "warm", args.rate / 4, args.warmup, rng)
                asyncio.run(Load(url, warm, args.timeout, inserter, console).run(None))
                console.print(f"warm-up: {summary_line(summarize(warm, warm[0].due, args.warmup), short=True)}")
                wait_idle(broker, key_prefix)
            calls = plan(args, "run", args.rate, args.duration, rng)
            web, binder, database = server.pid, worker.pid, database_name(args.database_url)
            cpu = Cpu(
                {
                    "webhook server": lambda: family(web),
                    "celery worker": lambda: family(binder),
                    "postgres": lambda: postgres_pids(database),
                }
            )
            since = timezone.now()
            figures["loadavg_start"] = os.getloadavg()
            console.print(
                f"load: {len(calls)} calls at {args.rate:g}/s for {args.duration:g} s, open loop "
                f"(load average {figures['loadavg_start'][0]:.2f})"
            )
            load = Load(url, calls, args.timeout, inserter, console)
            start = asyncio.run(load.run(5.0))
            figures["cpu"] = cpu.used()
            figures["loadavg_end"] = os.getloadavg()
            figures["late_inserts"] = load.late_inserts
            figures["loadavg_during"] = load.loadavg
            figures["load"] = summarize(calls, start, args.duration)
            if args.burst_rate:
                figures["burst"] = burst_figures(calls, start, args)
                # At once: the wait for the worker below can run out after a big burst.
                console.print(burst_line(figures["burst"]), soft_wrap=True)
            figures["idle_after_s"] = idle_after(broker, key_prefix, console)
            figures["passes"] = pass_stats(since)
            figures["sent_to_binder"] = (
                models.GpuDevice.objects.filter(vm_name__startswith=f"{PREFIX}run-")
                .exclude(bind_request="")
                .values("namespace_id", "vm_name")
                .distinct()
                .count()
            )
            figures["after"] = check_bookings(calls)
            console.print(f"after the run: {summary_line(figures['after'])}", soft_wrap=True)
        finally:
            stop(server)
            stop(worker)
            together = threading.Barrier(INSERTERS)

            def close_own() -> None:
                together.wait(timeout=10)  # one on each inserter thread: each closes its own connection
                connection.close()

            for done in [inserter.submit(close_own) for _ in range(INSERTERS)]:
                done.result()
            inserter.shutdown()
            log = (var / "webhook-server.log").read_text() if (var / "webhook-server.log").exists() else ""
            figures["server_log"] = {
                "LISTEN fallbacks (polling)": log.count("polling for bind answers"),
                "tracebacks": log.count("Traceback"),
            }
            wlog = (var / "worker.log").read_text() if (var / "worker.log").exists() else ""
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / "webhook-server.log").write_text(log)
                (args.logs / "worker.log").write_text(wlog)
                (args.logs / "denials.json").write_text(
                    json.dumps(
                        [(c.case, c.key, c.due, c.sent, c.done, c.message) for c in calls if c.outcome != "allowed"]
                    )
                )
            figures["worker_log"] = {"tracebacks": wlog.count("Traceback"), "errors": wlog.count("ERROR")}
            models.GpuDevice.objects.filter(vm_name__startswith=PREFIX).delete()
            for key in broker.scan_iter(match=key_prefix + "*"):
                broker.delete(key)
    return figures


def summary_line(f: dict[str, Any], short: bool = False) -> str:
    if short:
        return (
            f"{f['calls']} calls, {f['allowed']} allowed, {f['denied']} denied, {f['errors']} errors, "
            f"p99 {f['cases']['all']['p99'] * 1000:.0f} ms"
        )
    return (
        f"{f['devices']} devices in {f['sets']} sets on {f['nodes']} nodes; over-booked nodes "
        f"{len(f['over_booked_nodes'])}, split sets {f['split_sets_count']}, device rows twice "
        f"{f['device_rows_twice']}, allowed calls not where pinned {f['allowed_not_where_pinned_count']} "
        f"of {f['pinned_calls_checked']}"
    )


def report(args: argparse.Namespace, f: dict[str, Any]) -> None:
    ms = 1000
    load = f["load"]
    c = f["counts"]
    during = f["loadavg_during"] or [f["loadavg_end"][0]]
    print()
    print(
        f"Cluster: {c['nodes']} nodes, {c['devices']} devices in {c['sets']} sets, {c['pods']} pods "
        f"({database_name(args.database_url)}); webhook server {args.web_workers} x {args.web_threads} threads, "
        f"1 celery worker (prefork, concurrency 1), {os.cpu_count()} CPUs; 1-minute load average "
        f"{f['loadavg_start'][0]:.2f} at the start, {statistics.mean(during):.2f} mean / {max(during):.2f} max "
        f"during the run (every 5 s)."
    )
    print(
        f"Mix: {1 - args.pending_share - args.plain_share:.0%} Bound sets, {args.pending_share:.0%} new Pending sets "
        f"({f['sent_to_binder']} went to the binder), {args.plain_share:.0%} no gpuplane devices."
    )
    print()
    print("| case | calls | allowed | denied (try again) | errors | p50 | p95 | p99 | max | p99 from the send |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, r in load["cases"].items():
        print(
            f"| {case} | {r['calls']} | {r['allowed']} | {r['denied']} ({r['try_again']}) | {r['errors']} "
            f"| {r['p50'] * ms:.0f} ms | {r['p95'] * ms:.0f} ms | {r['p99'] * ms:.0f} ms | {r['max'] * ms:.0f} ms "
            f"| {r['p99_from_send'] * ms:.0f} ms |"
        )
    print()
    after = f["after"]
    passes = f["passes"]
    before_over = len(f["before"]["over_booked_nodes"])
    cpu = ", ".join(f"{k.removesuffix(' (cores)')} {v:.2f}" for k, v in f["cpu"].items())
    print("| measure | figure |")
    print("|---|---:|")
    rows = [
        ("offered rate (calls due / duration)", f"{load['offered_rate']:.1f}/s"),
        ("sent rate; send lag p99 / max", f"{load['sent_rate']:.1f}/s; {load['send_lag_p99_ms']:.0f} / "
         f"{load['send_lag_max_ms']:.0f} ms"),
        ("new orders sent late because their set's insert was late", f"{f['late_inserts']}"),
        ("achieved rate (answers / first due to last answer)", f"{load['achieved_rate']:.1f}/s "
         f"(last answer at {load['last_answer_s']:.1f} s)"),
        (f"answered within the {args.duration:g} s window", f"{load['answered_in_window']}"),
        ("HTTP status", ", ".join(f"{k}: {v}" for k, v in load["status"].items())),
        ("error rate (5xx, connection errors, client timeouts)", f"{load['error_rate']:.2%} ({load['errors']})"),
        ("denied / of which 'try again'", f"{load['denied']} / {load['try_again']}"),
        ("answer passes: count, median / max", f"{passes['answer']['count']}, {fmt_ms(passes['answer'])}"),
        ("full passes: count, median / max", f"{passes['full']['count']}, {fmt_ms(passes['full'])}"),
        ("binder answer latency (BindAnswer) p50 / p99 / max", "{} / {} / {} ms".format(
            *(f"{passes['bind_answers'][k]:.0f}" if passes["bind_answers"][k] is not None else "-"
              for k in ("p50_ms", "p99_ms", "max_ms")))),
        (
            "calls waiting for the binder: sets, thread-seconds held",
            f"{passes['bind_answers']['requests']}, {passes['bind_answers']['wait_s']:.0f} s",
        ),
        ("over-booked nodes after (before)", f"{len(after['over_booked_nodes'])} ({before_over})"),
        ("split sets after; device rows twice", f"{after['split_sets_count']}; {after['device_rows_twice']}"),
        ("allowed calls not on their pinned node; sets pinned to two nodes",
         f"{after['allowed_not_where_pinned_count']} of {after['pinned_calls_checked']}; "
         f"{after['sets_pinned_to_two_nodes']}"),
        ("CPU during the load (cores)", cpu),
    ]  # fmt: skip
    for name, value in rows:
        print(f"| {name} | {value} |")
    print()
    if "burst" in f:
        b = f["burst"]
        print(burst_line(b))
        print()
        print("| calls due | case | calls | allowed | try again | errors | p50 | p99 |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for phase in ("before", "during", "after"):
            for case, r in b[phase].items():
                print(
                    f"| {phase} the burst | {case} | {r['calls']} | {r['allowed']} | {r['try_again']} | {r['errors']} "
                    f"| {r['p50'] * ms:.0f} ms | {r['p99'] * ms:.0f} ms |"
                )
        print()
    if load["reasons"]:
        print("Denial reasons:")
        for text, n in load["reasons"].items():
            print(f"- {n} × {text}")
        print()
    print("<details><summary>raw figures (JSON)</summary>\n")
    print("```json")
    print(json.dumps(f, indent=1, default=str))
    print("```\n</details>")


def idle_after(broker: Any, key_prefix: str, console: Any, timeout: float = 600) -> float | None:
    """:func:`wait_idle` after the load; None, said on the console, if the worker is still
    busy after ``timeout`` (the figures of the load are reported anyway; the booking check
    then also sees sets still being answered)."""
    try:
        return wait_idle(broker, key_prefix, timeout)
    except SystemExit as exc:
        console.print(f"{exc}; reporting the load anyway")
        return None


def burst_line(b: dict[str, Any]) -> str:
    healed = "never" if b["recovered_after_s"] is None else f"{b['recovered_after_s']:g} s"
    return (
        f"Burst: {b['rate']:g} calls/s from {b['at_s']:g} s for {b['seconds']:g} s; 'try again' answers "
        f"p50 / p99: {b['try_again_p50_ms'] or 0:.0f} / {b['try_again_p99_ms'] or 0:.0f} ms (from the send "
        f"{b['try_again_from_send_p50_ms'] or 0:.0f} / {b['try_again_from_send_p99_ms'] or 0:.0f} ms; send lag p99 "
        f"{b['try_again_send_lag_p99_ms'] or 0:.0f} ms); healthy again "
        f"{healed} after the burst "
        f"(every 1 s window from then: no errors, no 'try again', p99 <= {b['healthy_p99_limit_ms']:.0f} ms)."
    )


def fmt_ms(p: dict[str, Any]) -> str:
    if p["median_ms"] is None:
        return "-"
    return f"{p['median_ms']:.0f} / {p['max_ms']:.0f} ms"


if __name__ == "__main__":
    main()

"""Benchmark the VMI admission webhook's latency under 50 concurrent clients.

Not a test: it prints a markdown table for docs/benchmarks.md. Against a cluster already in the
database (``bench/cluster_bench.py`` generates one; this bench never does), it starts the
real parts as subprocesses: the webhook server (deploy/webhook_server.py; 2 workers x 26
threads, plain HTTP on a free loopback port) and one ``celery worker`` (solo pool, queue ``binder``) on
Redis database 12 under a key prefix of its own. Then it times ``POST /webhooks/vmi``
calls (AdmissionReviews built from the real fixtures by ``harness.factories``, as the webhook tests do;
each client thread keeps one keep-alive connection, as the kube-apiserver does) for:

* Bound sets: existing sets Bound on one node; the webhook reads the namespace's slice
  of the mirror and answers with the pinning patch, no binder involved;
* Pending sets: fresh single-device Pending sets of the class with the most free room,
  in tenants without a tight budget; each call writes its bind request, queues an answer
  pass on the worker and waits (LISTEN/NOTIFY) for the answer;

each idle and again while a separate process runs full passes back to back (passes
serialize on the advisory lock, so this models a busy binder). Each case prints calls/s
and the server's CPU per call (user + system time of the webhook server's processes over
the case, from /proc, divided by its calls), and the cores the server and the client
threads (this process) used. Before the server starts, one read model is
built in a fresh process: its build time and the memory it added; the web processes'
resident memory is read again after the run.

    .venv/bin/python -m bench.webhook_bench                       # gpuplane_bench (10k nodes)
    .venv/bin/python -m bench.webhook_bench --calls 100 --pending 40 \\
        --database-url postgres://postgres@127.0.0.1:5432/gpuplane_bench_1k

Everything it inserts (sets named ``whbench-*``) is deleted again and one full pass
re-settles the class status; the subprocesses are stopped and its Redis keys removed.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.common import DEFAULT_URL, ROOT, database_name, json_dump, model_defaults, pct, setup_django, wait_idle
from bench.servers import REDIS_URL, child_env, start_server, start_worker, stop
from bench.synth import bound_bodies, generous_tenants

PREFIX = "whbench-"  # vm names of every set this bench inserts


# -- the real parts ------------------------------------------------------------------------


class PassLoop:
    """A separate process running full passes back to back (``--child-loop``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "bench.webhook_bench", "--database-url", args.database_url, "--child-loop"]
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # noqa: S603
        self.durations: list[float] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.durations.append(json.loads(line)["duration"])

    def wait_passes(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.durations) < count:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the full-pass loop did not run")
            time.sleep(0.05)

    def stop(self) -> None:
        stop(self.process, timeout=60)
        self.reader.join(timeout=5)


def run_child_loop() -> None:
    """``--child-loop``: full passes back to back until SIGTERM; one JSON line per pass."""
    from binder.runtime.passes import run_pass

    stopping = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    while not stopping:
        clock = time.perf_counter()
        run = run_pass("full")
        print(json.dumps({"duration": time.perf_counter() - clock, "written": run.devices_written}), flush=True)


# -- the server's processes: CPU and memory ------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (the webhook server and its workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the server's processes so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for each in process_tree(pid):
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def worker_rss_mib(pid: int) -> list[float]:
    """Resident memory of each process below the server (its web workers), MiB."""
    out = []
    for each in process_tree(pid)[1:]:
        try:
            status = Path(f"/proc/{each}/status").read_text()
        except OSError:
            continue
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        out.append(kib / 1024)
    return sorted(out, reverse=True)


def measure_build(database_url: str) -> dict[str, float]:
    """Build one read model in a fresh process: seconds and the RSS it added (``--child-build``)."""
    cmd = [sys.executable, "-m", "bench.webhook_bench", "--database-url", database_url, "--child-build"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)  # noqa: S603
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child_build() -> None:
    """``--child-build``: RSS before and after one read model build, and its time."""
    import gc

    from binder.runtime.readmodel import ReadModel

    def rss() -> float:
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024

    model = ReadModel("bench")
    gc.collect()
    before = rss()
    clock = time.perf_counter()
    model.current()
    seconds = time.perf_counter() - clock
    gc.collect()
    after = rss()
    clock = time.perf_counter()
    model.current()
    follow = time.perf_counter() - clock
    print(json.dumps({"build_seconds": seconds, "rss_mib_added": after - before, "rss_mib": after,
                      "idle_follow_ms": follow * 1000, "devices": len(model.records["GPU"])}))  # fmt: skip


# -- the calls -----------------------------------------------------------------------------


def roomiest_class() -> tuple[str, int]:
    from binder import models

    free = {c.name: c.status_allocatable - c.status_bound for c in models.GpuClass.objects.all()}
    name = max(free, key=lambda c: free[c])
    return name, free[name]


class PendingSets:
    """New single-device Pending sets, each inserted by the client thread just before its call.

    Inserted up front they would not stay Pending under load: a full pass places every
    Pending set it reads, and the call would then find a Bound set. The insert is not
    timed; afterwards :meth:`needed_pass` counts the sets the webhook sent to the binder.
    """

    def __init__(self, database_url: str, class_name: str, namespace_ids: list[int]) -> None:
        from binder import models

        self.url = database_url
        self.class_name = class_name
        self.namespace_ids = namespace_ids
        self.names = dict(models.Namespace.objects.filter(id__in=namespace_ids).values_list("id", "name"))
        self.table = models.GpuDevice._meta.db_table
        self.conn: Any = None
        self.lock = threading.Lock()

    def specs(self, tag: str, count: int) -> list[tuple[int, str]]:
        import random

        rng = random.Random(tag)
        return [(rng.choice(self.namespace_ids), f"{PREFIX}{tag}-{i:05d}") for i in range(count)]

    def insert(self, spec: tuple[int, str]) -> dict[str, Any]:
        """Insert the set's device (committed) and return the review of its VMI."""
        import psycopg

        from harness.factories import new_vmi, review

        ns, vm = spec
        # One connection for all client threads: the server's 52 threads and their LISTEN
        # connections already come close to PostgreSQL's default max_connections of 100.
        from binder import models

        columns = ["namespace_id", "name", "class_name", "vm_name", "phase", "created"]
        extra, defaults = model_defaults(models.GpuDevice, columns)
        names = ", ".join([*columns, *extra])
        marks = ", ".join(["%s"] * (len(columns) + len(extra)))
        values = [ns, f"{vm}-gpu0", self.class_name, vm, "Pending", datetime.now(UTC), *map(json_dump, defaults)]
        with self.lock:
            if self.conn is None:
                self.conn = psycopg.connect(self.url, autocommit=True)
            self.conn.execute(f"INSERT INTO {self.table} ({names}) VALUES ({marks})", values)  # noqa: S608
        return review(new_vmi(self.names[ns], vm, [f"{vm}-gpu0"]))

    def needed_pass(self, tag: str) -> int:
        from binder import models

        rows = models.GpuDevice.objects.filter(vm_name__startswith=f"{PREFIX}{tag}-").exclude(bind_request="")
        return rows.count()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def delete_inserted() -> int:
    from binder import models

    deleted, _ = models.GpuDevice.objects.filter(vm_name__startswith=PREFIX).delete()
    return deleted


_local = threading.local()


def _connection(url: str, fresh: bool = False) -> http.client.HTTPConnection:
    """This client thread's keep-alive connection to the server (the kube-apiserver, too,
    keeps its connections to a webhook open and reuses them)."""
    conn: http.client.HTTPConnection | None = getattr(_local, "conn", None)
    if conn is None or fresh:
        if conn is not None:
            conn.close()
        parts = urlsplit(url)
        conn = _local.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    return conn


Result = tuple[float, str, str, float, float]


def call(url: str, body: dict[str, Any] | Any, pending: PendingSets | None = None) -> Result:
    """One webhook call: (seconds, "allowed" / "denied" / "error", denial message, and the
    wall-clock times it was sent and answered, for :func:`pending_breakdown`).

    With ``pending``, ``body`` is a Pending set's spec: the set is inserted first (untimed).
    The review is encoded before the clock starts; the call goes over the thread's
    keep-alive connection (a new one if the server closed it).
    """
    if pending is not None:
        body = pending.insert(body)
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    sent = time.time()
    clock = time.perf_counter()
    try:
        for attempt in range(2):
            conn = _connection(url, fresh=attempt > 0)
            try:
                conn.request("POST", "/webhooks/vmi?timeout=10s", body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if attempt:
                    raise
                sent, clock = time.time(), time.perf_counter()  # the server closed an idle connection
        if resp.status != 200:
            return time.perf_counter() - clock, "error", f"HTTP {resp.status}", sent, time.time()
        out = json.loads(raw)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        _local.conn = None
        return time.perf_counter() - clock, "error", str(exc), sent, time.time()
    seconds, done = time.perf_counter() - clock, time.time()
    answer = out.get("response", {})
    if answer.get("uid") != body["request"]["uid"]:
        return seconds, "error", "uid not echoed", sent, done
    if answer.get("allowed"):
        return seconds, "allowed", "", sent, done
    return seconds, "denied", answer.get("status", {}).get("message", ""), sent, done


def run_case(
    name: str, url: str, bodies: list[Any], clients: int, pending: PendingSets | None = None, server: int = 0
) -> dict[str, Any]:
    cpu = cpu_seconds(server) if server else 0.0
    own = time.process_time()
    clock = time.perf_counter()
    since = datetime.now(UTC)
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(lambda body: call(url, body, pending), bodies))
    wall = time.perf_counter() - clock
    own = time.process_time() - own
    cpu = cpu_seconds(server) - cpu if server else 0.0
    latencies = [r[0] for r in results]
    outcome = {k: sum(1 for r in results if r[1] == k) for k in ("allowed", "denied", "error")}
    messages = sorted({r[2] for r in results if r[1] != "allowed"})
    timeouts = sum(1 for r in results if r[1] == "denied" and "did not answer" in r[2])
    case = {
        "case": name,
        "clients": clients,
        "calls": len(results),
        "wall": wall,
        "p50": pct(latencies, 50),
        "p99": pct(latencies, 99),
        "max": max(latencies),
        "mean": statistics.fmean(latencies),
        "timeouts": timeouts,
        "calls_per_s": len(results) / wall,
        "server_cpu_ms_per_call": cpu * 1000 / len(results) if server else None,
        "server_cores": cpu / wall if server else None,
        "client_cores": own / wall,
        "messages": messages[:5],
        "http_5xx": sum(1 for r in results if r[1] == "error" and r[2].startswith("HTTP 5")),
        **outcome,
    }
    if pending is not None and not name.startswith("warm"):
        case["breakdown"] = pending_breakdown(
            [(body[1], r[3], r[4]) for body, r in zip(bodies, results, strict=True)], since
        )
    print(
        f"{name}: {len(results)} calls in {wall:.1f} s, p50 {case['p50'] * 1000:.0f} ms, "
        f"p99 {case['p99'] * 1000:.0f} ms, {len(results) / wall:.0f} calls/s, "
        f"server CPU {case['server_cpu_ms_per_call'] or 0:.2f} ms/call ({case['server_cores'] or 0:.2f} cores), "
        f"clients {own / wall:.2f} cores, {outcome}",
        file=sys.stderr,
        flush=True,
    )
    return case


#: The wrk script: each connection posts the reviews of a file in turn (one JSON body a
#: line), counts answers that are not 200 with ``"allowed":true``, and prints one JSON line.
WRK_SCRIPT = r"""
bodies = {}
i = 0
failed = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
  i = math.random(#bodies)
end
function request()
  i = i % #bodies + 1
  return wrk.format("POST", nil, {["Content-Type"] = "application/json"}, bodies[i])
end
function response(status, headers, body)
  if status ~= 200 or not string.find(body, '"allowed":true', 1, true) then failed = failed + 1 end
end
function done(summary, latency, requests)
  local bad = 0
  for _, t in ipairs(threads) do bad = bad + t:get("failed") end
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, "mean_us": %f,'
    .. ' "failed": %d, "socket_errors": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean, bad, e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def run_wrk_case(name: str, url: str, bodies: list[Any], clients: int, seconds: float, server: int) -> dict[str, Any]:
    """Bound calls from ``wrk`` (C, epoll, one thread) instead of Python threads: the same
    endpoint, ``?timeout=10s``, one keep-alive connection per client, closed loop, for
    ``seconds``. A leaner stand-in for the kube-apiserver, which calls from another machine:
    the 50 client threads took about a quarter of a core from the server."""
    import resource
    import shutil

    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("--generator wrk needs wrk on the PATH (Debian: apt-get install wrk)")
    with tempfile.TemporaryDirectory(prefix="whbench-wrk-") as tmp:
        script, data = Path(tmp) / "reviews.lua", Path(tmp) / "reviews.jsonl"
        script.write_text(WRK_SCRIPT)
        data.write_text("".join(json.dumps(body) + "\n" for body in bodies))
        cmd = [wrk, "-t1", f"-c{clients}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(script)]
        cmd += [f"{url}/webhooks/vmi?timeout=10s", "--", str(data)]
        cpu = cpu_seconds(server)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        clock = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)  # noqa: S603
        wall = time.perf_counter() - clock
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = cpu_seconds(server) - cpu
    out = json.loads(done.stdout.strip().splitlines()[-1])
    calls = out["requests"]
    own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    seconds_run = out["duration_us"] / 1e6
    case = {
        "case": name,
        "generator": "wrk",
        "clients": clients,
        "calls": calls,
        "wall": seconds_run,
        "p50": out["p50_us"] / 1e6,
        "p99": out["p99_us"] / 1e6,
        "p90": out["p90_us"] / 1e6,
        "max": out["max_us"] / 1e6,
        "mean": out["mean_us"] / 1e6,
        "timeouts": 0,
        "calls_per_s": calls / seconds_run,
        "server_cpu_ms_per_call": cpu * 1000 / calls,
        "server_cores": cpu / wall,
        "client_cores": own / wall,
        "messages": [],
        "http_5xx": 0,
        "allowed": calls - out["failed"],
        "denied": 0,
        "error": out["failed"] + out["socket_errors"],
    }
    print(
        f"{name}: {calls} calls in {seconds_run:.1f} s, p50 {case['p50'] * 1000:.0f} ms, "
        f"p99 {case['p99'] * 1000:.0f} ms, {case['calls_per_s']:.0f} calls/s, "
        f"server CPU {case['server_cpu_ms_per_call']:.2f} ms/call ({case['server_cores']:.2f} cores), "
        f"wrk {case['client_cores']:.2f} cores, not allowed or failed {case['error']}",
        file=sys.stderr,
        flush=True,
    )
    return case


def bound_cases(name: str, url: str, bound: list[Any], args: argparse.Namespace, server: int) -> list[dict[str, Any]]:
    """The 50-client Bound case from the generators ``--generator`` names."""
    cases = []
    if args.generator in ("threads", "both"):
        cases.append(run_case(name, url, bound, args.clients, server=server))
    if args.generator in ("wrk", "both"):
        cases.append(run_wrk_case(f"{name}, wrk", url, bound, args.clients, args.wrk_seconds, server))
    return cases


def pending_breakdown(spans: list[tuple[str, float, float]], since: datetime) -> dict[str, Any]:
    """Where a Pending call's time went, from the client's clock and the database's records
    (one machine, one clock): sent -> bind request written (``bind_requested_at``) -> the
    answer pass that bound the set starts (``PassRun.started``, once it holds the pass lock)
    -> it finishes (``finished``; the commit and NOTIFY follow) -> the answer reaches the
    client (the wake, the shared answer read, the follow and the response). Also the passes
    run meanwhile: how many, and how long."""
    from binder import models

    vms = [vm for vm, _, _ in spans]
    written: dict[str, datetime] = {}
    for vm, at in models.GpuDevice.objects.filter(vm_name__in=vms).values_list("vm_name", "bind_requested_at"):
        if at is not None:
            written[vm] = min(at, written.get(vm, at))
    passes = {
        vm: (run_id, kind, started, finished)
        for vm, run_id, kind, started, finished in models.Decision.objects.filter(vm_name__in=vms, to_phase="Bound")
        .order_by("pass_run_id")
        .values_list("vm_name", "pass_run_id", "pass_run__kind", "pass_run__started", "pass_run__finished")
    }
    segments: dict[str, list[float]] = {k: [] for k in ("written", "queued", "pass", "answered", "total")}
    for vm, sent, done in spans:
        if vm not in written or vm not in passes or passes[vm][3] is None:
            continue
        _, _, started, finished = passes[vm]
        marks = [sent, written[vm].timestamp(), started.timestamp(), finished.timestamp(), done]
        steps = ("written", "queued", "pass", "answered")
        for key, (a, b) in zip(steps, itertools.pairwise(marks), strict=True):
            segments[key].append(b - a)
        segments["total"].append(done - sent)
    runs = list(models.PassRun.objects.filter(started__gte=since).values_list("id", "kind", "duration_ms", "bound"))
    answering = {run_id for run_id, *_ in passes.values()}
    by_kind: dict[str, list[float]] = {}
    for _, kind, ms, _ in runs:
        by_kind.setdefault(kind, []).append(ms or 0.0)
    per_pass = [sum(1 for v in passes.values() if v[0] == run_id) for run_id in answering]
    return {
        "calls_traced": len(segments["total"]),
        "ms": {
            key: {"p50": pct(v, 50) * 1000, "p90": pct(v, 90) * 1000, "p99": pct(v, 99) * 1000}
            for key, v in segments.items()
            if v
        },
        "passes": {
            kind: {"count": len(v), "median_ms": statistics.median(v), "max_ms": max(v)} for kind, v in by_kind.items()
        },
        "answering_passes": len(answering),
        "sets_per_answering_pass": statistics.fmean(per_pass) if per_pass else 0.0,
        "full_passes_answering": sum(1 for v in passes.values() if v[1] == "full"),
    }


# -- the run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--calls", type=int, default=2000, help="calls for Bound sets, per case")
    parser.add_argument("--pending", type=int, default=200, help="new Pending sets (one call each), per case")
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients")
    parser.add_argument("--serial-calls", type=int, default=100, help="Bound-set calls from 1 client")
    parser.add_argument("--serial-pending", type=int, default=5, help="Pending-set calls from 1 client")
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--web-threads", type=int, default=26)
    parser.add_argument("--skip-load", action="store_true", help="only the idle cases")
    parser.add_argument(
        "--generator",
        choices=("threads", "wrk", "both"),
        default="threads",
        help="who sends the 50-client Bound calls: Python threads (one keep-alive connection each), wrk, or both",
    )
    parser.add_argument("--wrk-seconds", type=float, default=5.0, help="how long each wrk case runs")
    parser.add_argument("--child-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-build", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    setup_django(args.database_url, migrate=False)
    if args.child_loop:
        run_child_loop()
        return
    if args.child_build:
        run_child_build()
        return
    if database_name(args.database_url) in {"test", "postgres", "gpuplane"}:
        raise SystemExit("give a bench database, e.g. " + DEFAULT_URL)

    import redis

    from binder import models
    from binder.runtime.passes import run_pass

    if not models.GpuDevice.objects.filter(phase="Bound").exists():
        raise SystemExit("no Bound sets: generate a cluster first (python -m bench.cluster_bench --generate-only)")
    delete_inserted()  # leftovers of an interrupted run
    key_prefix = f"gpuplane-webhook-bench-{os.getpid()}:"
    broker = redis.Redis.from_url(REDIS_URL)
    broker.ping()
    counts = {
        "nodes": models.Node.objects.count(),
        "devices": models.GpuDevice.objects.count(),
    }
    cases: list[dict[str, Any]] = []
    loop_passes: list[float] = []
    server = worker = None
    loop: PassLoop | None = None
    pending: PendingSets | None = None
    server_log: dict[str, int] = {}
    build = measure_build(args.database_url)
    print(f"read model: built in {build['build_seconds']:.2f} s, +{build['rss_mib_added']:.0f} MiB", file=sys.stderr)
    rss: list[float] = []
    with tempfile.TemporaryDirectory(prefix="whbench-") as tmp:
        var = Path(tmp)
        env = child_env(args, key_prefix, var)
        try:
            server, url = start_server(env, var / "webhook-server.log", args.web_workers, args.web_threads)
            worker = start_worker(env, var / "worker.log")
            class_name, free = roomiest_class()
            needed = 2 * args.pending + args.serial_pending + 1
            if free < needed:
                raise SystemExit(f"class {class_name} has room for {free} devices, the bench needs {needed}")
            pending = PendingSets(args.database_url, class_name, generous_tenants())
            bound = bound_bodies(args.calls)
            # Warm up: every gunicorn thread's connection, the worker's first pass.
            run_case("warm-up (not reported)", url, bound[: 2 * args.clients], args.clients, server=server.pid)
            run_case("warm-up (not reported)", url, pending.specs("warm", 1), 1, pending, server.pid)
            # The warm-up's answer pass asks for a full pass a moment later (and a new worker's
            # first full pass verifies its state): let them run now, not inside a measured case.
            print(f"worker idle after {wait_idle(broker, key_prefix, 300):.1f} s", file=sys.stderr)

            serial = bound[: args.serial_calls]
            cases.append(run_case("(a) Bound sets, idle, 1 client", url, serial, 1, server=server.pid))
            cases += bound_cases("(a) Bound sets, idle", url, bound, args, server.pid)
            if args.serial_pending:
                case = run_case(
                    "(b) Pending sets, idle, 1 client",
                    url,
                    pending.specs("serial", args.serial_pending),
                    1,
                    pending,
                    server.pid,
                )
                case["needed_pass"] = pending.needed_pass("serial")
                cases.append(case)
            specs = pending.specs("idle", args.pending)
            case = run_case("(b) Pending sets, idle", url, specs, args.clients, pending, server.pid)
            case["needed_pass"] = pending.needed_pass("idle")
            cases.append(case)
            delete_inserted()

            if not args.skip_load:
                loop = PassLoop(args)
                loop.wait_passes(1)
                start = len(loop.durations)
                cases += bound_cases("(c) Bound sets, full passes back to back", url, bound, args, server.pid)
                specs = pending.specs("load", args.pending)
                case = run_case(
                    "(c) Pending sets, full passes back to back", url, specs, args.clients, pending, server.pid
                )
                case["needed_pass"] = pending.needed_pass("load")
                cases.append(case)
                loop.stop()
                loop_passes = loop.durations[start:]
        finally:
            if server is not None:
                rss = worker_rss_mib(server.pid)
            if loop is not None:
                loop.stop()
            if pending is not None:
                pending.close()
            stop(server)
            stop(worker)
            log = (var / "webhook-server.log").read_text() if (var / "webhook-server.log").exists() else ""
            server_log["LISTEN fallbacks (polling)"] = log.count("polling for bind answers")
            server_log["HTTP 5xx answers"] = sum(c["http_5xx"] for c in cases)
            deleted = delete_inserted()
            run_pass("full")  # re-settle the class and budget status
            for key in broker.scan_iter(match=key_prefix + "*"):
                broker.delete(key)
            print(f"cleaned up: {deleted} devices deleted, subprocesses stopped", file=sys.stderr)
    server_log["read model build (ms)"] = round(build["build_seconds"] * 1000)
    server_log["read model RSS added (MiB)"] = round(build["rss_mib_added"])
    server_log["web process RSS after the run (MiB)"] = round(max(rss, default=0))
    report(args, counts, cases, loop_passes, server_log)


def report(
    args: argparse.Namespace,
    counts: dict[str, int],
    cases: list[dict[str, Any]],
    passes: list[float],
    server_log: dict[str, int],
) -> None:
    ms = 1000
    print()
    print(
        f"Cluster: {counts['nodes']} nodes, {counts['devices']} devices ({database_name(args.database_url)}); "
        f"webhook server {args.web_workers} x {args.web_threads} threads, 1 celery worker (solo), "
        f"{args.clients} concurrent clients, {os.cpu_count()} CPUs."
    )
    if passes:
        print(
            f"Full passes back to back during (c): {len(passes)} passes, "
            f"median {statistics.median(passes) * ms:.0f} ms, max {max(passes) * ms:.0f} ms."
        )
    print("Server log: " + ", ".join(f"{k} {v}" for k, v in server_log.items()) + ".")
    print()
    print(f"Load average at the end: {os.getloadavg()[0]:.2f} (1 min).")
    print()
    print(
        "| case | calls | calls/s | p50 | p99 | max | server CPU / call | server / client cores | allowed "
        "| denied (timeouts) | errors | sent to the binder |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in cases:
        cpu = c.get("server_cpu_ms_per_call")
        print(
            f"| {c['case']} | {c['calls']} | {c['calls_per_s']:.0f} | {c['p50'] * ms:.1f} ms | {c['p99'] * ms:.1f} ms "
            f"| {c['max'] * ms:.0f} ms | {'–' if cpu is None else f'{cpu:.2f} ms'} "
            f"| {c['server_cores'] or 0:.2f} / {c['client_cores']:.2f} | {c['allowed']} "
            f"| {c['denied']} ({c['timeouts']}) | {c['error']} | {c.get('needed_pass', '–')} |"
        )
    for c in cases:
        b = c.get("breakdown")
        if not b or not b["ms"]:
            continue
        parts = ", ".join(f"{k} {v['p50']:.0f} / {v['p99']:.0f}" for k, v in b["ms"].items())
        kinds = ", ".join(
            f"{k} {v['count']} (median {v['median_ms']:.0f}, max {v['max_ms']:.0f} ms)" for k, v in b["passes"].items()
        )
        print()
        print(
            f"{c['case']}, where the time went (p50 / p99 ms, {b['calls_traced']} calls): {parts}. "
            f"Passes meanwhile: {kinds}; {b['answering_passes']} passes bound the sets "
            f"({b['sets_per_answering_pass']:.1f} sets each; {b['full_passes_answering']} sets by a full pass)."
        )
    print()
    print("<details><summary>raw figures (JSON)</summary>\n")
    print("```json")
    print(json.dumps({"counts": counts, "cases": cases, "full_passes": passes, "server_log": server_log}, indent=1))
    print("```\n</details>")


if __name__ == "__main__":
    main()

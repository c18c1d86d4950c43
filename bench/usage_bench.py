"""Benchmark the tenant usage API on PostgreSQL: 1M usage records, 1,000 tenants.

Not a test: it prints a markdown table for docs/benchmarks.md. It drops and recreates its own
database (``gpuplane_usage_bench`` by default, never ``test``), migrates it, and writes:

* ``--records`` usage records (1,000,000) across ``--tenants`` namespaces (1,000); one
  tenant (``tenant-0500``) holds exactly ``--tenant-records`` (10,000), the others share
  the rest (log-normal sizes). Records span ``--days`` (90) up to now and are shaped like
  the ones full passes write: GPU sets of 1/2/4/8 devices whose records change when the
  set moves node or goes Lost and back (phases Bound/Lost, every device of a set on the
  same pass times), and raw-GPU pods (phase Raw, keyed by the raw resource name). A
  record is open when its holding reaches now; starts and ends fall on a 60 s pass grid.
  They are COPYed into a staging table and inserted in start order (a real table fills
  in time order, so one tenant's rows are spread over the whole heap), then VACUUM
  ANALYZE (autovacuum's state for an append-only table).
* The mirror behind the ``usage`` endpoint's current usage: namespaces, 3 classes, nodes,
  a GPUBudget per tenant, and a GPU device (Bound or Lost) or raw-GPU pod for every open
  record, so current usage agrees with the open records.

Then it serves the API with the real gunicorn (``deploy/gunicorn.conf.py``, plain HTTP on
a free loopback port) and times ``--requests`` sequential requests per case over one
keep-alive connection, with a knox token granted the 10k-record tenant only (a tenant,
not staff): ``usage`` with a 30-day window; ``usage-records`` first page, filtered by
key + phase + a 30-day from/to, filtered by subject, last page; and the CSV export of 30
days. Each case then runs once in-process to count its SQL, and the slowest queries of
every case that misses the target (or of all, with ``--explain``) are EXPLAIN ANALYZEd.

    .venv/bin/python -m bench.usage_bench
    .venv/bin/python -m bench.usage_bench --keep          # keep the database afterwards
    .venv/bin/python -m bench.usage_bench --skip-generate # reuse a kept database

The database is dropped at the end unless ``--keep``; gunicorn is always stopped.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlparse

from bench.common import admin_url, database_name, dedicated_name, drop_database, pct, setup_django
from bench.servers import start_server, stop
from bench.synth import CLASSES, NODE_SELECTOR, node_labels

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/gpuplane_usage_bench"
PASS_SECONDS = 60  # records open and close on full passes, one a minute
TARGET_MS = 200.0
SET_SIZES = (1, 2, 4, 8)
SET_WEIGHTS = (40, 30, 20, 10)
#: Record columns in COPY order (every column but ``id``).
COLUMNS = ("namespace", "subject_kind", "subject", "subject_uid", "vm_name", "key", "resource_name", "units",
           "node", "phase", "start", "end", "opened_by_pass", "closed_by_pass")  # fmt: skip
USER = "usage-bench"


# -- database ----------------------------------------------------------------------------------


def check_name(url: str) -> str:
    return dedicated_name(url, DEFAULT_URL)


def recreate_database(url: str) -> None:
    import psycopg
    from psycopg import sql

    name = check_name(url)
    with psycopg.connect(admin_url(url), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


# -- generation --------------------------------------------------------------------------------


def tenant_sizes(rng: random.Random, tenants: int, total: int, target: int, target_records: int) -> list[int]:
    """Records per tenant: exactly ``target_records`` for ``target``, log-normal for the rest."""
    others = total - target_records
    count = tenants - 1
    if others < count:
        raise SystemExit("--records must leave at least one record for every other tenant")
    weights = [rng.lognormvariate(0.0, 0.8) for _ in range(count)]
    scale = others / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    diff = others - sum(sizes)
    i = 0
    while diff:
        step = 1 if diff > 0 else -1
        if sizes[i % count] + step >= 1:
            sizes[i % count] += step
            diff -= step
        i += 1
    sizes.insert(target, target_records)
    return sizes


def grid(t: float) -> float:
    """The full pass at or after ``t`` (records start and end on passes)."""
    return math.ceil(t / PASS_SECONDS) * PASS_SECONDS


class Tenant:
    """Generates one tenant's records (as row tuples) and notes what it holds now."""

    def __init__(self, rng: random.Random, name: str, nodes: dict[str, list[str]], now: float, span: float) -> None:
        self.rng = rng
        self.name = name
        self.nodes = nodes
        self.now = now
        self.span = span
        self.first_pass = now - span - 86400
        self.open_devices: list[tuple[str, str, str, str, str, float]] = []  # name, class, vm, phase, node, since
        self.open_pods: list[tuple[str, str, str, str, int]] = []  # name, uid, node, resource, units
        self.sets = 0
        self.pods = 0

    def pass_id(self, t: float | None) -> int | None:
        return None if t is None else int((t - self.first_pass) // PASS_SECONDS) + 1

    def start_time(self) -> float:
        return grid(self.now - self.rng.random() * self.span)

    def segment(self, t: float, mean_hours: float) -> float | None:
        """The end of a holding that starts at ``t`` (``None``: still held now)."""
        end = grid(t + max(PASS_SECONDS, self.rng.expovariate(1.0 / (mean_hours * 3600))))
        return None if end >= self.now else end

    def gpu_set(self) -> list[tuple[Any, ...]]:
        """A set of 1-8 devices: Bound on a node, sometimes moved or Lost and back, maybe deleted."""
        rng = self.rng
        cls, resource, _ = CLASSES[rng.randrange(len(CLASSES))]
        size = rng.choices(SET_SIZES, SET_WEIGHTS)[0]
        vm = f"vm-{self.sets:05d}"
        self.sets += 1
        devices = [f"{vm}-{cls}-{d}" for d in range(size)]
        t = self.start_time()
        if t >= self.now:
            t -= PASS_SECONDS
        phase, node = "Bound", rng.choice(self.nodes[cls])
        rows = []
        while True:
            end = self.segment(t, 36.0)
            rows.extend((self.name, "GPU", device, "", vm, cls, resource, 1, node, phase, t, end,
                         self.pass_id(t), self.pass_id(end)) for device in devices)  # fmt: skip
            if end is None:
                self.open_devices.extend((d, cls, vm, phase, node, t) for d in devices)
                break
            if rng.random() < 0.35:  # the VM was deleted: its records close
                break
            if phase == "Bound" and rng.random() < 0.3:
                phase, node = "Lost", ""
            else:
                phase, node = "Bound", rng.choice(self.nodes[cls])
            t = end
        return rows

    def raw_pod(self) -> list[tuple[Any, ...]]:
        """A pod requesting 1-2 raw GPUs: one Raw record while it runs."""
        rng = self.rng
        cls, resource, _ = CLASSES[rng.randrange(len(CLASSES))]
        name = f"cuda-job-{self.pods:05d}"
        self.pods += 1
        pod_uid = f"{rng.getrandbits(128):032x}"
        units = rng.choice((1, 1, 2))
        node = rng.choice(self.nodes[cls])
        t = self.start_time()
        if t >= self.now:
            t -= PASS_SECONDS
        end = self.segment(t, 8.0)
        if end is None:
            self.open_pods.append((name, pod_uid, node, resource, units))
        return [(self.name, "Pod", name, pod_uid, "", resource, resource, units, node, "Raw", t, end,
                 self.pass_id(t), self.pass_id(end))]  # fmt: skip

    def records(self, count: int) -> Iterator[tuple[Any, ...]]:
        """Exactly ``count`` records (the last subject's history may be cut short)."""
        left = count
        while left > 0:
            rows = self.raw_pod() if self.rng.random() < 0.25 else self.gpu_set()
            if len(rows) > left:
                cut = rows[left:]
                rows = rows[:left]
                dropped = {r[2] for r in cut if r[11] is None}
                self.open_devices = [d for d in self.open_devices if d[0] not in dropped]
                self.open_pods = [p for p in self.open_pods if p[0] not in dropped]
            left -= len(rows)
            yield from rows


def when(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, UTC)


def generate(args: argparse.Namespace, progress: Any, now: float) -> dict[str, Any]:
    """Write the mirror and the records; return counts and timings."""
    from django.db import connection, transaction
    from psycopg import sql

    from binder import models

    rng = random.Random(args.seed)
    stats: dict[str, Any] = {}
    span = args.days * 86400.0
    tenants = [f"tenant-{t:04d}" for t in range(args.tenants)]
    target = args.tenants // 2
    sizes = tenant_sizes(rng, args.tenants, args.records, target, args.tenant_records)
    stats["largest_other_tenant"] = max(s for i, s in enumerate(sizes) if i != target)
    stats["median_tenant"] = statistics.median(sizes)
    node_names = {cls: [f"gpu-{cls}-{i:04d}" for i in range(c, args.nodes, len(CLASSES))]
                  for c, (cls, _, _) in enumerate(CLASSES)}  # fmt: skip

    task = progress.add_task("records (COPY to a staging table)", total=args.records)
    clock = time.perf_counter()
    generators = []
    cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL work_mem = '256MB'")
        cursor.execute(
            sql.SQL("CREATE TEMP TABLE usage_stage ON COMMIT DROP AS SELECT {} FROM usage_usagerecord WITH NO DATA")
            .format(cols)
        )  # fmt: skip
        with cursor.copy(sql.SQL("COPY usage_stage ({}) FROM STDIN").format(cols)) as copy:
            for name, size in zip(tenants, sizes, strict=True):
                tenant = Tenant(rng, name, node_names, now, span)
                generators.append(tenant)
                written = 0
                for row in tenant.records(size):
                    copy.write_row((*row[:10], when(row[10]), when(row[11]), row[12], row[13]))
                    written += 1
                    if written % 5000 == 0:
                        progress.advance(task, 5000)
                progress.advance(task, written % 5000)
        stats["copy_s"] = time.perf_counter() - clock
        task = progress.add_task("INSERT … SELECT … ORDER BY start (with the table's indexes)", total=1)
        clock = time.perf_counter()
        cursor.execute(
            sql.SQL("INSERT INTO usage_usagerecord ({0}) SELECT {0} FROM usage_stage ORDER BY {1}")
            .format(cols, sql.SQL("start, namespace, subject"))
        )  # fmt: skip
        progress.advance(task)
        stats["insert_s"] = time.perf_counter() - clock

    task = progress.add_task("mirror: namespaces, classes, nodes, budgets, devices, pods", total=1)
    clock = time.perf_counter()
    created = datetime.fromtimestamp(now - span - 86400, UTC)
    with transaction.atomic():
        models.Namespace.objects.bulk_create(
            models.Namespace(name=n, uid=f"{rng.getrandbits(128):032x}", labels={"kubernetes.io/metadata.name": n},
                             created=created)
            for n in tenants
        )  # fmt: skip
        ns_id = dict(models.Namespace.objects.values_list("name", "id"))
        models.GpuClass.objects.bulk_create(
            models.GpuClass(name=c, resource_name=r, units_per_device=1, node_selector=NODE_SELECTOR, display_name=d,
                            created=created)
            for c, r, d in CLASSES
        )  # fmt: skip
        resources = {c: r for c, r, _ in CLASSES}
        models.Node.objects.bulk_create(
            (
                models.Node(name=n, uid=f"{rng.getrandbits(128):032x}", labels=node_labels(n, cls),
                            allocatable={resources[cls]: 8}, ready=True, ready_since=created, created=created)
                for cls, names in node_names.items()
                for n in names
            ),
            batch_size=2000,
        )  # fmt: skip
        models.GpuBudget.objects.bulk_create(
            (models.GpuBudget(namespace_id=ns_id[n], name="gpu-budget", limits={c: 512 for c, _, _ in CLASSES})
             for n in tenants),
            batch_size=2000,
        )  # fmt: skip
        models.GpuDevice.objects.bulk_create(
            (
                models.GpuDevice(namespace_id=ns_id[g.name], name=name, class_name=cls, vm_name=vm, phase=phase,
                                 node=node, since=when(since), created=when(since),
                                 reason="bound: fullest node with room" if phase == "Bound" else "lost: node gone")
                for g in generators
                for name, cls, vm, phase, node, since in g.open_devices
            ),
            batch_size=5000,
        )  # fmt: skip
        models.Pod.objects.bulk_create(
            (
                models.Pod(namespace_id=ns_id[g.name], name=name, uid=pod_uid, node=node, phase="Running",
                           gpu_requests={resource: units})
                for g in generators
                for name, pod_uid, node, resource, units in g.open_pods
            ),
            batch_size=5000,
        )  # fmt: skip
    progress.advance(task)
    stats["mirror_s"] = time.perf_counter() - clock
    stats["open_devices"] = sum(len(g.open_devices) for g in generators)
    stats["open_pods"] = sum(len(g.open_pods) for g in generators)

    task = progress.add_task("VACUUM ANALYZE", total=1)
    clock = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    progress.advance(task)
    stats["vacuum_s"] = time.perf_counter() - clock
    return stats


# -- measuring ---------------------------------------------------------------------------------


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def tenant_facts(namespace: str, start: datetime, end: datetime) -> dict[str, Any]:
    """What the cases read: counts of the tenant, its busiest key and subject."""
    from django.db.models import Count, Q

    from usage.models import UsageRecord

    mine = UsageRecord.objects.filter(namespace=namespace)
    window = mine.filter(start__lt=end).filter(Q(end__isnull=True) | Q(end__gt=start))
    key = mine.order_by().values("key").annotate(n=Count("id")).order_by("-n")[0]["key"]
    subject = mine.order_by().values("subject").annotate(n=Count("id")).order_by("-n", "subject")[0]["subject"]
    return {
        "records": mine.count(),
        "window_records": window.count(),
        "open_records": mine.filter(end__isnull=True).count(),
        "all_records": UsageRecord.objects.count(),
        "tenants": UsageRecord.objects.order_by().values("namespace").distinct().count(),
        "key": key,
        "subject": subject,
        "subject_records": mine.filter(subject=subject).count(),
        "key_phase_window_records": window.filter(key=key, phase="Bound").count(),
    }


def cases(namespace: str, facts: dict[str, Any], start: datetime, end: datetime) -> list[dict[str, Any]]:
    base = f"/api/v1/tenants/{namespace}"
    window = {"from": iso(start), "to": iso(end)}
    filtered = {"key": facts["key"], "phase": "Bound", **window}
    return [
        {"name": "usage, 30-day window", "path": f"{base}/usage?{urlencode(window)}", "kind": "usage",
         "expect": facts["open_records"]},
        {"name": "usage-records, first page", "path": f"{base}/usage-records", "kind": "page",
         "expect": facts["records"]},
        {"name": f"usage-records, key={facts['key']} phase=Bound + 30-day from/to",
         "path": f"{base}/usage-records?{urlencode(filtered)}", "kind": "page",
         "expect": facts["key_phase_window_records"]},
        {"name": "usage-records, subject=<busiest subject>",
         "path": f"{base}/usage-records?{urlencode({'subject': facts['subject']})}", "kind": "page",
         "expect": facts["subject_records"]},
        {"name": "usage-records, last page", "path": f"{base}/usage-records?page=last", "kind": "page",
         "expect": facts["records"]},
        {"name": "CSV export, 30 days", "path": f"{base}/usage-records?{urlencode({'format': 'csv', **window})}",
         "kind": "csv", "expect": facts["window_records"]},
    ]  # fmt: skip


def fetch(conn: http.client.HTTPConnection, path: str, token: str, kind: str) -> tuple[float, int, bytes]:
    accept = "text/csv" if kind == "csv" else "application/json"
    clock = time.perf_counter()
    conn.request("GET", path, headers={"Authorization": f"Token {token}", "Accept": accept})
    response = conn.getresponse()
    body = response.read()
    return (time.perf_counter() - clock) * 1000, response.status, body


def check(case: dict[str, Any], status: int, body: bytes) -> str:
    """A short description of the answer; raises if it is not what the case expects."""
    if status != 200:
        raise SystemExit(f"{case['name']}: HTTP {status}: {body[:500]!r}")
    if case["kind"] == "csv":
        rows = body.decode().count("\n") - 1
        if rows != case["expect"]:
            raise SystemExit(f"{case['name']}: {rows} CSV rows, expected {case['expect']}")
        return f"{rows} rows, {len(body) / 1024:.0f} KiB"
    data = json.loads(body)
    if case["kind"] == "usage":
        if len(data["openRecords"]) != case["expect"]:
            raise SystemExit(f"{case['name']}: {len(data['openRecords'])} open records, expected {case['expect']}")
        return f"{len(data['keys'])} keys, {len(data['openRecords'])} open records"
    if data["count"] != case["expect"]:
        raise SystemExit(f"{case['name']}: count {data['count']}, expected {case['expect']}")
    return f"{len(data['results'])} of {data['count']} rows"


def run_http(args: argparse.Namespace, url: str, token: str, todo: list[dict[str, Any]], progress: Any) -> None:
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=60)
    try:
        for case in todo:
            task = progress.add_task(case["name"], total=args.warmup + args.requests)
            timings = []
            for i in range(args.warmup + args.requests):
                ms, status, body = fetch(conn, case["path"], token, case["kind"])
                if i == 0:
                    case["answer"] = check(case, status, body)
                elif status != 200:
                    raise SystemExit(f"{case['name']}: HTTP {status} on request {i}")
                if i >= args.warmup:
                    timings.append(ms)
                progress.advance(task)
            case["ms"] = timings
            case["p50"] = statistics.median(timings)
            case["p95"] = pct(timings, 95)
            case["p99"] = pct(timings, 99)
            case["max"] = max(timings)
            case["met"] = case["p95"] < TARGET_MS
    finally:
        conn.close()


def profile(token: str, todo: list[dict[str, Any]], explain: bool) -> None:
    """Run each case once in-process: its SQL count and time; EXPLAIN ANALYZE the slowest."""
    from django.db import connection
    from django.test import Client

    client = Client(SERVER_NAME="localhost", HTTP_AUTHORIZATION=f"Token {token}")
    queries: list[tuple[float, str, Any]] = []

    def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        clock = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            ms = (time.perf_counter() - clock) * 1000
            queries.append((ms, sql, params))

    for case in todo:
        accept = "text/csv" if case["kind"] == "csv" else "application/json"
        client.get(case["path"], HTTP_ACCEPT=accept)  # warm this process (connection, imports)
        queries.clear()
        clock = time.perf_counter()
        with connection.execute_wrapper(timed):
            response = client.get(case["path"], HTTP_ACCEPT=accept)
            if response.streaming:
                b"".join(response.streaming_content)
        total = (time.perf_counter() - clock) * 1000
        case["in_process_ms"] = total
        case["queries"] = len(queries)
        case["sql_ms"] = sum(q[0] for q in queries)
        case["slowest_sql"] = []
        if not (explain or not case.get("met", True)):
            continue
        for ms, sql, params in sorted(queries, key=lambda q: -q[0])[:3]:
            if not sql.lstrip().upper().startswith("SELECT"):
                continue
            with connection.cursor() as cursor:
                sql = cursor.mogrify(sql, params) if params else sql  # the SQL as sent (client-side binding)
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
                plan = "\n".join(row[0] for row in cursor.fetchall())
            case["slowest_sql"].append({"ms": ms, "sql": sql, "plan": plan})


# -- report ------------------------------------------------------------------------------------


def report(args: argparse.Namespace, f: dict[str, Any]) -> None:
    facts = f["facts"]
    print(
        f"\n{facts['all_records']:,} usage records, {facts['tenants']:,} tenants; the tenant: "
        f"{facts['records']:,} records ({facts['window_records']:,} in the 30-day window, "
        f"{facts['open_records']} open); {args.requests} sequential requests per case after {args.warmup} warm-up, "
        f"one keep-alive connection, gunicorn {args.web_workers} workers x {args.web_threads} threads\n"
    )
    print("| case | answer | p50 | p95 | p99 | max | SQL (in-process) | target | met |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for c in f["cases"]:
        met = "met" if c["met"] else f"**missed** ({c['p95'] / TARGET_MS:.1f}×)"
        print(
            f"| {c['name']} | {c['answer']} | {c['p50']:.1f} ms | {c['p95']:.1f} ms | {c['p99']:.1f} ms "
            f"| {c['max']:.1f} ms | {c['queries']} queries, {c['sql_ms']:.1f} of {c['in_process_ms']:.1f} ms "
            f"| p95 < {TARGET_MS:.0f} ms | {met} |"
        )
    for c in f["cases"]:
        for q in c["slowest_sql"]:
            print(f"\n#### {c['name']}: {q['ms']:.1f} ms\n\n```sql\n{q['sql']}\n```\n\n```\n{q['plan']}\n```")
    raw = {k: v for k, v in f.items() if k != "cases"}
    raw["cases"] = [{k: v for k, v in c.items() if k not in ("ms", "slowest_sql")} for c in f["cases"]]
    print("\n<details><summary>raw figures (JSON)</summary>\n")
    print("```json")
    print(json.dumps(raw, indent=1, default=str))
    print("```\n</details>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--tenant-records", type=int, default=10_000, help="records of the measured tenant")
    parser.add_argument("--days", type=int, default=90, help="the records span this many days up to now")
    parser.add_argument("--nodes", type=int, default=600)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per case")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests per case first")
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--web-threads", type=int, default=8)
    parser.add_argument("--explain", action="store_true", help="EXPLAIN ANALYZE every case, not just missed ones")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip-generate", action="store_true", help="reuse the database of a --keep run")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    args = parser.parse_args()
    if not 0 < args.tenant_records < args.records or args.tenants < 2:
        raise SystemExit("need --tenants >= 2 and 0 < --tenant-records < --records")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    check_name(args.database_url)
    if not args.skip_generate:
        recreate_database(args.database_url)
    setup_django(args.database_url, migrate=not args.skip_generate)
    figures: dict[str, Any] = {}
    namespace = f"tenant-{args.tenants // 2:04d}"
    now = float(int(time.time()))
    server = None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console) as progress:
            if not args.skip_generate:
                clock = time.perf_counter()
                figures["generate"] = generate(args, progress, now)
                figures["generate"]["total_s"] = time.perf_counter() - clock
                g = figures["generate"]
                console.print(
                    f"generated in {g['total_s']:.1f} s (COPY {g['copy_s']:.1f} s, insert {g['insert_s']:.1f} s, "
                    f"mirror {g['mirror_s']:.1f} s, VACUUM ANALYZE {g['vacuum_s']:.1f} s); "
                    f"{g['open_devices']} open device records, {g['open_pods']} open pod records"
                )
            from usage.tenancy import issue_token

            end = datetime.fromtimestamp(now, UTC)
            start = end - timedelta(days=30)
            figures["facts"] = facts = tenant_facts(namespace, start, end)
            if facts["records"] == 0:
                raise SystemExit(f"{namespace} has no records: generate first (no --skip-generate)")
            token = issue_token(USER, [namespace], days=1).token
            todo = cases(namespace, facts, start, end)
            from django.db import connections

            connections.close_all()
            with tempfile.TemporaryDirectory(prefix="usage-bench-") as tmp:
                env = {
                    **os.environ,
                    "DATABASE_URL": args.database_url,
                    "GPUPLANE_AUTO_PASS": "false",
                    "GPUPLANE_CLUSTER": "standalone",
                    "GPUPLANE_VAR_DIR": tmp,
                    "DJANGO_SECRET_KEY": secrets.token_urlsafe(32),
                    "GPUPLANE_LOG_LEVEL": "WARNING",
                }
                server, url = start_server(env, Path(tmp) / "gunicorn.log", args.web_workers, args.web_threads)
                try:
                    run_http(args, url, token, todo, progress)
                finally:
                    stop(server)
            profile(token, todo, args.explain)
        figures["cases"] = todo
        report(args, figures)
    finally:
        if server is not None:
            stop(server)
        if not args.keep:
            drop_database(args.database_url)
            console.print(f"dropped {database_name(args.database_url)} (--keep keeps it)")


if __name__ == "__main__":
    main()

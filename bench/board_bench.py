"""Benchmark the staff placement board on a synthetic cluster of 1,000 or 10,000 nodes (issues 7, 18).

Not a test (tests never assert on time): it prints the figures docs/benchmarks.md quotes.
It builds a cluster in a database of its own (SQLite in a temporary directory by
default, or ``--database-url``): ``--nodes`` GPU nodes (80 % HGX H100 with 8 units,
20 % A10 with 4), a few hundred tenants, sets of 1/2/4/8 devices packed first-fit to
about 85 % full, launcher pods proven by their VMI's activePods for a third of the sets,
raw-GPU pods, some NotReady, cordoned, draining and over-booked nodes, and Lost sets.
Then it times:

* the server: ``GET /admin/placement-board/`` (its first page of rows) through Django,
  first (nothing kept from an earlier board: a snapshot of the read model, every node
  summed), cold (a node changed since the last board: a snapshot, the rest amended from
  what the last board kept) and warm (the change feed unchanged, so the cached snapshot
  and summed rows are reused), median of ``--runs`` each, with the query count and page size;
* the browser: Debian's Chromium (``/usr/bin/chromium``, headless) loading the page
  from a local WSGI server, from navigation start to the first contentful paint and to
  the first frame painted after the load event, cold and warm, median of ``--runs``.

    .venv/bin/python -m bench.board_bench --nodes 1000
    .venv/bin/python -m bench.board_bench --nodes 10000
    .venv/bin/python -m bench.board_bench --skip-generate --database-url postgres://…/gpuplane_bench  # cluster_bench's
    .venv/bin/python -m bench.board_bench --nodes 10000 --no-browser --profile 30   # cProfile of one cold GET
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

H100, A10 = "nvidia.com/GH100_H100_SXM5_80GB", "nvidia.com/GA102GL_A10"


def setup_django(database_url: str, var_dir: Path) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ["GPUPLANE_VAR_DIR"] = str(var_dir)
    os.environ["GPUPLANE_AUTO_PASS"] = "false"  # noqa: S105 - not a password
    os.environ["DJANGO_ALLOWED_HOSTS"] = "127.0.0.1,localhost,testserver"
    os.environ.setdefault("GPUPLANE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def generate(nodes: int, seed: int) -> dict[str, int]:
    """Write the synthetic cluster (emptying the mirror first); returns its counts."""
    from django.utils import timezone

    from binder import models
    from binder.mirror.write import clear_mirror

    rng = random.Random(seed)
    clear_mirror()
    now = timezone.now()
    tenants = models.Namespace.objects.bulk_create(
        [models.Namespace(name=f"tenant-{i:03d}") for i in range(max(10, nodes // 4))]
    )
    models.GpuClass.objects.bulk_create(
        [models.GpuClass(name="h100", resource_name=H100), models.GpuClass(name="a10", resource_name=A10)]
    )
    node_rows, free = [], {}
    for i in range(nodes):
        h100 = i % 5 != 4
        name = f"{'hgx-h100' if h100 else 'gpu-a10'}-{i:05d}"
        units = 8 if h100 else 4
        roll = rng.random()
        node_rows.append(
            models.Node(
                name=name,
                allocatable={H100 if h100 else A10: units},
                ready=roll >= 0.01,
                ready_since=now,
                unschedulable=0.01 <= roll < 0.03,
                labels={"gpuplane.io/drain": "true"} if 0.03 <= roll < 0.04 else {},
            )
        )
        free[name] = (H100 if h100 else A10, units)
    models.Node.objects.bulk_create(node_rows)
    devices, vmis, pods = [], [], []
    target = int(sum(u for _, u in free.values()) * 0.85)
    placed = sets = misses = 0
    names = list(free)
    while placed < target:
        size = rng.choices((1, 2, 4, 8), weights=(40, 30, 20, 10))[0]
        tenant = rng.choice(tenants)
        cls = "h100" if rng.random() < 0.8 else "a10"
        resource = H100 if cls == "h100" else A10
        start = rng.randrange(len(names))
        node = next(
            (
                names[(start + k) % len(names)]
                for k in range(len(names))
                if free[names[(start + k) % len(names)]][0] == resource
                and free[names[(start + k) % len(names)]][1] >= size
            ),
            None,
        )
        if node is None:  # e.g. an 8-device A10 set: A10 nodes have 4 units
            misses += 1
            if misses > 500:
                break
            continue
        free[node] = (resource, free[node][1] - size)
        vm = f"vm-{sets:05d}"
        sets += 1
        devices.extend(
            models.GpuDevice(
                namespace=tenant,
                name=f"{vm}-gpu{j}",
                class_name=cls,
                vm_name=vm,
                phase="Bound",
                node=node,
                since=now,
                reason="bound: fullest node with room",
            )
            for j in range(size)
        )
        placed += size
        if rng.random() < 0.33:
            uid = f"uid-{vm}"
            vmis.append(
                models.VirtualMachineInstance(
                    namespace=tenant, name=vm, uid=f"vmi-{vm}", active_pods={uid: node}, node=node, phase="Running"
                )
            )
            pods.append(
                models.Pod(
                    namespace=tenant,
                    name=f"virt-launcher-{vm}",
                    uid=uid,
                    node=node,
                    phase="Running",
                    gpu_requests={resource: size},
                    owner_kind="VirtualMachineInstance",
                    owner_name=vm,
                    owner_vmi_hint=vm,
                )
            )
    for name, (resource, left) in free.items():  # raw pods fill some of what is left
        if left and rng.random() < 0.1:
            pods.append(
                models.Pod(
                    namespace=rng.choice(tenants),
                    name=f"trainer-{name}",
                    uid=f"uid-trainer-{name}",
                    node=name,
                    phase="Running",
                    gpu_requests={resource: 1},
                )
            )
    for i in range(max(1, nodes // 50)):  # Lost sets
        tenant = rng.choice(tenants)
        devices.extend(
            models.GpuDevice(
                namespace=tenant,
                name=f"lost-{i}-gpu{j}",
                class_name="h100",
                vm_name=f"lost-{i}",
                phase="Lost",
                since=now,
                reason="lost: node went away; no other node has room for the set",
            )
            for j in range(4)
        )
    models.GpuDevice.objects.bulk_create(devices, batch_size=2000)
    models.VirtualMachineInstance.objects.bulk_create(vmis, batch_size=2000)
    models.Pod.objects.bulk_create(pods, batch_size=2000)
    # over-booked: a few full nodes lose units (the binder has not run since)
    full = [n for n, (_, left) in free.items() if left == 0][: max(1, nodes // 200)]
    for name in full:
        node = models.Node.objects.get(name=name)
        resource, units = next(iter(node.allocatable.items()))
        node.allocatable = {resource: units - 1}
        node.save()
    return {"nodes": nodes, "tenants": len(tenants), "devices": len(devices), "sets": sets, "pods": len(pods)}


def existing_counts() -> dict[str, int]:
    """The counts of the cluster already in the database (``--skip-generate``)."""
    from binder import models

    return {
        "nodes": models.Node.objects.count(),
        "tenants": models.Namespace.objects.count(),
        "devices": models.GpuDevice.objects.count(),
        "sets": models.GpuDevice.objects.values("namespace", "vm_name").distinct().count(),
        "pods": models.Pod.objects.count(),
    }


def profile_server(top: int) -> None:
    """cProfile of one cold ``GET /admin/placement-board/`` (a node changed since the last
    board, as in the browser's cold runs), the ``top`` functions by cumulative and by own
    time, on stderr."""
    import cProfile
    import pstats

    from django.contrib.auth import get_user_model
    from django.test import Client

    user, _ = get_user_model().objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    client.get("/admin/placement-board/")  # warms imports, templates and the read model
    _touch_mirror()
    profiler = cProfile.Profile()
    profiler.enable()
    response = client.get("/admin/placement-board/")
    profiler.disable()
    assert response.status_code == 200, response.status_code
    stats = pstats.Stats(profiler, stream=sys.stderr).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def time_server(runs: int) -> dict[str, Any]:
    """Server time of ``GET /admin/placement-board/`` (the first page of rows): first (the
    process's first board: nothing kept from an earlier one, ``forget()``), cold (the mirror
    changed since the last board, as in the browser runs: a new snapshot of the read model,
    its units and rows amended from the last board's) and warm (the change feed unchanged:
    the cached snapshot and summed rows, draw and render)."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from gpuplane.staff.snapshot import forget

    user, _ = get_user_model().objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    client.get("/admin/placement-board/")  # warms imports and templates
    figures: dict[str, Any] = {}
    for mode in ("first", "cold", "warm"):
        times = []
        for _ in range(runs):
            if mode == "first":
                forget()
            elif mode == "cold":
                _touch_mirror()
            with CaptureQueriesContext(connection) as captured:
                start = time.perf_counter()
                response = client.get("/admin/placement-board/")
                elapsed = time.perf_counter() - start
            assert response.status_code == 200, response.status_code
            times.append(elapsed)
        figures[f"server_{mode}_median_s"] = statistics.median(times)
        figures[f"server_{mode}_max_s"] = max(times)
        figures[f"queries_{mode}"] = len(captured)
    figures["html_bytes"] = len(response.content)
    figures["cells"] = response.content.count(b'class="u')
    figures["session"] = client.cookies["sessionid"].value
    return figures


def _serve(port: Any) -> None:
    """The WSGI server, in a process of its own: with Playwright's loop in the same process
    the board's Python work shared the interpreter lock with it and took several times longer."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from django.core.wsgi import get_wsgi_application
    from django.db import connections

    connections.close_all()  # the parent's connections are not this process's

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = make_server("127.0.0.1", 0, get_wsgi_application(), handler_class=Quiet)
    port.put(server.server_port)
    server.serve_forever()


def _touch_mirror() -> None:
    """Change a mirrored row as a sync would (a label), so the change feed moves and the
    server's cached snapshot no longer matches: the next board is read afresh (cold)."""
    from django.db import connections

    from binder import models

    node = models.Node.objects.order_by("name").first()
    assert node is not None
    labels = dict(node.labels)
    labels["bench.gpuplane.io/touched"] = str(time.time_ns())
    models.Node.objects.filter(pk=node.pk).update(labels=labels)
    connections.close_all()


def time_browser(runs: int, session: str) -> dict[str, Any]:
    """Chromium loading the board from a local WSGI server (its own process): time to the
    first byte, to the first contentful paint and to the first frame painted after the
    load event; cold (the mirror changed since the last board) and warm."""
    import multiprocessing

    from django.db import connections

    from harness.browsing import launch_chromium  # the browser tests' Chromium and its arguments

    connections.close_all()
    context_mp = multiprocessing.get_context("fork")
    port: Any = context_mp.Queue()
    child = context_mp.Process(target=_serve, args=(port,), daemon=True)
    child.start()
    url = f"http://127.0.0.1:{port.get(timeout=60)}/admin/placement-board/"
    out: dict[str, Any] = {}
    with launch_chromium() as browser:
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        context.add_cookies([{"name": "sessionid", "value": session, "url": url}])
        page = context.new_page()
        page.goto(url, wait_until="load", timeout=120_000)  # warms the browser's cache of the static files
        for mode in ("cold", "warm"):
            fcp, painted, ttfb = [], [], []
            for _ in range(runs):
                if mode == "cold":  # on a thread: Django refuses the ORM beside Playwright's loop
                    with ThreadPoolExecutor(max_workers=1) as pool:
                        pool.submit(_touch_mirror).result()
                page.goto(url, wait_until="load", timeout=120_000)
                figures = page.evaluate(
                    """() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => {
                        const painted = performance.now();
                        const nav = performance.getEntriesByType("navigation")[0];
                        const ttfb = nav ? nav.responseStart : NaN;
                        const rows = document.querySelectorAll("#gp-board tr.node").length;
                        new PerformanceObserver(list => {
                            const fcp = list.getEntries().find(e => e.name === "first-contentful-paint");
                            if (fcp) { done({fcp: fcp.startTime, painted: painted, ttfb: ttfb, rows: rows}); }
                        }).observe({type: "paint", buffered: true});
                        setTimeout(() => done({fcp: NaN, painted: painted, ttfb: ttfb, rows: rows}), 5000);
                    })))"""
                )
                fcp.append(figures["fcp"] / 1000)
                painted.append(figures["painted"] / 1000)
                ttfb.append(figures["ttfb"] / 1000)
            out[f"browser_{mode}_first_byte_median_s"] = statistics.median(ttfb)
            out[f"browser_{mode}_fcp_median_s"] = statistics.median(fcp)
            out[f"browser_{mode}_painted_median_s"] = statistics.median(painted)
            out[f"browser_{mode}_painted_max_s"] = max(painted)
        out["rows"] = figures["rows"]
    child.terminate()
    child.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--database-url", default="", help="default: SQLite in a temporary directory")
    parser.add_argument("--no-browser", action="store_true", help="time the server only")
    parser.add_argument(
        "--skip-generate",
        action="store_true",
        help="use the cluster already in --database-url (e.g. one cluster_bench generated); it is left as it is, "
        "but for the label the cold browser runs set on the first node",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print cProfile's top N of a cold GET first"
    )
    args = parser.parse_args()
    if args.skip_generate and not args.database_url:
        parser.error("--skip-generate needs --database-url")
    with tempfile.TemporaryDirectory(prefix="board-bench-") as tmp:
        var = Path(tmp)
        setup_django(args.database_url or f"sqlite:///{var / 'board.sqlite3'}", var)
        counts = existing_counts() if args.skip_generate else generate(args.nodes, args.seed)
        if args.profile:
            profile_server(args.profile)
        figures: dict[str, Any] = {**counts, **time_server(args.runs)}
        if not args.no_browser:
            figures.update(time_browser(args.runs, figures["session"]))
        figures.pop("session")
        from django.db import connection

        figures["database"] = connection.vendor
        nan = float("nan")
        print(
            "| nodes | devices | rows drawn | cells | queries (cold/warm) | page | server first | server cold | warm "
            "| browser first paint cold | warm | browser painted after load cold | warm |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {figures['nodes']:,} | {figures['devices']:,} | {figures.get('rows', '-')} | {figures['cells']:,} "
            f"| {figures['queries_cold']}/{figures['queries_warm']} | {figures['html_bytes'] / 1e3:.0f} kB "
            f"| {figures['server_first_median_s']:.2f} s "
            f"| {figures['server_cold_median_s']:.2f} s | {figures['server_warm_median_s']:.2f} s "
            f"| {figures.get('browser_cold_fcp_median_s', nan):.2f} s "
            f"| {figures.get('browser_warm_fcp_median_s', nan):.2f} s "
            f"| {figures.get('browser_cold_painted_median_s', nan):.2f} s "
            f"| {figures.get('browser_warm_painted_median_s', nan):.2f} s |"
        )
        print(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()

"""Cluster mode on a real control plane, beside kube-scheduler on the same nodes.

Not a test: it prints a markdown table for docs/benchmarks.md. It starts the test control
plane (etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from hack/kube,
KubeVirt's VMI CRD; see docs/testing.md) and, through the API, creates ``--nodes`` GPU nodes
(16 units of one MIG resource each: eight H100 split in two) and ``--gpus`` GPU devices: all
but ``--orders`` already Bound (the fleet, spread over the nodes at random), then the orders.
Nodes are plain API objects whose status the bench writes (no kubelet runs); the not-ready
taint the apiserver's admission puts on a new node is removed, as the node lifecycle
controller does once a kubelet reports Ready.

Side by side in one run:

* **gpuplane as deployed**: ``manage.py sync_cluster`` and a binder ``celery worker`` as
  processes, each with its deploy/ identity, and deploy/'s finalizer policy in the apiserver
  (``--finalizer-policy off``: without it, as on a cluster older than Kubernetes 1.36). The
  sync's first list into the mirror (time, RSS, then its CPU while idle, watching only);
  ``--orders`` new GPUs created through the API in sets of 1/2/4/8 until every one's status
  says Bound (the clock runs from the first create);
  then a demand-over-capacity batch (``--over`` times the free units) and how many of its sets
  are placed.
* **kube-scheduler** (built from the same module) on the same nodes, holding the same fleet
  (one pod per node, bound by nodeName, requesting the node's fleet units): one pod per
  order set requesting the set's units of the same extended resource, created while the
  scheduler runs, until every pod is bound; then the same over-capacity batch and how many
  pods it places. Once with NodeResourcesFit's MostAllocated scoring (bin packing), once with
  its default (LeastAllocated).
* **VMI create → admitted**, measured from the client: the webhook server (TLS, the
  apiserver's token checked) registered from deploy/; VMIs naming Bound sets, each beside
  the same create in a namespace the registration leaves out (webhook off), alternating;
  VMIs naming Pending sets (the sync queueing no pass and the worker running no full pass
  after its answer passes, so every set is still Pending when its VMI's create starts and the
  webhook's bind-and-wait does the work), one creator and ``--creators`` at once.

    .venv/bin/python -m bench.kube_bench --nodes 1000 --gpus 10000
    .venv/bin/python -m bench.kube_bench --nodes 10000 --gpus 100000

The over-capacity batch leaves orders waiting, older than the VMI phase's Pending orders, which
the passes then place first (oldest order first) on the fresh nodes meant for them: measure
Pending VMI creates in a run with ``--skip over``.

Uses a PostgreSQL database of its own (default gpuplane_kube_bench; dropped and made anew) and
Redis (``GPUPLANE_BENCH_REDIS_URL``).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    Watch,
    drop_database,
    ensure_database,
    pct,
    peak_rss_mib,
    rss_mib,
    setup_django,
    wait_idle,
)
from bench.servers import REDIS_URL, start_celery, stop
from harness.ports import free_port

MIG = "nvidia.com/mig-3g.40gb"
UNITS_PER_NODE = 16
TENANTS = 100
#: The namespace the registration leaves out, for the "webhook off" creates.
OFF_NAMESPACE = "bench-webhook-off"
BATCH_LABEL = "bench.gpuplane.io/batch"
GPUS = "/apis/gpuplane.io/v1alpha1/gpus"
VMIS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=10000, help="GPU devices in all: the fleet (Bound) and the orders")
    parser.add_argument("--orders", type=int, default=10000, help="new GPU devices to bind (in sets of 1/2/4/8)")
    parser.add_argument("--over", type=float, default=1.5, help="the over-capacity batch, times the free units")
    parser.add_argument("--vmis", type=int, default=200, help="VMI creates per latency measure")
    parser.add_argument("--creators", type=int, default=20, help="concurrent creators for the Pending measure")
    parser.add_argument("--threads", type=int, default=8, help="client threads creating objects")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--database", default="postgres://postgres@127.0.0.1:5432/gpuplane_kube_bench", help="dropped and made anew"
    )
    parser.add_argument("--skip", default="", help="comma-separated phases to leave out: scheduler,vmi,over")
    parser.add_argument(
        "--finalizer-policy",
        choices=("on", "off"),
        default="on",
        help="deploy/'s MutatingAdmissionPolicy putting gpuplane's finalizer on GPUs as they are created "
        "(off: the sync adds it with a PATCH per GPU, as on a cluster older than 1.36)",
    )
    return parser.parse_args()


def sets_of(units: int, rng: random.Random) -> list[int]:
    """Set sizes (1/2/4/8 devices, more small than large) adding up to ``units``."""
    sizes: list[int] = []
    left = units
    while left > 0:
        size = min(left, rng.choices((1, 2, 4, 8), weights=(4, 3, 2, 1))[0])
        sizes.append(size)
        left -= size
    return sizes


def in_parallel(threads: int, calls: list[Callable[[], Any]]) -> float:
    """Run the zero-argument ``calls`` on ``threads`` threads; the seconds it took."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()
    return time.perf_counter() - started


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_pids() -> list[int]:
    """Every PostgreSQL process on the machine (the bench's sessions are its only load)."""
    pids = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "postgres":
                pids.append(int(entry.name))
    return pids


class CpuShares:
    """CPU seconds each part of the run used over a span: where a phase's time went.

    A part is its processes, or a function finding them (PostgreSQL starts a backend per new
    connection: one that began within the span counts whole; one that ended within it is lost)."""

    def __init__(self, parts: dict[str, list[int] | Callable[[], list[int]]]) -> None:
        self.parts = parts
        self.before = self._read()

    def _read(self) -> dict[str, dict[int, float]]:
        seconds: dict[str, dict[int, float]] = {}
        for name, pids in self.parts.items():
            seconds[name] = {}
            for pid in pids() if callable(pids) else pids:
                with contextlib.suppress(OSError):  # a backend that ended meanwhile
                    seconds[name][pid] = proc_cpu_seconds(pid)
        own = os.times()
        seconds["this bench (its client threads)"] = {0: own.user + own.system}
        return seconds

    def summary(self, wall: float) -> str:
        after = self._read()
        used = {
            name: sum(now - self.before.get(name, {}).get(pid, 0.0) for pid, now in pids.items())
            for name, pids in after.items()
        }
        shares = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(used.items(), key=lambda i: -i[1]))
        return f"{shares}; {sum(used.values()) / wall:.2f} of the 2 cores over {wall:.0f} s"


class Tally:
    """The objects of one collection as a watch reports them, counted by state: the bench
    learns when a batch is done without listing it again and again (a LIST of 10,000 GPUs
    every half second took a fair share of the apiserver's CPU, more the longer the tail).
    The watch (``bench.common.Watch``) lists again and watches on when the apiserver ends it."""

    def __init__(self, plane: Any, path: str, state: Callable[[dict[str, Any]], str]) -> None:
        self.state = state
        self.states: dict[str, str] = {}
        self.watch = Watch(
            plane, path, listed=self._listed, event=self._event, timeout_seconds=7200, name=f"tally {path}"
        )

    @property
    def relists(self) -> int:
        return self.watch.relists

    def _listed(self, items: list[dict[str, Any]], now: float) -> None:
        self.states = {o["metadata"]["name"]: self.state(o) for o in items}

    def _event(self, kind: str, obj: dict[str, Any], now: float) -> None:
        if kind == "DELETED":
            self.states.pop(obj["metadata"]["name"], None)
        else:
            self.states[obj["metadata"]["name"]] = self.state(obj)

    def wait(self, state: str, expected: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Until ``expected`` objects are in ``state``; SystemExit after ``timeout`` seconds,
        when the watch fails, or when ``alive()`` turns false (the process doing the work died)."""
        deadline = time.monotonic() + timeout
        watch = self.watch
        with watch.changed:
            while sum(1 for s in self.states.values() if s == state) < expected:
                if watch.error or not alive() or time.monotonic() > deadline:
                    counts = dict(Counter(self.states.values()))
                    raise SystemExit(f"not {expected:,} {state} within {timeout:.0f} s: {counts} {watch.error}")
                watch.changed.wait(1.0)

    def close(self) -> None:
        self.watch.close()


def gpu_state(gpu: dict[str, Any]) -> str:
    return str((gpu.get("status") or {}).get("phase") or "Pending")


def pod_state(pod: dict[str, Any]) -> str:
    if pod["spec"].get("nodeName"):
        return "bound"
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return "unschedulable"
    return "pending"


class Bench:
    """One run: the control plane, the fleet, and the figures gathered on the way."""

    def __init__(self, args: argparse.Namespace) -> None:
        from harness.controlplane import ControlPlane

        self.args = args
        self.rng = random.Random(args.seed)
        self.plane = ControlPlane().start()
        self.figures: dict[str, str] = {"control plane start": f"{self.plane.started_seconds:.1f} s"}
        self.var = Path(tempfile.mkdtemp(prefix="gpuplane-kube-bench-"))  # the processes' logs, kept
        print(f"logs in {self.var}", file=sys.stderr)
        self.prefix = f"kube-bench-{os.getpid()}:"
        self.fleet: dict[str, int] = {}  # node -> units the fleet holds there
        self.order_sizes: list[int] = []
        self.stack = ExitStack()  # what the run installed in the control plane
        self.over_sizes: list[int] = []

    def note(self, key: str, value: str) -> None:
        self.figures[key] = value
        print(f"  {key}: {value}", file=sys.stderr, flush=True)

    def env(self, identity: str, **extra: str) -> dict[str, str]:
        env = {
            **os.environ,
            "DATABASE_URL": self.args.database,
            "CELERY_BROKER_URL": REDIS_URL,
            "GPUPLANE_BROKER_KEY_PREFIX": self.prefix,
            "GPUPLANE_VAR_DIR": str(self.var),
            "GPUPLANE_CLUSTER": "kubernetes",
            "KUBECONFIG": str(self.plane.kubeconfig(identity)),
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(32),
            "GPUPLANE_LOG_LEVEL": "WARNING",
            **extra,
        }
        env.pop("GPUPLANE_KUBE_HOST", None)
        return env

    # -- the cluster ----------------------------------------------------------------------------

    def create(self, objects: list[dict[str, Any]]) -> float:
        return in_parallel(self.args.threads, [lambda o=o: self.plane.seed(o) for o in objects])

    def nodes(self, count: int, first: int = 0) -> list[str]:
        from harness.shapes import node_obj

        names = [f"n{i:05d}" for i in range(first, first + count)]

        def make(name: str) -> None:
            node = node_obj(name, {MIG: UNITS_PER_NODE})
            node["status"]["allocatable"]["nvidia.com/GH100_H100_SXM5_80GB"] = "0"
            (stored,) = self.plane.seed(node)
            # What the node lifecycle controller does once the kubelet reports Ready.
            self.plane.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}})

        in_parallel(self.args.threads, [lambda n=n: make(n) for n in names])
        return names

    def setup(self) -> None:
        from binder.kube.client import FINALIZER
        from harness.shapes import class_obj, gpu_obj, namespace_obj

        args = self.args
        print(f"creating {args.nodes:,} nodes", file=sys.stderr, flush=True)
        started = time.perf_counter()
        names = self.nodes(args.nodes)
        self.note("nodes created through the API", f"{args.nodes:,} in {time.perf_counter() - started:.0f} s")
        self.plane.seed(*(namespace_obj(f"t{i}") for i in range(TENANTS)))
        if args.finalizer_policy == "on":  # as deployed (deploy/base/finalizer-policy.yaml)
            self.stack.enter_context(self.plane.finalizer_policy("t0"))
        self.plane.seed(class_obj("mig", MIG))
        # The fleet: Bound sets on nodes chosen at random among those with room.
        fleet_units = args.gpus - args.orders
        free = dict.fromkeys(names, UNITS_PER_NODE)
        gpus = []
        for index, size in enumerate(sets_of(fleet_units, self.rng)):
            roomy = [n for n in self.rng.sample(names, min(64, len(names))) if free[n] >= size]
            node = roomy[0] if roomy else next(n for n in names if free[n] >= size)
            free[node] -= size
            self.fleet[node] = self.fleet.get(node, 0) + size
            ns = f"t{index % TENANTS}"
            for d in range(size):
                gpu = gpu_obj(ns, f"fleet{index}-gpu{d}", "mig", f"fleet{index}", phase="Bound", node=node)
                # As gpuplane left them: Bound, with its finalizer. Without it the sync's first
                # list would write a finalizer on every fleet GPU (a one-off, ~100 a second
                # here) through the idle and orders measures.
                gpu["metadata"]["finalizers"] = [FINALIZER]
                gpus.append(gpu)
        print(f"creating the fleet: {len(gpus):,} Bound GPUs", file=sys.stderr, flush=True)
        seconds = self.create(gpus)
        if gpus:
            self.note("fleet GPUs (Bound) created through the API", f"{len(gpus):,} in {seconds:.0f} s")
        self.order_sizes = sets_of(args.orders, self.rng)
        free_units = args.nodes * UNITS_PER_NODE - args.gpus
        self.over_sizes = sets_of(int(free_units * args.over), self.rng)

    def orders(self, batch: str, sizes: list[int], first: int = 0) -> list[dict[str, Any]]:
        from harness.shapes import gpu_obj

        gpus = []
        for index, size in enumerate(sizes, start=first):
            ns = f"t{index % TENANTS}"
            for d in range(size):
                gpu = gpu_obj(ns, f"{batch}{index}-gpu{d}", "mig", f"{batch}{index}")
                gpu["metadata"]["labels"] = {BATCH_LABEL: batch}
                gpus.append(gpu)
        return gpus

    # -- gpuplane -------------------------------------------------------------------------------

    @contextmanager
    def gpuplane(self, *, auto_pass: bool, label: str, **settings: str) -> Iterator[subprocess.Popen[Any]]:
        """The sync and a binder worker as processes (``settings``: more of their environment);
        yields the sync once its first list is mirrored (timed, with its RSS)."""
        from binder import models

        extra = {"GPUPLANE_AUTO_PASS": "true" if auto_pass else "false", **settings}
        worker = start_celery(
            ["--pool", "solo", "-n", f"kube-bench-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat"],
            self.env("gpuplane-binder", **extra), self.var / f"worker-{label}.log",
        )  # fmt: skip
        self.worker_pid = worker.pid
        log = (self.var / f"sync-{label}.log").open("w")
        started = time.perf_counter()
        syncing = subprocess.Popen(
            [sys.executable, "manage.py", "sync_cluster", "--no-progress"],
            cwd=ROOT, env=self.env("gpuplane-sync", **extra), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            want_gpus, want_nodes = self.gpu_count(), len(self.fleet_nodes())
            while not (models.GpuDevice.objects.count() >= want_gpus and models.Node.objects.count() >= want_nodes):
                if syncing.poll() is not None:
                    raise SystemExit((self.var / f"sync-{label}.log").read_text()[-3000:])
                time.sleep(0.2)
            if label == "first start":  # a restart finds the mirror full already
                self.note(
                    "sync: first list of every kind into the mirror",
                    f"{time.perf_counter() - started:.1f} s for {want_gpus:,} GPUs and {want_nodes:,} nodes; "
                    f"RSS {rss_mib(syncing.pid):,.0f} MiB (peak {peak_rss_mib(syncing.pid):,.0f})",
                )
            yield syncing
        finally:
            stop(syncing)
            stop(worker)
            log.close()

    def cpu_shares(self, parts: dict[str, list[int] | Callable[[], list[int]]]) -> CpuShares:
        """CPU from now on of the control plane, PostgreSQL, this bench and ``parts``."""
        procs = {name: self.plane.processes[name].proc for name in ("kube-apiserver", "etcd")}
        plane = {name: [proc.pid] for name, proc in procs.items() if proc is not None}
        return CpuShares({**plane, **parts, "PostgreSQL": postgres_pids})

    def gpu_count(self) -> int:
        body = self.plane.request("GET", f"{GPUS}?limit=1")
        return int(body["metadata"].get("remainingItemCount", 0)) + len(body["items"])

    def fleet_nodes(self) -> list[dict[str, Any]]:
        return list(self.plane.request("GET", "/api/v1/nodes")["items"])

    def idle_cpu(self, process: subprocess.Popen[Any], seconds: float = 30) -> None:
        before = proc_cpu_seconds(process.pid)
        time.sleep(seconds)
        used = proc_cpu_seconds(process.pid) - before
        self.note(
            "sync: CPU while idle (watching only)",
            f"{used / seconds * 100:.1f} % of a core over {seconds:.0f} s; RSS {rss_mib(process.pid):,.0f} MiB",
        )

    def run_gpuplane(self) -> None:
        import redis

        from binder import models

        broker = redis.Redis.from_url(REDIS_URL)
        with self.gpuplane(auto_pass=True, label="first start") as syncing:
            wait_idle(broker, self.prefix, timeout=3600)  # the pass after the first list
            self.idle_cpu(syncing)
            gpus = self.orders("order", self.order_sizes)
            print(f"gpuplane: {len(gpus):,} orders in {len(self.order_sizes):,} sets", file=sys.stderr, flush=True)
            cpu = self.cpu_shares({"sync": [syncing.pid], "binder worker": [self.worker_pid]})
            tally = Tally(self.plane, f"{GPUS}?labelSelector={BATCH_LABEL}%3Dorder", gpu_state)
            started = time.perf_counter()
            created = self.create(gpus)
            tally.wait("Bound", len(gpus), timeout=3600, alive=lambda: syncing.poll() is None)
            seconds = time.perf_counter() - started
            tally.close()
            print(f"  (the bench's watch listed again {tally.relists} times)", file=sys.stderr)
            self.gpuplane_orders = seconds
            self.note(
                f"gpuplane: {len(gpus):,} orders, first create → every status Bound",
                f"{seconds:.1f} s (creating them took {created:.1f} s)",
            )
            self.note("gpuplane: CPU over those orders", cpu.summary(seconds))
            if "over" not in self.args.skip:
                gpus = self.orders("over", self.over_sizes)
                self.create(gpus)
                while models.GpuDevice.objects.filter(name__startswith="over").count() < len(gpus):
                    time.sleep(0.5)  # the sync mirrors them (and queues passes) first
                wait_idle(broker, self.prefix, timeout=3600)
                time.sleep(2)  # the last creates' events, mirrored, may queue one more pass
                wait_idle(broker, self.prefix, timeout=3600)
                self.gpuplane_over = self.sets_bound("over", self.over_sizes)
                self.note(
                    f"gpuplane: over capacity ({self.args.over:g}× the free units), sets placed",
                    f"{self.gpuplane_over:,} of {len(self.over_sizes):,}",
                )

    def sets_bound(self, batch: str, sizes: list[int]) -> int:
        query = urllib.parse.urlencode({"labelSelector": f"{BATCH_LABEL}={batch}"})
        bound: dict[str, int] = {}
        for gpu in self.plane.request("GET", f"{GPUS}?{query}")["items"]:
            if (gpu.get("status") or {}).get("phase") == "Bound":
                vm = gpu["spec"]["vmName"]
                bound[vm] = bound.get(vm, 0) + 1
        return sum(1 for index, size in enumerate(sizes) if bound.get(f"{batch}{index}", 0) == size)

    # -- kube-scheduler -------------------------------------------------------------------------

    def pods(self, namespace: str, sizes: list[int], prefix: str) -> list[dict[str, Any]]:
        return [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{prefix}{index}", "namespace": namespace},
                "spec": {
                    "containers": [
                        {
                            "name": "vm",
                            "image": "registry.example/vm:1",
                            "resources": {"requests": {MIG: str(size)}, "limits": {MIG: str(size)}},
                        }
                    ],
                },
            }  # fmt: skip
            for index, size in enumerate(sizes)
        ]

    def scheduler_config(self, strategy: str) -> Path:
        import json

        path = self.var / f"scheduler-{strategy}.json"
        config = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.plane.kubeconfig()), "qps": 5000, "burst": 5000},
            "leaderElection": {"leaderElect": False},
            "profiles": [{
                "schedulerName": "default-scheduler",
                "pluginConfig": [{
                    "name": "NodeResourcesFit",
                    "args": {"scoringStrategy": {"type": strategy, "resources": [{"name": MIG, "weight": 1}]}},
                }],
            }],
        }  # fmt: skip
        path.write_text(json.dumps(config))
        return path

    def pod_states(self, namespace: str) -> tuple[int, int, int]:
        """(bound, unschedulable, total) of the namespace's pods."""
        items = self.plane.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
        counts = Counter(pod_state(pod) for pod in items)
        return counts["bound"], counts["unschedulable"], len(items)

    def run_scheduler(self) -> None:
        from harness.controlplane import tool
        from harness.shapes import namespace_obj

        # The fleet, as the scheduler sees a cluster's running pods: one per node, bound there.
        self.plane.seed(namespace_obj("fleet"))
        placeholders = []
        for index, (node, units) in enumerate(sorted(self.fleet.items())):
            (pod,) = self.pods("fleet", [units], "fleet")
            pod["metadata"]["name"] = f"fleet{index}"
            pod["spec"]["nodeName"] = node
            placeholders.append(pod)
        if placeholders:
            self.create(placeholders)
        self.scheduler_orders: dict[str, float] = {}
        self.scheduler_over: dict[str, int] = {}
        for strategy in ("MostAllocated", "LeastAllocated"):
            ns = f"sched-{strategy.lower()}"
            self.plane.seed(namespace_obj(ns))
            log = (self.var / f"scheduler-{strategy}.log").open("w")
            scheduler = subprocess.Popen(  # noqa: S603 - our own binary
                [str(tool("kube-scheduler")), f"--config={self.scheduler_config(strategy)}", "--secure-port=0"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                time.sleep(3)  # its informers list the nodes and pods first
                pods = self.pods(ns, self.order_sizes, "order")
                print(f"kube-scheduler ({strategy}): {len(pods):,} pods", file=sys.stderr, flush=True)
                cpu = self.cpu_shares({"kube-scheduler": [scheduler.pid]})
                tally = Tally(self.plane, f"/api/v1/namespaces/{ns}/pods", pod_state)
                started = time.perf_counter()
                created = self.create(pods)
                try:
                    tally.wait("bound", len(pods), timeout=3600, alive=lambda s=scheduler: s.poll() is None)
                except SystemExit:
                    print((self.var / f"scheduler-{strategy}.log").read_text()[-3000:], file=sys.stderr)
                    raise
                seconds = time.perf_counter() - started
                tally.close()
                print(f"  (the bench's watch listed again {tally.relists} times)", file=sys.stderr)
                self.scheduler_orders[strategy] = seconds
                self.note(
                    f"kube-scheduler ({strategy}): {len(pods):,} pods, first create → every pod bound",
                    f"{seconds:.1f} s (creating them took {created:.1f} s)",
                )
                self.note(f"kube-scheduler ({strategy}): CPU over those pods", cpu.summary(seconds))
                if "over" not in self.args.skip:
                    over = self.pods(ns, self.over_sizes, "over")
                    self.create(over)
                    while True:
                        bound, unschedulable, total = self.pod_states(ns)
                        if bound + unschedulable >= total:
                            break
                        time.sleep(1)
                    self.scheduler_over[strategy] = bound - len(pods)
                    self.note(
                        f"kube-scheduler ({strategy}): over capacity, pods placed",
                        f"{bound - len(pods):,} of {len(self.over_sizes):,}",
                    )
            finally:
                stop(scheduler)
                log.close()
            # The next strategy starts from the fleet alone.
            self.plane.raw("DELETE", f"/api/v1/namespaces/{ns}/pods?gracePeriodSeconds=0", timeout=600)
            while self.plane.request("GET", f"/api/v1/namespaces/{ns}/pods?limit=1")["items"]:
                time.sleep(0.5)
        self.plane.raw("DELETE", "/api/v1/namespaces/fleet/pods?gracePeriodSeconds=0", timeout=600)

    # -- VMI creates ----------------------------------------------------------------------------

    def register(self, url: str) -> None:
        from harness.manifests import overlay

        (config,) = [d for d in overlay("cluster") if d["kind"] == "MutatingWebhookConfiguration"]
        config["webhooks"][0]["clientConfig"] = {
            "url": f"{url}/webhooks/vmi",
            "caBundle": base64.b64encode(self.plane.pki.ca_file.read_bytes()).decode(),
        }
        # One namespace the webhook is not called for: the "webhook off" creates go there,
        # interleaved with the "on" ones, so both see the same machine at the same moment.
        (excluded,) = config["webhooks"][0]["namespaceSelector"]["matchExpressions"]
        excluded["values"].append(OFF_NAMESPACE)
        self.plane.apply(config)

    def vmi(self, namespace: str, vm: str, devices: list[str]) -> dict[str, Any]:
        from harness.factories import new_vmi

        body = new_vmi(namespace, vm, devices)
        body.pop("status", None)
        body["metadata"] = {k: v for k, v in body["metadata"].items() if v is not None}
        return body

    def create_vmi(self, body: dict[str, Any], dry_run: bool = False) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        query = "?dryRun=All" if dry_run else ""
        stored = self.plane.request("POST", VMIS.format(ns=body["metadata"]["namespace"]) + query, body)
        return time.perf_counter() - started, stored

    def bound_vmis(self, batch: str, sizes: list[int], picks: range) -> list[dict[str, Any]]:
        return [
            self.vmi(f"t{i % TENANTS}", f"{batch}{i}", [f"{batch}{i}-gpu{d}" for d in range(sizes[i])]) for i in picks
        ]

    def time_bound(self, count: int, port: int) -> None:
        """VMI creates naming Bound sets, through the webhook and past it, side by side."""
        from harness.shapes import namespace_obj

        # Bound sets, webhook on and off side by side: each "off" create is the same
        # VMI in a namespace the registration leaves out, and the two alternate in ABBA
        # order, so a slow moment of the machine falls on both.
        self.plane.seed(namespace_obj(OFF_NAMESPACE))
        self.register(f"https://127.0.0.1:{port}")
        probe = self.bound_vmis("order", self.order_sizes, range(count, count + 1))[0]
        while not self.create_vmi(probe, dry_run=True)[1]["spec"].get("nodeSelector"):
            time.sleep(0.2)
        bodies = self.bound_vmis("order", self.order_sizes, range(count))
        webhook_before = self.plane.webhook_seconds("vmi.gpuplane.io")
        on: list[float] = []
        off: list[float] = []
        for i, body in enumerate(bodies):
            twin = {**body, "metadata": {**body["metadata"], "namespace": OFF_NAMESPACE}}
            for which in ("on", "off") if i % 2 == 0 else ("off", "on"):
                if which == "on":
                    seconds, stored = self.create_vmi(body)
                    assert stored["spec"]["nodeSelector"], stored["metadata"]["name"]
                    on.append(seconds)
                else:
                    seconds, stored = self.create_vmi(twin)
                    assert not stored["spec"].get("nodeSelector"), "the webhook ran in " + OFF_NAMESPACE
                    off.append(seconds)
        after = self.plane.webhook_seconds("vmi.gpuplane.io")
        calls, total = (a - b for a, b in zip(after, webhook_before, strict=True))
        direct = self.straight_to_webhook(port, bodies)
        self.note(
            f"VMI create, webhook off ({count} one at a time, interleaved with the creates below)",
            f"p50 {pct(off, 50) * 1000:.0f} ms, p99 {pct(off, 99) * 1000:.0f} ms",
        )
        self.note(
            f"VMI create naming a Bound set, webhook on ({count} one at a time)",
            f"p50 {pct(on, 50) * 1000:.0f} ms, p99 {pct(on, 99) * 1000:.0f} ms "
            f"(p99 ÷ webhook off: {pct(on, 99) / pct(off, 99):.2f}); the webhook call as the "
            f"apiserver timed it: mean {total / max(calls, 1) * 1000:.1f} ms over {calls:.0f} calls",
        )
        self.note(
            f"the same {count} reviews sent straight to the webhook server (TLS, one keep-alive connection)",
            f"p50 {pct(direct, 50) * 1000:.1f} ms, p99 {pct(direct, 99) * 1000:.1f} ms",
        )

    def straight_to_webhook(self, port: int, bodies: list[dict[str, Any]]) -> list[float]:
        """Each VMI's AdmissionReview posted to the webhook server as the apiserver posts it,
        one at a time on one connection: the server's share of a create without the apiserver's."""
        import http.client
        import json

        from harness.factories import review

        headers = {"Authorization": f"Bearer {self.plane.webhook_token}", "Content-Type": "application/json"}
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=self.plane.ssl_context(), timeout=15)
        seconds = []
        try:
            for body in bodies:
                payload = json.dumps(review(body)).encode()
                started = time.perf_counter()
                conn.request("POST", "/webhooks/vmi?timeout=10s", payload, headers)
                answer = json.loads(conn.getresponse().read())
                seconds.append(time.perf_counter() - started)
                assert answer["response"]["allowed"] and answer["response"].get("patch"), answer["response"]
        finally:
            conn.close()
        return seconds

    def run_vmis(self) -> None:
        from binder import models

        count, creators = self.args.vmis, self.args.creators
        if len(self.order_sizes) < 2 * count:
            raise SystemExit(f"--vmis {count} needs at least {2 * count} order sets")
        # Room for the Pending orders: fresh nodes (every other node may be full by now).
        fresh = (count + count + UNITS_PER_NODE - 1) // UNITS_PER_NODE + 2
        self.nodes(fresh, first=self.args.nodes)
        crt, key = self.plane.pki.serving("webhook")
        env = self.env(
            "gpuplane-webhook",
            GPUPLANE_AUTO_PASS="false",  # noqa: S106 - not a password
            GPUPLANE_TLS_CERT_FILE=str(crt),
            GPUPLANE_TLS_KEY_FILE=str(key),
            GPUPLANE_WEBHOOK_AUTH="token",
            GPUPLANE_WEBHOOK_TOKEN_FILE=str(self.plane.dir / "webhook-token"),
            GPUPLANE_WEBHOOK_ENABLED="true",
        )
        port = free_port()
        env["GPUPLANE_WEBHOOK_BIND"] = f"127.0.0.1:{port}"
        log = (self.var / "webhook.log").open("w")
        server = subprocess.Popen(
            [sys.executable, "deploy/webhook_server.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            # No full pass in this phase: one after an answer pass (1 s later, by default) would
            # place every Pending set still waiting, and the VMIs after it would name Bound sets.
            # So each Pending VMI's set is still Pending when its create starts, and its answer
            # pass (beside the other creators') is what the create waits for.
            quiet = {"GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS": "60", "GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS": "600"}
            with self.gpuplane(auto_pass=False, label="restart", **quiet) as _syncing:
                import socket

                deadline = time.monotonic() + 60
                while True:
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        break
                    except OSError:
                        if server.poll() is not None or time.monotonic() > deadline:
                            raise SystemExit((self.var / "webhook.log").read_text()[-3000:]) from None
                        time.sleep(0.2)
                self.time_bound(count, port)
                # Pending sets: single-GPU orders the sync mirrors without queueing a pass.
                for label, creators_now, n in (("1 creator", 1, count // 2), (f"{creators} creators", creators, count)):
                    batch = f"pend{creators_now}x"
                    gpus = self.orders(batch, [1] * n)
                    self.create(gpus)
                    while models.GpuDevice.objects.filter(name__startswith=batch).count() < n:
                        time.sleep(0.2)
                    bodies = [self.vmi(f"t{i % TENANTS}", f"{batch}{i}", [f"{batch}{i}-gpu0"]) for i in range(n)]
                    latencies: list[float] = []
                    refused: list[str] = []

                    def one(
                        body: dict[str, Any], latencies: list[float] = latencies, refused: list[str] = refused
                    ) -> None:
                        try:
                            latencies.append(self.create_vmi(body)[0])
                        except Exception as exc:  # noqa: BLE001 - counted and reported
                            refused.append(str(exc)[:200])

                    in_parallel(creators_now, [lambda b=b: one(b) for b in bodies])
                    self.note(
                        f"VMI create naming a Pending set, admitted ({label}, {n} VMIs)",
                        (
                            f"p50 {pct(latencies, 50) * 1000:.0f} ms, p99 {pct(latencies, 99) * 1000:.0f} ms"
                            if latencies
                            else "none"
                        )
                        + (f"; {len(refused)} refused, e.g. {refused[0]}" if refused else ""),
                    )
        finally:
            stop(server)
            log.close()

    def table(self) -> str:
        if hasattr(self, "gpuplane_orders") and getattr(self, "scheduler_orders", None):
            for strategy, seconds in self.scheduler_orders.items():
                self.figures[f"ratio: gpuplane ÷ kube-scheduler ({strategy}), orders to all bound"] = (
                    f"{self.gpuplane_orders / seconds:.2f}"
                )
            for strategy, placed in getattr(self, "scheduler_over", {}).items():
                self.figures[
                    f"over capacity ({self.args.over:g}× the free units): sets placed ÷ pods placed ({strategy})"
                ] = (
                    f"{self.gpuplane_over:,} ÷ {placed:,} = {self.gpuplane_over / max(placed, 1):.3f} "
                    f"(of {len(self.over_sizes):,})"
                )
        lines = [
            f"| measure ({self.args.nodes:,} nodes × {UNITS_PER_NODE} units, {self.args.gpus:,} GPUs, "
            f"{self.args.orders:,} of them orders in {len(self.order_sizes):,} sets) | figure |",
            "|---|---|",
        ]
        lines += [f"| {key} | {value} |" for key, value in self.figures.items()]
        return "\n".join(lines)


def main() -> None:
    args = parse_args()
    drop_database(args.database)
    ensure_database(args.database)
    setup_django(args.database, migrate=True)
    bench = Bench(args)
    try:
        bench.setup()
        bench.run_gpuplane()
        if "scheduler" not in args.skip:
            bench.run_scheduler()
        if "vmi" not in args.skip:
            bench.run_vmis()
    finally:
        bench.stack.close()
        bench.plane.stop()
    print(bench.table())


if __name__ == "__main__":
    main()

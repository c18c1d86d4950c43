"""What gpuplane adds to a VM start, on the VM cluster: VMI create → launcher pod Running.

Not a test: it prints a markdown table for docs/benchmarks.md (and, with ``--json``, its raw
figures). It starts the VM cluster of the tests (``harness/vm_cluster.py``): etcd,
kube-apiserver and kube-controller-manager, kube-scheduler, KubeVirt's virt-controller v1.8.2
and kwok playing ``--nodes`` kubelets (``--gpus-per-node`` units of one raw GPU resource each),
then gpuplane as deployed (:class:`Gpuplane`: ``sync_cluster``, a binder ``celery worker`` and
``celery beat`` on PostgreSQL and Redis, the webhook server over TLS registered from deploy/,
deploy/'s launcher policy, and deploy/'s finalizer policy unless ``--finalizer-policy off``).

One VM start is timed from the VMI create call to the moment a watch on launcher pods reports
that VMI's launcher ``Running`` (kwok runs a pod once kube-scheduler bound it). Three arms, in
one run, in ABBA rounds (A B C, then C B A, ...) so a slow moment of the shared machine falls on
each:

* **A, gpuplane, set Bound**: the VMI names gpuplane devices whose set is Bound already (a
  stopped VM's kept devices: made Bound by an untimed first start, kept across the stops). The
  webhook pins it to the set's node; kube-scheduler places the launcher there.
* **B, gpuplane, new order**: the VM's GPUs are created (Pending) right before its VMI, and the
  webhook's bind request places them (bind and wait: an answer pass in the binder worker). The
  full passes are pushed off (``GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS`` and
  ``..._AFTER_ANSWER_SECONDS`` 60, beat's resync every 600 s) so that a set is still Pending when
  its VMI is created; a start whose set a full pass placed first is left out and counted.
* **C, without gpuplane**: the same VMI naming the raw resource itself (``deviceName`` is the
  resource name), in a namespace the webhook registration leaves out: kube-scheduler alone
  places the launcher. gpuplane still runs (its sync mirrors that namespace too).

Each arm runs with 1 creator (``--serial`` VMIs one after the other per round) and with
``--creators`` at once (that many VMIs per round); between rounds the VMIs are deleted and
the bench waits until their launchers are gone. For each start window the apiserver's writes
(create/update/patch/delete, from its audit log, by user; kube-controller-manager's are not
logged, and kwok's node leases are left out as background) and the CPU of every process are
added up per arm.

    .venv/bin/python -m bench.vm_start_bench --nodes 50
    .venv/bin/python -m bench.vm_start_bench --nodes 1000 --json vm-start.json

The KubeVirt VM controller live-updates a running VMI's node selector and affinity from its
VM's template (1.8's LiveUpdate rollout), so the bench creates VMIs directly (no VM) and checks
where each launcher ran on the pod itself (``spec.nodeName``), never on the VMI's spec.

Uses a PostgreSQL database of its own (default gpuplane_vmbench; dropped and made anew, dropped
at the end unless ``--keep-database``) and Redis (``GPUPLANE_BENCH_REDIS_URL``, keys under a
prefix of this run). It stops before it starts when the server has fewer than
:data:`CONNECTIONS` connections free (another run sharing it would make it fail mid-run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Watch, drop_database, ensure_database, require_connections, setup_django
from bench.common import pct as _pct
from bench.kube_bench import proc_cpu_seconds
from bench.servers import REDIS_URL

H100 = "nvidia.com/GH100_H100_SXM5_80GB"
CLASS = "h100"
ARMS = {
    "A": "gpuplane, set Bound",
    "B": "gpuplane, new order",
    "C": "without gpuplane",
}
NAMESPACES = {"A": "vmb-kept", "B": "vmb-new", "C": "vmb-plain"}
VMIS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"
GPUS = "/apis/gpuplane.io/v1alpha1/namespaces/{ns}/gpus"
WEBHOOK_CONFIG = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/gpuplane-vmi"
WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})
#: Background writes, not a VM start's: kwok renewing every node's lease (as kubelets do), and
#: leader-election leases (virt-controller's).
BACKGROUND = frozenset({"leases", "nodes", "nodes/status"})
START_TIMEOUT = 180.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000, help="kwok nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="units of one raw GPU resource per node")
    parser.add_argument("--devices", type=int, default=1, help="GPU devices per VM")
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds per concurrency (each runs every arm once)")
    parser.add_argument("--serial", type=int, default=20, help="VMIs per round and arm with 1 creator")
    parser.add_argument(
        "--creators", type=int, default=20, help="concurrent creators (and VMIs per round) in the second measure"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds after the last launcher runs that a start window still counts writes",
    )
    parser.add_argument("--threads", type=int, default=8, help="client threads creating the nodes")
    parser.add_argument(
        "--finalizer-policy",
        choices=("on", "off"),
        default="on",
        help="deploy/'s MutatingAdmissionPolicy putting gpuplane's finalizer on new GPUs (off: the sync patches it on)",
    )
    parser.add_argument(
        "--database",
        default="postgres://postgres@127.0.0.1:5432/gpuplane_vmbench",
        help="PostgreSQL database of the run: dropped and made anew",
    )
    parser.add_argument("--keep-database", action="store_true", help="do not drop the database at the end")
    parser.add_argument(
        "--json", metavar="FILE", default="", help="also write the raw figures as JSON to FILE ('-': stdout)"
    )
    return parser.parse_args()


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    return _pct(values, p) if values else float("nan")


# -- processes and their CPU ----------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, process group) of ``pid``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().replace(b"\0", b" ").decode(errors="replace")


GPUPLANE_PARTS = (
    ("gpuplane sync", "sync_cluster"),
    ("gpuplane binder worker", " worker "),
    ("gpuplane beat", " beat "),
    ("gpuplane webhook server", "webhook_server.py"),
)


def gpuplane_groups() -> dict[str, int]:
    """gpuplane's processes this bench started (each leads a process group of its own:
    the webhook server's granian workers are in its group), by part."""
    groups: dict[str, int] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            pid = int(entry.name)
            parent, group = _stat(pid)
            if parent != me or group != pid:
                continue
            command = _cmdline(pid)
            for part, marker in GPUPLANE_PARTS:
                if marker in command:
                    groups[part] = pid
    return groups


def group_pids(group: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if _stat(int(entry.name))[1] == group:
                    pids.append(int(entry.name))
    return pids


class Cpu:
    """CPU seconds of each part of the run, read at the start and end of each window."""

    def __init__(self, plane: Any, database: str) -> None:
        self.fixed = {name: p.proc.pid for name, p in plane.processes.items() if p.proc is not None}
        self.groups = gpuplane_groups()
        self.database = database
        self.conn: Any = None

    def postgres(self) -> list[int]:
        """The PostgreSQL backends serving this run's database, on one connection kept open
        (the server is shared, its connections few); none if it cannot be read."""
        import psycopg

        from bench.common import admin_url, database_name

        try:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(admin_url(self.database), autocommit=True)
            rows = self.conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s", [database_name(self.database)]
            ).fetchall()
        except psycopg.Error:
            return []
        return [int(r[0]) for r in rows]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def read(self) -> dict[str, float]:
        parts: dict[str, list[int]] = {name: [pid] for name, pid in self.fixed.items()}
        parts |= {name: group_pids(group) for name, group in self.groups.items()}
        parts["PostgreSQL (this database)"] = self.postgres()
        seconds: dict[str, float] = {}
        for name, pids in parts.items():
            total = 0.0
            for pid in pids:
                with contextlib.suppress(OSError):
                    total += proc_cpu_seconds(pid)
            seconds[name] = total
        own = os.times()
        seconds["the bench"] = own.user + own.system
        return seconds


# -- the launchers, as a watch reports them --------------------------------------------------------


class Launchers:
    """Every virt-launcher pod, from one watch (``bench.common.Watch``, which lists again and
    watches on when the apiserver ends it): when each VMI's launcher was first seen Running
    (keyed by the VMI's uid, KubeVirt's ``kubevirt.io/created-by`` label), on which node, and
    which launchers still exist."""

    PATH = "/api/v1/pods?labelSelector=kubevirt.io%3Dvirt-launcher"

    def __init__(self, plane: Any) -> None:
        self.running: dict[str, tuple[float, str]] = {}
        self.live: dict[str, str] = {}  # pod uid -> namespace
        self.watch = Watch(
            plane, self.PATH, listed=self._listed, event=self._seen, timeout_seconds=3600, name="launcher watch"
        )

    @property
    def relists(self) -> int:
        return self.watch.relists

    def _seen(self, kind: str, pod: dict[str, Any], now: float) -> None:
        meta = pod["metadata"]
        if kind == "DELETED":
            self.live.pop(meta["uid"], None)
            return
        self.live[meta["uid"]] = meta.get("namespace", "")
        vmi = (meta.get("labels") or {}).get("kubevirt.io/created-by", "")
        if vmi and (pod.get("status") or {}).get("phase") == "Running" and vmi not in self.running:
            self.running[vmi] = (now, pod["spec"].get("nodeName", ""))

    def _listed(self, pods: list[dict[str, Any]], now: float) -> None:
        self.live = {}
        for pod in pods:
            self._seen("ADDED", pod, now)

    def wait_running(self, vmi_uid: str, timeout: float) -> tuple[float, str]:
        """(when, node) the launcher of the VMI ``vmi_uid`` was first seen Running."""
        watch = self.watch
        with watch.changed:
            if not watch.changed.wait_for(lambda: vmi_uid in self.running or bool(watch.error), timeout):
                raise TimeoutError(f"no launcher Running for VMI {vmi_uid} within {timeout:.0f} s")
            if vmi_uid not in self.running:
                raise SystemExit(f"the launcher watch failed: {watch.error}")
            return self.running[vmi_uid]

    def wait_gone(self, namespace: str, timeout: float) -> None:
        with self.watch.changed:
            if not self.watch.changed.wait_for(lambda: namespace not in self.live.values(), timeout):
                raise SystemExit(f"launchers in {namespace} still there after {timeout:.0f} s")

    def close(self) -> None:
        self.watch.close()


# -- the run ----------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What one arm at one concurrency measured, over its rounds."""

    starts: list[float] = field(default_factory=list)  # create call → launcher Running, s
    admitted: list[float] = field(default_factory=list)  # the create call alone, s
    windows: float = 0.0  # seconds of its start windows
    webhook_calls: float = 0.0  # the apiserver's calls of gpuplane's webhook (its own metric)
    #: How long the apiserver took to serve each of gpuplane's own writes (audit log), by writer.
    served: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    webhook_seconds: float = 0.0
    #: The same calls as the webhook server timed them, arrival to answer (its own metric).
    served_calls: float = 0.0
    served_seconds: float = 0.0
    writes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (writer, resource, verb)
    background: int = 0
    cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wrong_node: int = 0
    placed_by_pass: int = 0
    failed: int = 0
    vmis: int = 0


def writer(user: str, resource: str) -> str:
    """Who made a write, by audit user (kwok and the bench both act as the test admin: told
    apart by what they write)."""
    if user == "test-admin":
        if resource.startswith("pods"):
            return "kwok (kubelets)"
        if resource in BACKGROUND:
            return "kwok (node leases)"
        return "the bench (the tenant's creates)"
    if user == "system:kube-scheduler":
        return "kube-scheduler"
    if user.endswith(":kubevirt-controller"):
        return "virt-controller"
    if ":gpuplane-" in user:
        return user.rsplit(":", 1)[1]
    return user


def gpuplane_writes(audit_log: Path, offset: int) -> Iterator[tuple[str, float]]:
    """(writer, seconds the apiserver took) of each of gpuplane's writes in the audit log after
    ``offset``: the webhook's write inside the admission call, the binder's answer."""
    import datetime as dt

    with audit_log.open() as handle:
        handle.seek(offset)
        for line in handle:
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                user = event["user"]["username"]
                if (
                    ":gpuplane-" not in user
                    or event.get("verb") not in WRITES
                    or event.get("stage") != "ResponseComplete"
                ):
                    continue
                received = dt.datetime.fromisoformat(event["requestReceivedTimestamp"])
                done = dt.datetime.fromisoformat(event["stageTimestamp"])
                yield user.rsplit(":", 1)[1], (done - received).total_seconds()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.var = Path(tempfile.mkdtemp(prefix="gpuplane-vm-start-bench-"))
        print(f"logs in {self.var}", file=sys.stderr, flush=True)
        self.stack = contextlib.ExitStack()
        self.tallies: dict[tuple[str, int], Tally] = defaultdict(Tally)
        self.figures: dict[str, Any] = {"args": vars(args), "load": []}
        self.kept: dict[str, str] = {}  # A's VM -> the node its set is Bound on
        self.metrics_token = secrets.token_hex(16)
        self.metrics_url = ""

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def load(self, when: str) -> None:
        one, five, fifteen = os.getloadavg()
        self.figures["load"].append({"when": when, "1m": one, "5m": five, "15m": fifteen})
        self.note(f"  load average ({when}): {one:.2f} {five:.2f} {fifteen:.2f}")

    # -- set-up ---------------------------------------------------------------------------------

    def start(self) -> None:
        from harness import workers
        from harness.ports import free_port
        from harness.shapes import class_obj
        from harness.vm_cluster import Gpuplane, VmCluster

        args = self.args
        # The cluster's processes and gpuplane's under this run's Redis keys.
        workers.REDIS_URL = REDIS_URL
        workers.PREFIX = f"gpuplane-vmbench-{os.getpid()}:"
        os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(32))
        self.load("start")
        started = time.perf_counter()
        self.cluster = VmCluster()
        self.stack.callback(self.cluster.stop)
        self.cluster.start()
        self.plane = self.cluster.plane
        self.figures["cluster start s"] = time.perf_counter() - started
        self.note(f"VM cluster up in {self.figures['cluster start s']:.1f} s; {args.nodes:,} nodes")
        started = time.perf_counter()
        names = [f"n{i:05d}" for i in range(args.nodes)]
        with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(lambda n: self.cluster.add_node(n, {H100: args.gpus_per_node}), names))
        self.wait_nodes_ready(len(names))
        self.figures["nodes Ready s"] = time.perf_counter() - started
        self.note(f"{args.nodes:,} nodes Ready and untainted in {self.figures['nodes Ready s']:.1f} s")
        self.plane.request("POST", "/apis/gpuplane.io/v1alpha1/gpuclasses", class_obj(CLASS, H100))
        for namespace in NAMESPACES.values():
            self.cluster.tenant_namespace(namespace)
        if args.finalizer_policy == "on":
            self.stack.enter_context(self.plane.finalizer_policy(NAMESPACES["B"]))
        settings = {
            # As deployed, but with the full passes pushed off: arm B's sets stay Pending until
            # their VMI's bind request (see the module's docstring).
            "GPUPLANE_RESYNC_SECONDS": "600",
            "GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS": "60",
            "GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS": "60",
            "GPUPLANE_WATCH_SECONDS": "60",
            # The webhook server's own /metrics: each call as it timed it, beside the apiserver's.
            "GPUPLANE_WEBHOOK_METRICS_BIND": f"127.0.0.1:{free_port()}",
            "GPUPLANE_METRICS_TOKEN": self.metrics_token,
        }
        self.metrics_url = f"http://{settings['GPUPLANE_WEBHOOK_METRICS_BIND']}/metrics"
        self.gpuplane = Gpuplane(self.cluster, self.var, **settings)
        self.stack.callback(self.gpuplane.stop)
        self.gpuplane.start()
        self.exclude_from_webhook(NAMESPACES["C"])
        self.wait_mirrored(args.nodes)
        self.launchers = Launchers(self.plane)
        self.stack.callback(self.launchers.close)
        self.cpu = Cpu(self.plane, args.database)
        self.stack.callback(self.cpu.close)
        self.note(f"gpuplane up; CPU measured for: {', '.join(sorted(self.cpu.read()))}")

    def wait_nodes_ready(self, count: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ready = 0
            for node in self.plane.request("GET", "/api/v1/nodes")["items"]:
                conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions") or []}
                taints = {t["key"] for t in node.get("spec", {}).get("taints") or []}
                ready += conditions.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints
            if ready >= count:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"only {ready} of {count} nodes Ready and untainted after {timeout:.0f} s")
            time.sleep(2)

    def wait_mirrored(self, nodes: int, timeout: float = 600) -> None:
        from binder import models

        deadline = time.monotonic() + timeout
        while models.Node.objects.count() < nodes:
            if time.monotonic() > deadline:
                raise SystemExit(f"the sync mirrored {models.Node.objects.count()} of {nodes} nodes\n"
                                 + self.gpuplane.log("sync")[-3000:])  # fmt: skip
            time.sleep(0.5)

    def served_seconds(self) -> tuple[float, float]:
        """(calls, seconds) of the webhook server's decided calls since it started, as it timed
        them itself from arrival to answer (``gpuplane_webhook_review_seconds``, every outcome)."""
        import urllib.request

        from harness.prometheus import histogram_totals

        headers = {"Authorization": f"Bearer {self.metrics_token}"}
        request = urllib.request.Request(self.metrics_url, headers=headers)  # noqa: S310 - loopback, http
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback, http
            return histogram_totals(response.read().decode(), "gpuplane_webhook_review_seconds")

    def exclude_from_webhook(self, namespace: str) -> None:
        """Leave ``namespace`` out of deploy/'s webhook registration: its VMIs never reach
        gpuplane. Waits until a dry-run VMI there naming a gpuplane device that does not exist
        is allowed (the webhook would refuse it)."""
        from harness.controlplane import ApiError

        config = self.plane.request("GET", WEBHOOK_CONFIG)
        (excluded,) = config["webhooks"][0]["namespaceSelector"]["matchExpressions"]
        excluded["values"].append(namespace)
        self.plane.request("PUT", WEBHOOK_CONFIG, config)
        probe = self.vmi(namespace, "probe", ["gpuplane.io/nothing"])
        deadline = time.monotonic() + 30
        while True:
            try:
                self.plane.request("POST", VMIS.format(ns=namespace) + "?dryRun=All", probe)
                return
            except ApiError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # -- objects --------------------------------------------------------------------------------

    @staticmethod
    def vmi(namespace: str, name: str, device_names: list[str]) -> dict[str, Any]:
        """A VMI as KubeVirt's VM controller makes it from the tests' VM template (a container
        disk, no network), its GPUs named by ``device_names``."""
        from harness.vm_cluster import virtual_machine

        template = virtual_machine(namespace, name, [])["spec"]["template"]
        spec = template["spec"]
        spec["domain"]["devices"]["gpus"] = [{"name": f"gpu{i}", "deviceName": d} for i, d in enumerate(device_names)]
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": namespace, "labels": template["metadata"]["labels"]},
            "spec": spec,
        }

    def device_names(self, vm: str) -> list[str]:
        return [f"{vm}-gpu{d}" for d in range(self.args.devices)]

    def order(self, namespace: str, vm: str) -> list[str]:
        """The VM's GPUs, created as a tenant orders them; returns once the sync mirrored them."""
        from django.db import connection

        from binder import models

        names = self.device_names(vm)
        for name in names:
            gpu = {
                "apiVersion": "gpuplane.io/v1alpha1",
                "kind": "GPU",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"className": CLASS, "vmName": vm},
            }
            self.plane.request("POST", GPUS.format(ns=namespace), gpu)
        deadline = time.monotonic() + 30
        mirrored = models.GpuDevice.objects.filter(namespace__name=namespace, name__in=names)
        try:
            while mirrored.count() < len(names):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the sync did not mirror the GPUs of {namespace}/{vm} within 30 s")
                time.sleep(0.02)
        finally:
            # Creators are threads of a pool made per batch: close this thread's connection,
            # or each batch would leave as many open (the server is shared: 100 at most).
            connection.close()
        return names

    # -- one start ------------------------------------------------------------------------------

    def start_vm(self, arm: str, vm: str) -> tuple[float, float, str, str] | None:
        """Create the VMI of ``vm`` for ``arm`` (B: its GPUs first, untimed) and wait until its
        launcher runs; (create → Running s, the create call's s, the launcher's node, VMI uid),
        or None when the create was refused (counted, and the run goes on)."""
        from harness.controlplane import ApiError

        try:
            return self._start_vm(arm, vm)
        except (ApiError, TimeoutError) as exc:
            self.note(f"  ! {NAMESPACES[arm]}/{vm} did not start: {str(exc)[:300]}")
            return None

    def _start_vm(self, arm: str, vm: str) -> tuple[float, float, str, str]:
        namespace = NAMESPACES[arm]
        if arm == "C":
            body = self.vmi(namespace, vm, [H100] * self.args.devices)
        else:
            if arm == "B":
                self.order(namespace, vm)
            body = self.vmi(namespace, vm, [f"gpuplane.io/{n}" for n in self.device_names(vm)])
        started = time.perf_counter()
        stored = self.plane.request("POST", VMIS.format(ns=namespace), body)
        admitted = time.perf_counter() - started
        pinned = bool((stored["spec"].get("nodeSelector") or {}).get("kubernetes.io/hostname"))
        if pinned != (arm != "C"):
            raise SystemExit(f"VMI {namespace}/{vm} {'pinned' if pinned else 'not pinned'}: {stored['spec']}")
        uid = stored["metadata"]["uid"]
        running, node = self.launchers.wait_running(uid, START_TIMEOUT)
        return running - started, admitted, node, uid

    def vm_names(self, arm: str, count: int, round_: int, creators: int) -> list[str]:
        if arm == "B":  # new orders each time
            return [f"b{creators}r{round_}x{i}" for i in range(count)]
        return [f"{arm.lower()}{i}" for i in range(count)]

    def batch(self, arm: str, creators: int, count: int, round_: int, timed: bool = True) -> None:
        """``count`` VM starts of ``arm`` by ``creators`` at once, then their stop (untimed)."""
        tally = self.tallies[(arm, creators)]
        vms = self.vm_names(arm, count, round_, creators)
        results: dict[str, tuple[float, float, str, str]] = {}
        hooks_before = self.plane.webhook_seconds("vmi.gpuplane.io")
        served_before = self.served_seconds()
        self.plane.mark_calls()
        offset = self.plane.audit_log.stat().st_size
        cpu_before = self.cpu.read()
        window = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(creators) as pool:
            for vm, result in zip(vms, pool.map(lambda v: self.start_vm(arm, v), vms), strict=True):
                if result is None:
                    tally.failed += timed
                else:
                    results[vm] = result
        last = time.perf_counter()
        cpu_after = self.cpu.read()
        time.sleep(self.args.settle)  # the writes that follow a start (the VMI's status, events)
        calls = self.plane.calls()
        hooks = [
            after - before
            for after, before in zip(self.plane.webhook_seconds("vmi.gpuplane.io"), hooks_before, strict=True)
        ]
        served = [after - before for after, before in zip(self.served_seconds(), served_before, strict=True)]
        if arm != "C":
            self.check_nodes(arm, results, tally, timed)
        if timed:
            tally.served_calls += served[0]
            tally.served_seconds += served[1]
            tally.vmis += count
            tally.starts += [r[0] for r in results.values()]
            tally.admitted += [r[1] for r in results.values()]
            tally.windows += last - window
            tally.webhook_calls += hooks[0]
            tally.webhook_seconds += hooks[1]
            for name, seconds in cpu_after.items():
                tally.cpu[name] += seconds - cpu_before.get(name, 0.0)
            for who, seconds in gpuplane_writes(self.plane.audit_log, offset):
                tally.served[who].append(seconds)
            for call in calls:
                if call.verb not in WRITES:
                    continue
                if call.resource in BACKGROUND:
                    tally.background += 1
                else:
                    tally.writes[(writer(call.user, call.resource), call.resource, call.verb)] += 1
        self.stop_vms(arm, vms)

    def check_nodes(
        self, arm: str, results: dict[str, tuple[float, float, str, str]], tally: Tally, timed: bool
    ) -> None:
        """Each launcher ran on its set's node, as the launcher pod says (see the module's
        docstring); B's starts whose set a full pass placed before the VMI are left out."""
        from binder import models

        namespace = NAMESPACES[arm]
        devices = models.GpuDevice.objects.filter(namespace__name=namespace, vm_name__in=list(results))
        held = {d.vm_name: (d.phase, d.node, d.answered_request) for d in devices}
        for vm, (_, _, node, _) in list(results.items()):
            phase, set_node, answered = held.get(vm, ("", "", ""))
            if phase != "Bound" or set_node != node:
                tally.wrong_node += timed
                self.note(f"  ! {namespace}/{vm}: launcher on {node}, its set {phase} on {set_node}")
            if arm == "A":
                self.kept[vm] = set_node
            if arm == "B" and not answered and timed:
                tally.placed_by_pass += 1
                results.pop(vm)

    def stop_vms(self, arm: str, vms: list[str]) -> None:
        """Delete the VMIs (B: and their GPUs); wait until VMIs and launchers are gone."""
        from harness.controlplane import ApiError

        namespace = NAMESPACES[arm]
        for vm in vms:
            with contextlib.suppress(ApiError):
                self.plane.request("DELETE", f"{VMIS.format(ns=namespace)}/{vm}")
        deadline = time.monotonic() + 120
        while self.plane.request("GET", VMIS.format(ns=namespace))["items"]:
            if time.monotonic() > deadline:
                raise SystemExit(f"VMIs of {namespace} still there after 120 s:\n{self.cluster.describe(namespace)}")
            time.sleep(0.2)
        self.launchers.wait_gone(namespace, 120)
        if arm == "B":
            for vm in vms:
                for name in self.device_names(vm):
                    with contextlib.suppress(ApiError):
                        self.plane.request("DELETE", f"{GPUS.format(ns=namespace)}/{name}")
        # The stop's last writes (kwok confirming a pod's deletion, events) reach the audit log
        # after the watch reported them: let them land before the next start window opens.
        time.sleep(1.0)

    # -- the measure ----------------------------------------------------------------------------

    def run(self) -> None:
        args = self.args
        # Units: A's kept sets, and B's orders (deleted after their round, released by the next
        # full pass, at most a minute later: counted as if never released).
        warm = max(args.creators, args.serial)
        need = args.devices * (2 * warm + args.rounds * (args.serial + args.creators))
        if need > args.nodes * args.gpus_per_node:
            raise SystemExit(f"{need} units for arms A and B: give more nodes or fewer rounds")
        # Untimed first starts: arm A's sets are Bound by their first start (kept from then on),
        # and every process has warmed up on each path.
        self.note("warm-up: a first start of each arm (A's sets Bound by it)")
        for arm in ARMS:
            if arm == "A":
                for vm in self.vm_names("A", warm, 0, warm):
                    self.order(NAMESPACES["A"], vm)
            self.batch(arm, min(args.creators, warm), warm, -1, timed=False)
        first_kept = dict(self.kept)
        self.load("after the warm-up")
        for creators, count in ((1, args.serial), (args.creators, args.creators)):
            for round_ in range(args.rounds):
                order = list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS))
                for arm in order:
                    self.batch(arm, creators, count, round_)
                summary = ", ".join(
                    f"{arm} p50 {pct(t.starts, 50) * 1000:.0f} ms"
                    for arm in ARMS
                    if (t := self.tallies[(arm, creators)]).starts
                )
                self.note(f"{creators} creator(s), round {round_ + 1}/{args.rounds}: {summary}")
            self.load(f"after the {creators}-creator rounds")
        moved = sum(1 for vm, node in self.kept.items() if first_kept.get(vm) not in (None, node))
        self.figures["A sets moved during the run"] = moved
        self.figures["launcher watch relists"] = self.launchers.relists

    # -- the report -----------------------------------------------------------------------------

    def report(self) -> str:
        args = self.args
        rows = self.latency_rows() + self.write_rows() + self.cpu_rows()
        checks = [f"{sum(t.wrong_node for t in self.of(a))}" if a != "C" else "–" for a in ARMS]
        rows.append(("launchers not on their set's node", checks, ""))
        failed = [str(sum(t.failed for t in self.of(a))) for a in ARMS]
        rows.append(("starts that failed (create refused, or no launcher Running within 180 s)", failed, ""))
        dropped = sum(t.placed_by_pass for t in self.of("B"))
        rows.append(("B starts left out (a full pass placed the set before its VMI)", ["", str(dropped), ""], ""))
        if "error" in self.figures:
            rows.append(("**the run stopped early**", [self.figures["error"][:200], "", ""], ""))
        ones = [entry["1m"] for entry in self.figures["load"]]
        rows.append(("load average (1 min) through the run", [f"{min(ones):.2f}–{max(ones):.2f}", "", ""], ""))
        header = (
            f"| measure ({args.nodes:,} kwok nodes × {args.gpus_per_node} GPUs, {args.devices} GPU per VM, "
            f"{args.rounds} ABBA rounds) | A: {ARMS['A']} | B: {ARMS['B']} | C: {ARMS['C']} | target |"
        )
        lines = [header, "|---|---:|---:|---:|---|"]
        lines += [f"| {label} | {' | '.join(cells)} | {verdict} |" for label, cells, verdict in rows]
        return "\n".join(lines)

    def levels(self) -> tuple[int, int]:
        return (1, self.args.creators)

    def of(self, arm: str) -> list[Tally]:
        """The arm's tallies at each concurrency."""
        return [self.tallies[(arm, creators)] for creators in self.levels()]

    def starts(self, arm: str) -> int:
        return max(sum(t.vmis for t in self.of(arm)), 1)

    def latency_rows(self) -> list[tuple[str, list[str], str]]:
        rows: list[tuple[str, list[str], str]] = []
        results: dict[str, Any] = self.figures.setdefault("results", {})
        for creators in self.levels():
            without = self.tallies[("C", creators)]
            label = "1 creator" if creators == 1 else f"{creators} creators"
            cells, admitted, hooks, own, verdicts = [], [], [], [], []
            for arm in ARMS:
                t = self.tallies[(arm, creators)]
                cells.append(f"{pct(t.starts, 50) * 1000:,.0f} / {pct(t.starts, 99) * 1000:,.0f} ms ({len(t.starts)})")
                admitted.append(f"{pct(t.admitted, 50) * 1000:,.0f} / {pct(t.admitted, 99) * 1000:,.0f} ms")
                hooks.append(f"{t.webhook_seconds / t.webhook_calls * 1000:,.1f} ms" if t.webhook_calls else "–")
                own.append(f"{t.served_seconds / t.served_calls * 1000:,.1f} ms" if t.served_calls else "–")
                result = results[f"{arm}, {label}"] = {
                    "starts_s": t.starts, "create_call_s": t.admitted, "p50_s": pct(t.starts, 50),
                    "p99_s": pct(t.starts, 99), "wrong_node": t.wrong_node, "placed_by_full_pass": t.placed_by_pass,
                    "writes": {" ".join(k): v for k, v in sorted(t.writes.items())},
                    "background_writes": t.background, "cpu_s": dict(t.cpu), "window_s": t.windows, "vmis": t.vmis,
                    "webhook_calls": t.webhook_calls, "webhook_s": t.webhook_seconds, "gpuplane_writes_s": t.served,
                    "webhook_server_calls": t.served_calls, "webhook_server_s": t.served_seconds,
                }  # fmt: skip
                if arm != "C":
                    ratio = pct(t.starts, 99) / pct(without.starts, 99)
                    result["p99_ratio_to_C"] = ratio
                    verdicts.append(f"{arm}: {ratio:.3f} × ({'**met**' if ratio <= 1.2 else '**missed**'})")
            rows.append((f"VMI create → launcher Running, {label}: p50 / p99 (starts)", cells, ""))
            rows.append((f"p99 ÷ without gpuplane, {label}", ["", "", ""], "≤ 1.2: " + "; ".join(verdicts)))
            rows.append((f"the create call alone (admission), {label}: p50 / p99", admitted, ""))
            rows.append((f"gpuplane's webhook call as the apiserver timed it (its metric), {label}: mean", hooks, ""))
            rows.append((f"... as the webhook server timed it, arrival to answer (its metric), {label}: mean", own, ""))
            for who in ("gpuplane-webhook", "gpuplane-binder"):
                cells = []
                for arm in ARMS:
                    served = self.tallies[(arm, creators)].served.get(who, [])
                    cells.append(f"{pct(served, 50) * 1000:,.1f} / {pct(served, 99) * 1000:,.1f} ms" if served else "–")
                rows.append((f"{who}'s writes as the apiserver served them (audit log), {label}: p50 / p99", cells, ""))
        return rows

    def write_rows(self) -> list[tuple[str, list[str], str]]:
        """apiserver writes per VM start, over both concurrencies, by writer."""
        per_arm: dict[str, Counter[str]] = {}
        for arm in ARMS:
            counted: Counter[str] = Counter()
            what: Counter[str] = Counter()
            for t in self.of(arm):
                for (who, resource, verb), n in t.writes.items():
                    counted[who] += n
                    what[f"{who}: {verb} {resource}"] += n
            per_arm[arm] = counted
            self.figures[f"writes per start, {arm}"] = {k: v / self.starts(arm) for k, v in sorted(what.items())}
        total = [f"{sum(per_arm[a].values()) / self.starts(a):.1f}" for a in ARMS]
        rows = [("apiserver writes per VM start (audit log; kwok's node leases left out)", total, "")]
        for who in sorted({w for c in per_arm.values() for w in c}):
            cells = [f"{per_arm[a][who] / self.starts(a):.2f}" if per_arm[a][who] else "–" for a in ARMS]
            rows.append((f"... by {who}", cells, ""))
        return rows

    def cpu_rows(self) -> list[tuple[str, list[str], str]]:
        """CPU per VM start over the start windows, every process, over both concurrencies."""
        cpu: dict[str, dict[str, float]] = {a: defaultdict(float) for a in ARMS}
        for arm in ARMS:
            for t in self.of(arm):
                for part, seconds in t.cpu.items():
                    cpu[arm][part] += seconds
        per = {a: {p: s / self.starts(a) * 1000 for p, s in cpu[a].items()} for a in ARMS}
        total = [f"{sum(per[a].values()):,.0f}" for a in ARMS]
        rows = [("CPU per VM start, every process (ms)", total, "")]
        parts = sorted({p for c in per.values() for p in c}, key=lambda p: -per["A"].get(p, 0) - per["B"].get(p, 0))
        rows += [
            (f"... {part}", [f"{per[a].get(part, 0):,.1f}" for a in ARMS], "")
            for part in parts
            if any(per[a].get(part, 0) >= 0.5 for a in ARMS)
        ]
        return rows


#: PostgreSQL connections a run keeps open at most: the webhook server's threads (2 processes ×
#: 16, one each once used), the sync, the binder worker and beat, the bench's creators and its
#: CPU reader.
CONNECTIONS = 50


@contextlib.contextmanager
def database(url: str, keep: bool) -> Iterator[None]:
    require_connections(url, CONNECTIONS)
    drop_database(url)
    ensure_database(url)
    setup_django(url, migrate=True)
    try:
        yield
    finally:
        if not keep:
            drop_database(url)


def forget_keys() -> None:
    import redis

    from harness import workers

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=workers.PREFIX + "*"):
        client.delete(key)


def main() -> None:
    args = parse_args()
    with database(args.database, args.keep_database):
        bench = Bench(args)
        try:
            bench.start()
            try:
                bench.run()
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the figures so far are still reported
                bench.figures["error"] = f"{type(exc).__name__}: {exc}"
                bench.note(f"the run stopped early: {bench.figures['error']}")
            bench.load("end")
        finally:
            bench.stack.close()
            with contextlib.suppress(Exception):
                forget_keys()
        table = bench.report()
    print(table)
    if args.json:
        text = json.dumps(bench.figures, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()

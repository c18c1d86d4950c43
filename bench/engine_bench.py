"""Benchmark the pure engine: a full pass that binds many orders, then a steady-state pass.

Not a test: it prints figures for docs/benchmarks.md. Synthetic clusters follow the real
fixtures' shape (8 GPUs per node, several classes, sets of 1-8 devices, launcher pods
listed in their VMI's activePods).

    .venv/bin/python -m bench.engine_bench --nodes 1000 --sets 2000
    .venv/bin/python -m bench.engine_bench --nodes 1000 --sets 2000 --alternatives-share 0.3

``--alternatives-share`` gives that share of the orders two or three classes to choose from
(their own first, then the next ones), as orders that accept several GPU classes do.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import resource
import statistics
import time
from datetime import UTC, datetime

from binder.engine import Cluster, Device, GpuClass, Node, PassResult, Pod, Vmi, full_pass

CLASSES = (
    GpuClass("h100", "nvidia.com/GH100_H100_SXM5_80GB"),
    GpuClass("a100", "nvidia.com/GA100_A100_SXM4_80GB"),
    GpuClass("l40s", "nvidia.com/AD102GL_L40S"),
)


def synthetic(nodes: int, sets: int, tenants: int, seed: int, alternatives_share: float = 0.0) -> Cluster:
    rng = random.Random(seed)
    choice_rng = random.Random(seed + 1)  # its own stream: the same sets with or without alternatives
    node_list = tuple(
        Node(f"gpu-{i:05d}", {CLASSES[i % 3].resource_name: 8}, labels={"kubernetes.io/hostname": f"gpu-{i:05d}"})
        for i in range(nodes)
    )
    devices, vmis, pods = [], [], []
    created = datetime(2026, 11, 1, tzinfo=UTC)
    for s in range(sets):
        cls = CLASSES[s % 3]
        size = rng.choice((1, 1, 2, 2, 4, 8))
        ns, vm = f"tenant-{s % tenants:04d}", f"vm-{s:06d}"
        choices: tuple[str, ...] = ()
        if choice_rng.random() < alternatives_share:
            count = choice_rng.choice((2, 3))
            choices = tuple(CLASSES[(s + k) % 3].name for k in range(count))
        devices.extend(Device(ns, f"{vm}-gpu{j}", cls.name, vm, created=created, choices=choices) for j in range(size))
        if s % 10 == 0:  # some VMs already have a launcher pod, not yet on a node
            uid = f"uid-{s}"
            vmis.append(Vmi(ns, vm, uid=f"vmi-{s}", active_pods={uid: ""}))
            pods.append(Pod(ns, f"virt-launcher-{vm}-x", uid, requests={cls.resource_name: size}, owner_vmi=vm))
    return Cluster(
        now=datetime(2026, 12, 1, tzinfo=UTC),
        classes=CLASSES,
        nodes=node_list,
        devices=tuple(devices),
        vmis=tuple(vmis),
        pods=tuple(pods),
    )


def placement_hash(result: PassResult) -> str:
    """A short hash of what a pass decided (every written device and every decision, in
    key order): two engines that place alike print the same one."""
    digest = hashlib.sha256()
    for device in sorted(result.devices, key=lambda d: d.key):
        # A device that borrows nothing hashes as it did before lending existed, so the
        # hashes recorded for runs without borrowing stay comparable.
        digest.update(repr(device).replace(", borrowed=False, reclaim_for='')", ")").encode())
    for change in sorted(result.changes, key=lambda c: (c.namespace, c.name)):
        digest.update(repr(change).encode())
    digest.update(repr(sorted(result.counts.items())).encode())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--sets", type=int, default=2000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5, help="steady-state passes to time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--alternatives-share", type=float, default=0.0, help="share of orders with 2-3 choices")
    args = parser.parse_args()
    if not 0 <= args.alternatives_share <= 1:
        parser.error("--alternatives-share must be between 0 and 1")

    cluster = synthetic(args.nodes, args.sets, args.tenants, args.seed, args.alternatives_share)
    start = time.perf_counter()
    result = full_pass(cluster)
    bind_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # whole process, bytes
    merged = {d.key: d for d in cluster.devices}
    merged.update({d.key: d for d in result.devices})
    steady = dataclasses.replace(cluster, devices=tuple(merged.values()))
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        again = full_pass(steady)
        times.append(time.perf_counter() - start)
        assert not again.changes, "steady state changed placement"
    bound = result.counts["bound"]
    print(f"placement hash: {placement_hash(result)}")
    print("| nodes | devices | sets bound | bind pass | sets/s | process max RSS MiB | steady median | steady max |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.nodes} | {len(cluster.devices)} | {bound} | {bind_s:.2f} s | {bound / bind_s:.0f} | "
        f"{peak / 2**20:.0f} | {statistics.median(times) * 1000:.0f} ms | {max(times) * 1000:.0f} ms |"
    )


if __name__ == "__main__":
    main()

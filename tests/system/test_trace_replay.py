"""The trace replay bench on a tiny slice of the real Alibaba trace: it runs, its last line
is the JSON the README's table is built from, and orders that accept several GPU models
never fill less capacity than orders that take only their first. Its timed replay, on a tiny
crafted trace: making room places a big order that stopped VMs' sets fragment out of room,
never moving a running VM's set, and the bench fails if one ever moves."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import trace_replay as bench

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "bench" / "traces" / "alibaba-gpu-v2023"


def _rows(name: str) -> list[dict[str, str]]:
    with gzip.open(TRACE / f"{name}.csv.gz", "rt", newline="") as handle:
        return list(csv.DictReader(handle))


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_replay_on_a_slice(tmp_path: Path) -> None:
    nodes = _rows("openb_node_list_gpu_node")
    by_model: dict[str, list[dict[str, str]]] = {}
    for row in nodes:
        by_model.setdefault(row["model"], []).append(row)
    # Two nodes of each model: every model the tasks name exists, each one scarce.
    slice_nodes = [row for rows in by_model.values() for row in rows[:2]]
    pods = _rows("openb_pod_list_gpuspec33")
    several = [p for p in pods if "|" in p["gpu_spec"] and p["gpu_milli"] == "1000"][:40]
    plain = [p for p in pods if p["num_gpu"] != "0" and p["gpu_milli"] == "1000" and "|" not in p["gpu_spec"]][:40]
    slice_pods = sorted(several + plain, key=lambda p: int(p["creation_time"]))
    node_file = _write(tmp_path / "nodes.csv", slice_nodes)
    pod_file = _write(tmp_path / "pods.csv", slice_pods)

    run = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--nodes", str(node_file), "--pods", str(pod_file),
         "--demand", "0.9,1.0", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(figures) == {"0.9", "1.0"}
    for level in figures.values():
        assert set(level) == {"single_class", "alternatives"}
        for mode in level.values():
            assert set(mode) == {"allocated_pct", "refused", "engine_s"}
            assert 0 <= mode["allocated_pct"] <= 100
            assert isinstance(mode["refused"], int) and mode["refused"] >= 0
            assert mode["engine_s"] >= 0
        assert level["alternatives"]["allocated_pct"] >= level["single_class"]["allocated_pct"]


def test_replay_reads_the_stored_compressed_copy(tmp_path: Path) -> None:
    """The repository keeps the trace gzip-compressed; the command the README shows names
    the plain CSV files, and the replay finds their compressed copies."""
    pods = _rows("openb_pod_list_default")[:30]
    pod_file = _write(tmp_path / "pods.csv", pods)
    run = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay",
         "--nodes", str(TRACE / "openb_node_list_gpu_node.csv"), "--pods", str(pod_file), "--demand", "0.05", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["0.05"]["alternatives"]["refused"] == 0


def test_bad_demand_is_a_clear_error(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--nodes", "x.csv", "--pods", "y.csv",
         "--demand", "lots"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--demand must be comma-separated numbers" in run.stderr


def test_lending_run_on_a_slice(tmp_path: Path) -> None:
    """Lending allocates at least what budgets alone do, and a burst of entitled orders takes
    borrowed sets back only from stopped VMs."""
    nodes = _rows("openb_node_list_gpu_node")
    by_model: dict[str, list[dict[str, str]]] = {}
    for row in nodes:
        by_model.setdefault(row["model"], []).append(row)
    slice_nodes = [row for rows in by_model.values() for row in rows[:3]]
    pods = [p for p in _rows("openb_pod_list_gpuspec33") if p["num_gpu"] != "0" and p["gpu_milli"] == "1000"][:120]
    node_file = _write(tmp_path / "nodes.csv", slice_nodes)
    pod_file = _write(tmp_path / "pods.csv", pods)
    run = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--nodes", str(node_file), "--pods", str(pod_file),
         "--demand", "1.0", "--lending", "--burst-passes", "10", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    lending = figures["lending"]
    assert lending["without"]["borrowed_sets"] == 0
    assert lending["with"]["allocated_pct"] >= lending["without"]["allocated_pct"]
    assert lending["with"]["borrowed_sets"] > 0
    assert lending["with"]["reclaimed_running"] == 0
    assert 0 <= lending["with"]["burst_placed"] <= lending["with"]["burst_orders"]


POD_FIELDS = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
              "creation_time", "deletion_time", "scheduled_time"]  # fmt: skip


def _pod(name: str, gpus: int, ran: int) -> dict[str, str]:
    """A whole-GPU pod created at 0 that ran for ``ran`` seconds."""
    return {"name": name, "cpu_milli": "1000", "memory_mib": "1024", "num_gpu": str(gpus), "gpu_milli": "1000",
            "gpu_spec": "", "qos": "LS", "pod_phase": "Succeeded", "creation_time": "0",
            "deletion_time": str(ran), "scheduled_time": "0"}  # fmt: skip


def test_timed_replay_makes_room_only_with_stopped_vms(tmp_path: Path) -> None:
    """Two 8-GPU nodes; sixteen 1-GPU VMs fill them (a0-a7 on one, b0-b7 on the other), then an
    8-GPU order waits. Half of each node's VMs end at once and their sets go; a4-a7 stop later
    (their sets kept as long as they ran) while b4-b7 run on. From then on the 8-GPU order fits
    only if the stopped VMs' sets move to the other node: making room does that, and never moves
    a running VM's set; without it the order waits until the kept sets go."""
    nodes = [{"sn": f"node-{x}", "cpu_milli": "64000", "memory_mib": "262144", "gpu": "8", "model": "G2"}
             for x in ("a", "b")]  # fmt: skip
    pods = [_pod(f"a{i}", 1, 10 if i < 4 else 1000) for i in range(8)]
    pods += [_pod(f"b{i}", 1, 10 if i < 4 else 1_000_000) for i in range(8)]
    pods.append(_pod("z-big", 8, 100))
    node_file = _write(tmp_path / "nodes.csv", nodes)
    pod_file = _write(tmp_path / "pods.csv", pods)
    # Every task arrives at 0, so the speed-up only sets the run's length: at demand 0.58 (the GPUs
    # the orders would book had each been placed on arrival) the run ends between a4-a7's stop
    # (~1,000 s) and the end of their kept sets (~2,000 s).
    run = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--nodes", str(node_file), "--pods", str(pod_file),
         "--time", "--demand", "0.58", "--kept", "1.0", "--keep-for", "ran", "--copies", "1", "--pass-every", "10",
         "--node-sample", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    row = figures["0.58"]["1.0"]
    off, on = row["off"], row["on"]
    assert 1_000 < row["horizon_s"] < 2_000
    for mode in (off, on):
        assert mode["running_moved"] == 0
        assert mode["orders"] == 17
        assert mode["gpu4"]["orders"] == 0
        assert mode["gpu8"]["orders"] == 1
    assert off["moves"] == 0
    assert on["moves"] == 4  # a4-a7, stopped: the running b4-b7 stay
    assert on["moves_for"] == {"8": 4}
    assert on["gpu8"]["placed"] >= off["gpu8"]["placed"]
    assert on["gpu8"]["placed"] == 1 and off["gpu8"]["placed"] == 0
    assert on["gpu8"]["wait_p50_s"] >= 1_000  # not before a4-a7 stopped


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kept", "half"], "--kept must be comma-separated shares between 0 and 1"),
        (["--kept", "1.5"], "--kept must be comma-separated shares between 0 and 1"),
        (["--keep-for", "a while"], "--keep-for must be 'ran' or a number of seconds"),
        (["--keep-for", "-5"], "--keep-for must be 'ran' or a number of seconds >= 0"),
        (["--copies", "0"], "--copies must be at least 1"),
        (["--pass-every", "0"], "--pass-every must be above 0 seconds"),
        (["--node-sample", "0"], "--node-sample must be at least 1"),
        (["--moves-per-pass", "0"], "--moves-per-pass must be at least 1"),
        (["--lending"], "--time and --lending are separate runs"),
    ],
)
def test_bad_timed_flags_are_clear_errors(flags: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--nodes", "x.csv", "--pods", "y.csv", "--time", *flags],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert message in run.stderr


def test_timed_replay_fails_when_a_running_vms_set_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench's own check: a run in which some pass moved a running VM's set exits 1, naming
    the run (here a stand-in pass reports one)."""
    real = bench.TimedReplay._full_pass

    def moving_one(self: bench.TimedReplay, now: float) -> bool:
        changed = real(self, now)
        if self.vmis:
            self.running_moved.add(next(iter(self.vmis)))
        return changed

    monkeypatch.setattr(bench.TimedReplay, "_full_pass", moving_one)
    nodes = [{"sn": "node-a", "cpu_milli": "64000", "memory_mib": "262144", "gpu": "8", "model": "G2"}]
    node_file = _write(tmp_path / "nodes.csv", nodes)
    pod_file = _write(tmp_path / "pods.csv", [_pod(f"a{i}", 1, 100) for i in range(4)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--nodes", str(node_file), "--pods", str(pod_file), "--time", "--demand", "0.2", "--kept", "0.5",
                    "--copies", "1", "--node-sample", "1"])  # fmt: skip
    assert exit_info.value.code == 1
    assert "running VMs' sets were moved" in capsys.readouterr().err

"""The trace replay bench on a tiny slice of the real Alibaba trace: it runs, its last line
is the JSON the README's table is built from, and orders that accept several GPU models
never fill less capacity than orders that take only their first."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

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

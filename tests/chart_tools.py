"""The chart's tools for the tests: helm, promtool and kubectl, built by hack/kube-bin.sh from the Go
module pinned in hack/kube (the last line it prints is the directory holding them), and
``helm template`` of charts/gpuplane.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gpuplane"
KUBE_BIN = ROOT / "hack" / "kube-bin.sh"


@functools.cache
def _bin_dir() -> Path | str:
    """The cache directory, or why it could not be had (built once per test process)."""
    done = subprocess.run([str(KUBE_BIN)], capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return f"hack/kube-bin.sh failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
    return Path(done.stdout.strip().splitlines()[-1])


def tool(name: str) -> str:
    found = _bin_dir()
    if isinstance(found, str):
        pytest.skip(found)
    return str(found / name)


def run(*args: str, check: bool = True, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    if check:
        assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def template_text(
    *values_files: Path, release: str = "gpuplane", namespace: str = "gpuplane-system", extra: tuple[str, ...] = ()
) -> str:
    args = [tool("helm"), "template", release, str(CHART), "--namespace", namespace]
    for path in values_files:
        args += ["-f", str(path)]
    return run(*args, *extra).stdout


def template(*values_files: Path, **kwargs: Any) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(template_text(*values_files, **kwargs)) if d]

"""The chart's tools for the tests: helm, promtool and kubectl, built by hack/kube-bin.sh from the Go
module pinned in hack/kube beside the control plane's binaries (harness/controlplane/ finds
them), and ``helm template`` of charts/gpuplane.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.controlplane import ControlPlaneError
from harness.controlplane import tool as control_plane_tool

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gpuplane"


@functools.cache
def _tool(name: str) -> Path | str:
    try:
        return control_plane_tool(name)
    except ControlPlaneError as exc:
        return str(exc)


def tool(name: str) -> str:
    """helm, promtool or kubectl, as the control plane's binaries are found (``KUBEBUILDER_ASSETS``,
    else hack/kube-bin.sh's cache); without them the test fails saying how to get them."""
    found = _tool(name)
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    return str(found)


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

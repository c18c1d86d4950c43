"""The chart's tools for the tests: helm, promtool and kubectl, built by hack/kube-bin.sh from the Go
module pinned in hack/kube beside the control plane's binaries (harness/controlplane/ finds
them), ``helm template`` of charts/gpuplane, and hack/chart.py (what generates the chart's
schema, the values table and the dashboards) as a module.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
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


@functools.cache
def chart_script() -> ModuleType:
    """hack/chart.py, loaded from its file (hack/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("hack_chart", ROOT / "hack" / "chart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


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

"""The control plane's binaries and its processes, as envtest's ``process`` package runs them.

Where each binary is (``KUBEBUILDER_ASSETS`` first, envtest's convention, else the directory a
``hack/*-bin.sh`` script built from the pinned Go modules), one binary running with its output
in a log file, and the wait for a process to be ready that fails with the end of its log.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KUBE_BIN = ROOT / "hack" / "kube-bin.sh"
#: KubeVirt's CRDs, virt-controller and its RBAC, and the KubeVirt object (hack/kubevirt-bin.sh).
KUBEVIRT_BIN = ROOT / "hack" / "kubevirt-bin.sh"
#: kwok and the stages it runs with (hack/kwok-bin.sh).
KWOK_BIN = ROOT / "hack" / "kwok-bin.sh"
START_TIMEOUT = 60.0
HOW_TO_GET_BINARIES = (
    "the cluster tests need etcd, kube-apiserver and kube-controller-manager: install Go >= 1.26 "
    "and run `make kube-bin`, or point KUBEBUILDER_ASSETS at a directory holding them"
)


class ControlPlaneError(RuntimeError):
    """The control plane could not be had: one line saying why and what to do."""


def built(script: Path, what: str, timeout: float = 3600) -> Path:
    """The directory a ``hack/*-bin.sh`` script built (or found) its outputs in: the script
    prints it last; a clear error naming ``what`` and how to get it otherwise."""
    try:
        done = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ControlPlaneError(f"{what} ({exc})") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ControlPlaneError(f"{what} (hack/{script.name}: {detail})")
    return Path(lines[-1])


@functools.cache
def binaries_dir() -> Path:
    """Where etcd, kube-apiserver, kube-controller-manager and kube-scheduler are."""
    return built(KUBE_BIN, HOW_TO_GET_BINARIES)


@functools.cache
def kubevirt_dir() -> Path:
    """KubeVirt's manifests as virt-operator installs them and virt-controller, built from the
    pinned kubevirt.io/kubevirt module (``hack/kubevirt-bin.sh``)."""
    return built(KUBEVIRT_BIN, "KubeVirt's CRDs and virt-controller: install Go >= 1.26 and run `make kube-bin`")


@functools.cache
def kwok_dir() -> Path:
    """kwok and its stages, built from the pinned sigs.k8s.io/kwok module (``hack/kwok-bin.sh``)."""
    return built(KWOK_BIN, "kwok: install Go >= 1.26 and run `make kube-bin`")


def tool(name: str) -> Path:
    """One binary: ``KUBEBUILDER_ASSETS`` first (envtest's convention), else the cache."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / name).is_file():
        return Path(assets) / name
    return binaries_dir() / name


class Process:
    """One binary of the control plane, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        #: Variables set for this binary beside the test process's own (each start, restarts too).
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        handle = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
        )  # fmt: skip
        handle.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_ready(name: str, process: Process | None, ready: Callable[[], Any], timeout: float = START_TIMEOUT) -> None:
    """Until ``ready()`` is true (an exception counts as not yet); a :class:`ControlPlaneError`
    with the end of the process's log when it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.running():
            raise ControlPlaneError(f"{name} exited while starting; its log ends:\n{process.tail()}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.1)
    tail = process.tail() if process else ""
    raise ControlPlaneError(f"{name} was not ready within {timeout:.0f} s; its log ends:\n{tail}")

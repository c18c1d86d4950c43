"""The real processes a bench drives: the webhook server (``deploy/webhook_server.py``), Celery
workers on the binder queue, and stopping them."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

#: The benches' broker (``GPUPLANE_BENCH_REDIS_URL`` picks another database, so benches run
#: side by side do not share one; each run's keys carry a prefix of its own anyway).
REDIS_URL = os.environ.get("GPUPLANE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")


def child_env(args: argparse.Namespace, key_prefix: str, var_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": args.database_url,
        "CELERY_BROKER_URL": REDIS_URL,
        "GPUPLANE_BROKER_KEY_PREFIX": key_prefix,
        "GPUPLANE_VAR_DIR": str(var_dir),
        "GPUPLANE_AUTO_PASS": "false",
        "GPUPLANE_CLUSTER": "standalone",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(32),
    }


def stop(process: subprocess.Popen[Any] | None, timeout: float = 30) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_server(env: dict[str, str], log: Path, workers: int, threads: int) -> tuple[subprocess.Popen[Any], str]:
    """The webhook as production serves it: ``deploy/webhook_server.py`` (granian), plain HTTP."""
    port = free_port()
    env = {**env, "GPUPLANE_WEBHOOK_BIND": f"127.0.0.1:{port}", "GPUPLANE_WEBHOOK_WORKERS": str(workers)}
    env |= {"GPUPLANE_WEBHOOK_THREADS": str(threads), "GPUPLANE_WEBHOOK_ENABLED": "true"}
    env["GPUPLANE_WEBHOOK_AUTH"] = "none"
    with log.open("w") as handle:
        process = subprocess.Popen(
            [sys.executable, "deploy/webhook_server.py"], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:  # noqa: S310 - loopback
                if resp.status == 200:
                    return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop(process)
                raise SystemExit(f"the webhook server did not start:\n{log.read_text()}") from None
            time.sleep(0.1)


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    return start_celery(
        ["--pool", "solo", "-n", f"whbench-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
         "--without-heartbeat"],
        env,
        log,
    )  # fmt: skip


def start_celery(options: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    """A binder-queue worker with ``options``, its output in ``log``; returns once it is ready."""
    cmd = [sys.executable, "-m", "celery", "-A", "gpuplane", "worker", "-Q", "binder", "-l", "info", *options]
    with log.open("w") as handle:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)  # noqa: S603
    deadline = time.monotonic() + 60
    while "ready." not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise SystemExit(f"the celery worker did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return process

"""50 concurrent webhook calls for 50 VMs competing for room for 10 sets (issue 4).

Real parts only: a gunicorn server process running the webhook, a `celery worker`, the
local Redis and PostgreSQL. Each call writes its bind requests and waits for the
binder's answer; admission checks are advisory, the binder decides at bind time, so
exactly 10 calls may win and nothing may be over-booked however the calls interleave.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from binder import models
from binder.mirror.snapshot import load_objects
from tests import test_worker
from tests.shapes import H100, class_obj, gpu_obj, node_obj
from tests.test_webhook import new_vmi, review

pytestmark = pytest.mark.django_db(transaction=True)

broker = test_worker.broker
start_worker = test_worker.start_worker
_postgres_only = test_worker._postgres_only

ROOT = Path(__file__).resolve().parents[1]
CALLS = 50
ROOM = 10  # two nodes with 5 units each, one unit per VM


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(broker: redis.Redis, tmp_path: Path) -> Iterator[str]:
    """The webhook served by gunicorn (plain HTTP: TLS has its own test) on a free port."""
    port = _free_port()
    env = {
        **os.environ,
        "DATABASE_URL": test_worker._database_url(),
        "CELERY_BROKER_URL": test_worker.REDIS_URL,
        "GPUPLANE_BROKER_KEY_PREFIX": test_worker.PREFIX,
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "GPUPLANE_AUTO_PASS": "false",
        "GPUPLANE_BIND": f"127.0.0.1:{port}",
        "GPUPLANE_WEB_WORKERS": "2",
        "GPUPLANE_WEB_THREADS": "13",
        "GPUPLANE_CLUSTER": "standalone",
    }
    log = (tmp_path / "gunicorn.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", "gpuplane.wsgi"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1) as resp:  # noqa: S310 - loopback
                    if resp.status == 200:
                        break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp_path / "gunicorn.log").read_text()) from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _call(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(  # noqa: S310 - loopback
        f"{url}/webhooks/vmi", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_fifty_concurrent_calls_for_room_for_ten_sets_allow_exactly_ten(
    server: str, start_worker: Callable[..., test_worker.Worker]
) -> None:
    load_objects(
        [
            class_obj("h100", H100),
            node_obj("n1", {H100: 5}),
            node_obj("n2", {H100: 5}),
            *[gpu_obj(f"t{i % 5}", f"vm{i}-gpu0", "h100", f"vm{i}") for i in range(CALLS)],
        ]
    )
    start_worker()
    bodies = [review(new_vmi(f"t{i % 5}", f"vm{i}", [f"vm{i}-gpu0"])) for i in range(CALLS)]
    with ThreadPoolExecutor(max_workers=CALLS) as pool:
        answers = list(pool.map(lambda body: _call(server, body), bodies))

    for body, answer in zip(bodies, answers, strict=True):
        assert answer["response"]["uid"] == body["request"]["uid"]
    allowed = [a["response"] for a in answers if a["response"]["allowed"]]
    denied = [a["response"]["status"]["message"] for a in answers if not a["response"]["allowed"]]
    assert len(allowed) == ROOM, denied
    assert all(a["patchType"] == "JSONPatch" for a in allowed)
    assert len(denied) == CALLS - ROOM
    # Denied with the binder's reason, not a timeout.
    assert all("no Ready, schedulable node" in message for message in denied), denied
    assert models.GpuDevice.objects.filter(phase="Bound").count() == ROOM
    for node in ("n1", "n2"):
        assert models.GpuDevice.objects.filter(phase="Bound", node=node).count() <= 5

"""The webhook server sheds what it cannot take, at once, and takes calls again when it can.

The real server (``deploy/webhook_server.py``) on a free loopback port, against a SQLite
database of the test's own, sized to one thread and no queue. A review for a Pending set
writes its bind request and waits for the binder (none runs: its answer pass is published
to the test Redis and nobody takes it), so it holds the only place. While it waits, a
review for another Pending set is answered "try again" and writes nothing, a review naming
no gpuplane device is allowed, and once the first call has timed out a new review is
admitted again (its bind request is written). Start-up refusals of the new setting too.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import runpy
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gpuplane.settings_parsers import SettingError
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, gpu_obj, node_obj
from harness.workers import PREFIX, REDIS_URL, ROOT, forget_keys, webhook_server

WEBHOOK_SERVER = ROOT / "deploy" / "webhook_server.py"

OBJECTS = [
    class_obj("h100", H100),
    node_obj("n1", {H100: 8}),
    gpu_obj("train", "holder-gpu0", "h100", "holder"),
    gpu_obj("train", "other-gpu0", "h100", "other"),
]


def _env(tmp_path: Path) -> dict[str, str]:
    database = tmp_path / "db.sqlite3"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "CELERY_"))},
        "DATABASE_URL": f"sqlite:///{database}",
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "GPUPLANE_AUTO_PASS": "false",
        "CELERY_BROKER_URL": REDIS_URL,
        "GPUPLANE_BROKER_KEY_PREFIX": PREFIX,
        "GPUPLANE_BIND_WAIT_SECONDS": "4",
        "GPUPLANE_WEBHOOK_AUTH": "none",
        "GPUPLANE_WEBHOOK_WORKERS": "1",
        "GPUPLANE_WEBHOOK_THREADS": "1",
        "GPUPLANE_WEBHOOK_QUEUE": "0",
        "GPUPLANE_WEBHOOK_SHED": "true",
    }
    snapshot = tmp_path / "cluster.json"
    snapshot.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": OBJECTS}))
    for command in (["migrate", "--verbosity", "0"], ["load_snapshot", str(snapshot)]):
        subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env, check=True, timeout=180)
    return env


def _bind_request(env: dict[str, str], device: str) -> str:
    path = env["DATABASE_URL"].removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as db:
        (request,) = db.execute("SELECT bind_request FROM binder_gpudevice WHERE name = ?", [device]).fetchone()
    return str(request)


def _post(url: str, body: dict[str, Any], timeout: str = "10s") -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=15)
    try:
        conn.request("POST", f"/webhooks/vmi?timeout={timeout}", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200
        answer: dict[str, Any] = json.loads(resp.read())["response"]
        return answer
    finally:
        conn.close()


@pytest.mark.slow
def test_a_full_server_sheds_reviews_at_once_writes_nothing_for_them_and_takes_calls_again(tmp_path: Path) -> None:
    env = _env(tmp_path)
    held: list[dict[str, Any]] = []
    try:
        with webhook_server(env, tmp_path) as url:
            holder = threading.Thread(
                target=lambda: held.append(_post(url, review(new_vmi("train", "holder", ["holder-gpu0"]))))
            )
            holder.start()
            deadline = time.monotonic() + 10
            while not _bind_request(env, "holder-gpu0") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _bind_request(env, "holder-gpu0")  # the first call is in the application, waiting

            shed = _post(url, review(new_vmi("train", "other", ["other-gpu0"]), uid="uid-shed"))
            plain = _post(url, review(new_vmi("train", "plain", []), uid="uid-plain"))
            assert holder.is_alive()  # both answered while the only place was still taken
            assert shed["uid"] == "uid-shed" and shed["allowed"] is False and shed["status"]["code"] == 403
            assert "the webhook is busy with 1 calls" in shed["status"]["message"]
            assert shed["status"]["message"].endswith("try again")
            assert _bind_request(env, "other-gpu0") == ""  # shed before anything was written
            assert plain == {"uid": "uid-plain", "allowed": True}

            holder.join(timeout=15)
            assert "did not answer within 4s" in held[0]["status"]["message"]
            # The place is free again: the next review is admitted and writes its bind request
            # (the apiserver's 2 s leave it 0.5 s to wait).
            again = _post(url, review(new_vmi("train", "other", ["other-gpu0"])), timeout="2s")
            assert "did not answer within 0.5s" in again["status"]["message"]
            assert _bind_request(env, "other-gpu0")
    finally:
        forget_keys(redis.Redis.from_url(REDIS_URL))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"GPUPLANE_WEBHOOK_QUEUE": "-1"}, "GPUPLANE_WEBHOOK_QUEUE='-1' must be at least 0"),
        ({"GPUPLANE_WEBHOOK_QUEUE": "many"}, "GPUPLANE_WEBHOOK_QUEUE='many' is not an integer"),
        ({"GPUPLANE_WEBHOOK_THREADS": "0"}, "GPUPLANE_WEBHOOK_THREADS='0' must be at least 1"),
    ],
)
def test_the_pool_sizes_are_checked_before_the_server_starts(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    options = runpy.run_path(str(WEBHOOK_SERVER), run_name="webhook_server_under_test")["options"]
    with pytest.raises(SettingError) as raised:
        options()
    assert str(raised.value) == expected


def test_the_pool_sizes_default_to_sixteen_threads_and_sixteen_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUPLANE_WEBHOOK_THREADS", raising=False)
    monkeypatch.setenv("GPUPLANE_WEBHOOK_QUEUE", "0")
    sizes = runpy.run_path(str(WEBHOOK_SERVER), run_name="webhook_server_under_test")["pool_sizes"]
    assert sizes() == (16, 0)
    monkeypatch.delenv("GPUPLANE_WEBHOOK_QUEUE")
    assert sizes() == (16, 16)


def test_the_server_sheds_from_its_event_loop_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from granian.constants import Interfaces

    monkeypatch.setenv("GPUPLANE_WEBHOOK_THREADS", "6")
    monkeypatch.delenv("GPUPLANE_WEBHOOK_SHED", raising=False)
    options = runpy.run_path(str(WEBHOOK_SERVER), run_name="webhook_server_under_test")["options"]
    served = options()
    assert served["interface"] is Interfaces.WSGI and served["target"] == "gpuplane.wsgi:application"
    assert served["blocking_threads"] == 6
    monkeypatch.setenv("GPUPLANE_WEBHOOK_SHED", "true")
    served = options()
    assert served["interface"] is Interfaces.RSGI and served["target"] == "deploy.webhook_server:webhook"
    assert "blocking_threads" not in served
    monkeypatch.setenv("GPUPLANE_WEBHOOK_SHED", "sometimes")
    with pytest.raises(SettingError, match="GPUPLANE_WEBHOOK_SHED='sometimes' is not a boolean"):
        options()

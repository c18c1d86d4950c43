"""50 concurrent webhook calls for 50 VMs competing for room for 10 sets.

Real parts only: a gunicorn server process running the webhook, a `celery worker`, the
local Redis and PostgreSQL. Each call writes its bind requests and waits for the
binder's answer; admission checks are advisory, the binder decides at bind time, so
exactly 10 calls may win and nothing may be over-booked however the calls interleave.
The gunicorn server and the worker are the ``server`` and ``start_worker`` fixtures of
tests/conftest.py (harness/workers.py runs them).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from binder import models
from binder.mirror.snapshot import load_objects
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, gpu_obj, node_obj
from harness.workers import Worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("postgres_only")]

CALLS = 50
ROOM = 10  # two nodes with 5 units each, one unit per VM


def _call(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(  # noqa: S310 - loopback
        f"{url}/webhooks/vmi", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310 - loopback
        assert resp.status == 200
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_fifty_concurrent_calls_for_room_for_ten_sets_allow_exactly_ten(
    server: str, start_worker: Callable[..., Worker]
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


@pytest.mark.parametrize("calls", [5, 50])
def test_concurrent_calls_for_one_vm_all_get_the_same_answer(
    calls: int, server: str, start_worker: Callable[..., Worker]
) -> None:
    """The apiserver retrying, or two replicas, send several reviews for one Pending VM at
    once: they share one bind request (a call joins the request in flight, or follows the one
    that replaced its own), so every call is allowed with the same node, none times out."""
    load_objects(
        [
            class_obj("h100", H100),
            node_obj("n1", {H100: 8}),
            *[gpu_obj("t1", f"train-gpu{i}", "h100", "train") for i in range(4)],
        ]
    )
    start_worker()
    vmi = new_vmi("t1", "train", [f"train-gpu{i}" for i in range(4)])
    bodies = [review(vmi) for _ in range(calls)]
    with ThreadPoolExecutor(max_workers=calls) as pool:
        answers = list(pool.map(lambda body: _call(server, body), bodies))

    verdicts = {(a["response"]["allowed"], a["response"].get("status", {}).get("message")) for a in answers}
    assert verdicts == {(True, None)}, verdicts
    patches = {a["response"]["patch"] for a in answers}
    assert len(patches) == 1  # the same node, the same rewrite, for every call
    assert set(models.GpuDevice.objects.values_list("phase", "node")) == {("Bound", "n1")}

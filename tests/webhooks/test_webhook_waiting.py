"""Calls waiting for the binder: one shared answer read, a bound on how many wait at once,
and the patch encoding that answers them.

- ``webhooks.binding.AnswerReads``: the calls waiting in a process read their answers
  through one statement for all of them; each gets its own devices' rows, never another
  VM's, and a read a call asks for begins after it asked (what it reads was committed
  before then).
- ``GPUPLANE_WEBHOOK_MAX_WAITING``: past it a new order is denied "try again" at once and
  writes nothing; with a place free again the same call binds.
- The patch is encoded with orjson; what orjson refuses (a lone surrogate copied from the
  VMI) is still encoded, escaped, and decodes to the same ops.
- Once answered, a call builds its patch from the view it decided with and the set's rows
  as the shared answer read found them, without a second follow of the read model
  (``webhooks.binding.answered_view``).
"""

from __future__ import annotations

import base64
import gc
import json
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from binder import models
from binder.mirror.snapshot import load_objects
from binder.runtime import bind_requests
from binder.runtime.readmodel import ReadModel
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, gpu_obj, node_obj
from harness.webhook_calls import allowed_patch, denied, post
from webhooks import binding
from webhooks.patch import _pointer, encode_patch

pytestmark = pytest.mark.django_db(transaction=True)


def _cluster() -> None:
    load_objects(
        [
            class_obj("h100", H100),
            node_obj("n1", {H100: 8}),
            *[gpu_obj(f"t{i % 3}", f"vm{i}-gpu{j}", "h100", f"vm{i}") for i in range(6) for j in range(2)],
        ]
    )


def scratch_device(namespace: str, name: str) -> Any:
    """The device's engine record as a read of the whole mirror gives it."""
    model = ReadModel("scratch")
    model.rebuild("test")
    return model.records["GPU"][model.device_ids[(namespace, name)]]


def _answer(namespace: str, names: list[str], request: str, answer: str) -> None:
    models.GpuDevice.objects.filter(namespace__name=namespace, name__in=names).update(
        bind_request=request, answered_request=request, answer=answer
    )


def answer_columns(row: binding.Row) -> tuple[str, str, str, str]:
    """A device row's answer columns: (vm_name, bind_request, answered_request, answer)."""
    return (row.vm_name, row.bind_request, row.answered_request, row.answer)


def test_one_read_holds_the_rows_of_every_waiting_call_and_each_call_gets_only_its_own() -> None:
    _cluster()
    _answer("t0", ["vm0-gpu0", "vm0-gpu1"], "r0", "bound: n1")
    _answer("t1", ["vm1-gpu0"], "r1", "bound: n1")
    reads = binding.AnswerReads()
    with reads.waiting("t0", ("vm0-gpu0", "vm0-gpu1")), reads.waiting("t1", ("vm1-gpu0", "vm1-gpu1")):
        rows = bind_requests.read_rows(reads._waiting.values())
        assert set(rows) == {("t0", "vm0-gpu0"), ("t0", "vm0-gpu1"), ("t1", "vm1-gpu0"), ("t1", "vm1-gpu1")}
        assert answer_columns(rows[("t0", "vm0-gpu0")]) == ("vm0", "r0", "r0", "bound: n1")
        assert answer_columns(rows[("t1", "vm1-gpu1")]) == ("vm1", "", "", "")
        # Each row whole, as the mirror converts it (the patch is built from it).
        assert rows[("t0", "vm0-gpu0")] == scratch_device("t0", "vm0-gpu0")
        mine = reads.rows("t1", ("vm1-gpu0", "vm1-gpu1"))
    assert {name: answer_columns(row) for name, row in mine.items()} == {
        "vm1-gpu0": ("vm1", "r1", "r1", "bound: n1"),
        "vm1-gpu1": ("vm1", "", "", ""),
    }
    assert reads._waiting == {}  # every registration ended with its block
    assert reads.rows("t2", ("no-such-device",)) == {}


def test_a_read_a_call_asks_for_holds_what_was_committed_before_it_asked() -> None:
    _cluster()
    reads = binding.AnswerReads()
    names = ("vm2-gpu0", "vm2-gpu1")
    assert {row.answered_request for row in reads.rows("t2", names).values()} == {""}
    _answer("t2", list(names), "r2", "bound: n1")
    assert {row.answered_request for row in reads.rows("t2", names).values()} == {"r2"}


def test_many_calls_asking_at_once_each_get_their_own_rows_from_fewer_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    _cluster()
    for i in range(6):
        _answer(f"t{i % 3}", [f"vm{i}-gpu0", f"vm{i}-gpu1"], f"r{i}", f"bound: n{i}")
    reads = binding.AnswerReads()
    real = bind_requests.read_rows
    statements: list[int] = []
    gate = threading.Event()

    def counted(wanted: Any) -> Any:
        statements.append(1)
        gate.wait(5)  # hold the first read while the other calls ask: they share the next one
        try:
            return real(wanted)
        finally:
            connection.close()  # each pool thread's own connection

    monkeypatch.setattr(bind_requests, "read_rows", counted)
    calls = 24

    def ask(i: int) -> dict[str, Any]:
        k = i % 6
        return reads.rows(f"t{k % 3}", (f"vm{k}-gpu0", f"vm{k}-gpu1"))

    with ThreadPoolExecutor(max_workers=calls) as pool:
        futures = [pool.submit(ask, i) for i in range(calls)]
        threading.Timer(0.3, gate.set).start()
        results = [f.result(timeout=30) for f in futures]
    for i, rows in enumerate(results):
        k = i % 6
        assert {name: answer_columns(row) for name, row in rows.items()} == {
            f"vm{k}-gpu{j}": (f"vm{k}", f"r{k}", f"r{k}", f"bound: n{k}") for j in range(2)
        }
    assert len(statements) < calls


def test_past_the_limit_of_waiting_calls_a_new_order_is_told_to_try_again_and_writes_nothing(
    client: Client, settings: Any
) -> None:
    _cluster()
    settings.GPUPLANE_WEBHOOK_MAX_WAITING = 1
    body = review(new_vmi("t0", "vm0", ["vm0-gpu0", "vm0-gpu1"]))
    assert binding.ANSWER_READS.enter(0)  # one call already waits in this process
    try:
        message = denied(post(client, body), body)
    finally:
        binding.ANSWER_READS.leave()
    assert message == (
        "VMI t0/vm0: the webhook is already waiting for the binder on 1 calls, as many as it holds at once "
        "(GPUPLANE_WEBHOOK_MAX_WAITING); try again"
    )
    assert set(models.GpuDevice.objects.values_list("bind_request", flat=True)) == {""}
    # A place is free again: the same call binds (the embedded answer pass runs at commit).
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n1"
    assert binding.ANSWER_READS.enter(1)  # every call that waited has left its place
    binding.ANSWER_READS.leave()


def test_without_a_limit_any_number_of_calls_may_wait(client: Client, settings: Any) -> None:
    _cluster()
    settings.GPUPLANE_WEBHOOK_MAX_WAITING = 0
    for _ in range(3):
        assert binding.ANSWER_READS.enter(0)
    try:
        body = review(new_vmi("t0", "vm0", ["vm0-gpu0", "vm0-gpu1"]))
        allowed_patch(post(client, body), body)
    finally:
        for _ in range(3):
            binding.ANSWER_READS.leave()


@pytest.mark.django_db(transaction=False)
def test_the_patch_encodes_what_orjson_refuses_and_escapes_pointers() -> None:
    ops = [
        {"op": "add", "path": _pointer("spec", "nodeSelector", "kubernetes.io/hostname"), "value": "n1"},
        {"op": "add", "path": _pointer("metadata", "annotations", "a~b/c"), "value": "\ud800 and 2**70"},
        {"op": "add", "path": _pointer("spec", "x"), "value": 2**70},
    ]
    decoded = json.loads(base64.b64decode(encode_patch(ops)))
    assert decoded == ops
    assert [op["path"] for op in decoded] == [
        "/spec/nodeSelector/kubernetes.io~1hostname",
        "/metadata/annotations/a~0b~1c",
        "/spec/x",
    ]
    plain = [{"op": "replace", "path": "/spec/domain/devices/gpus", "value": [{"name": "gpu0", "deviceName": "é"}]}]
    assert json.loads(base64.b64decode(encode_patch(plain))) == plain


def test_a_built_read_model_is_left_out_of_the_garbage_collectors_full_collections() -> None:
    """Its records are frozen (``gc.freeze``) once built: a full collection no longer walks
    them, and a record the model lets go of is still freed."""
    _cluster()
    model = ReadModel("gc-test")
    gc.unfreeze()
    model.current()
    assert gc.get_freeze_count() > 0
    probe = weakref.ref(model)
    del model
    assert probe() is None  # let go of: freed by reference counting, frozen or not


def test_a_call_never_takes_a_read_that_began_before_it_was_registered() -> None:
    """Two calls for one VM: the second registers after the first's read; even woken (the
    listener's count reached), it reads again rather than take that older read."""
    _cluster()
    reads = binding.AnswerReads()
    names = ("vm3-gpu0", "vm3-gpu1")
    seen: list[dict[str, Any]] = []

    def second_call() -> None:
        try:
            with reads.waiting("t0", names):
                seen.append(reads.rows("t0", names, woken=-1))  # -1: the count every read without a listener records
        finally:
            connection.close()

    with reads.waiting("t0", names):
        assert {row.answered_request for row in reads.rows("t0", names).values()} == {""}
        _answer("t0", list(names), "r3", "bound: n1")
        thread = threading.Thread(target=second_call)
        thread.start()
        thread.join(timeout=30)
    assert [{row.answered_request for row in rows.values()} for rows in seen] == [{"r3"}]


def test_an_answered_call_builds_its_patch_from_the_answer_read_not_a_second_follow(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One follow per Pending call (at arrival); the patch pins the node the binder chose,
    which the view read before the bind did not hold (no device of the namespace was on it)."""
    from binder.runtime import readmodel

    model = ReadModel("test")
    monkeypatch.setattr(readmodel, "MODEL", model)
    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 8}), gpu_obj("t0", "vm0-gpu0", "h100", "vm0")])
    model.current()
    follows = model.counters.follows
    body = review(new_vmi("t0", "vm0", ["vm0-gpu0"]))
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n1"
    assert model.counters.follows == follows + 1


@pytest.mark.parametrize(
    ("answered", "age", "joins"),
    # "Now" a minute ahead: the call's own wait is 0.3 s, and the first call builds the model.
    [(False, -60, True), (True, -60, False), (False, 3600, False)],
    ids=["in-flight: joined", "answered: replaced", "written before the wait: replaced"],
)
def test_a_call_joins_a_request_in_flight_and_replaces_an_answered_or_old_one(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch, answered: bool, age: int, joins: bool
) -> None:
    """The write that finds a request in flight (one statement with the write) joins it;
    the binder never answers here, so the call times out, leaving the request it waited for."""
    from datetime import timedelta

    from django.utils import timezone

    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 8})])
    load_objects([gpu_obj("t0", f"vm0-gpu{j}", "h100", "vm0") for j in range(2)])
    models.GpuDevice.objects.update(
        bind_request="r-before",
        answered_request="r-before" if answered else "",
        bind_requested_at=timezone.now() - timedelta(seconds=age),
    )
    monkeypatch.setattr("binder.queue.send_answer_pass", lambda: None)  # the binder never answers
    settings.GPUPLANE_BIND_WAIT_SECONDS = 0.3
    body = review(new_vmi("t0", "vm0", ["vm0-gpu0", "vm0-gpu1"]))
    assert "try again" in denied(post(client, body), body)
    requests = set(models.GpuDevice.objects.values_list("bind_request", flat=True))
    assert (requests == {"r-before"}) is joins
    assert len(requests) == 1

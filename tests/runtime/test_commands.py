"""The management commands: dump_state --json, run_pass [--answer-only], demo.

Clusters are built from the real shapes (harness/shapes.py), written as a snapshot file and
loaded with ``load_snapshot``, so every test runs the same path an operator does.
"""

from __future__ import annotations

import io
import json
import random
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from binder import models
from binder.engine.pass_state import REASON_BOUND
from binder.runtime.passes import run_pass
from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    vmi_obj,
    write_snapshot,
)

pytestmark = pytest.mark.django_db

DEMO_FILE = Path(django_settings.BASE_DIR) / "deploy" / "demo" / "cluster.yaml"


def load(path: Path, *args: str) -> str:
    out = io.StringIO()
    call_command("load_snapshot", str(path), *args, stdout=out)
    return out.getvalue()


def command(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def dump() -> dict[str, Any]:
    return json.loads(command("dump_state", "--json"))  # type: ignore[no-any-return]


def iso(delta: timedelta) -> str:
    return (timezone.now() + delta).strftime("%Y-%m-%dT%H:%M:%SZ")


def device(namespace: str, name: str) -> models.GpuDevice:
    return models.GpuDevice.objects.get(namespace__name=namespace, name=name)


# -- dump_state --json ----------------------------------------------------------------------


def small_cluster() -> list[dict[str, Any]]:
    """n1 has 4 A10, n2 has 2. t1 orders a 2-GPU set first, t2 a 1-GPU set later and runs a
    raw pod with 1 A10 on n1; vm1's launcher already runs on n2 (it is in vm1's activePods)."""
    launcher_uid = "0b9c0d3e-7f61-4a52-9f0e-3c1a2b4d5e6f"
    vmi = vmi_obj("t1", "vm1", ["z0", "z1"], {launcher_uid: "n2"}, "n2")
    return [
        node_obj("n1", {A10: 4}),
        node_obj("n2", {A10: 2}),
        class_obj("a10", A10),
        # names sort differently from namespaces: t1/z* must come before t2/a0
        gpu_obj("t1", "z1", "a10", "vm1", created="2026-11-01T00:00:00Z"),
        gpu_obj("t1", "z0", "a10", "vm1", created="2026-11-01T00:00:01Z"),
        gpu_obj("t2", "a0", "a10", "vm2", created="2026-11-02T00:00:00Z"),
        budget_obj("t1", {"a10": 3}),
        vmi,
        launcher_obj(vmi, A10, 2, "n2", uid=launcher_uid, name="virt-launcher-vm1-x7k2p"),
        plain_pod_obj("t2", "trainer-0", A10, 1, "n1"),
    ]


def test_dump_state_json_is_the_spec_shape(tmp_path: Path) -> None:
    load(write_snapshot(tmp_path / "cluster.yaml", small_cluster()))
    run = run_pass()
    assert (run.bound, run.refused) == (2, 0)

    # By hand: vm1 (2 units, oldest) goes to the fullest node with room. n1 has 4 - 1 (pod)
    # = 3 free, leaving 1; n2 has 2 free for vm1 (its own launcher's 2 units are vm1's),
    # leaving 0: n2. vm2 (1 unit) then fits only on n1: 3 free -> 2 left.
    # n1: booked 1 (trainer-0) + 1 (a0) = 2, free 2.  n2: booked 2 (z0, z1; the launcher
    # holds exactly those), free 0.  t1 uses a10 2 and raw A10 2; t2 uses a10 1 and raw A10
    # 1 (a0) + 1 (trainer-0) = 2.
    expected = {
        "devices": [
            {"namespace": "t1", "name": "z0", "class": "a10", "vm": "vm1", "phase": "Bound", "node": "n2",
             "reason": REASON_BOUND},
            {"namespace": "t1", "name": "z1", "class": "a10", "vm": "vm1", "phase": "Bound", "node": "n2",
             "reason": REASON_BOUND},
            {"namespace": "t2", "name": "a0", "class": "a10", "vm": "vm2", "phase": "Bound", "node": "n1",
             "reason": REASON_BOUND},
        ],
        "nodes": [
            {"name": "n1", "resources": {A10: {"allocatable": 4, "booked": 2, "free": 2}}},
            {"name": "n2", "resources": {A10: {"allocatable": 2, "booked": 2, "free": 0}}},
        ],
        "tenants": [
            {"namespace": "t1", "usage": {"a10": 2, A10: 2}, "limits": {"a10": 3}},
            {"namespace": "t2", "usage": {"a10": 1, A10: 2}, "limits": {}},
        ],
    }  # fmt: skip
    text = command("dump_state", "--json")
    state = json.loads(text)
    assert state == expected
    # exactly these keys, in the spec's order, and every number an integer
    assert list(state) == ["devices", "nodes", "tenants"]
    assert [list(d) for d in state["devices"]] == [["namespace", "name", "class", "vm", "phase", "node", "reason"]] * 3
    assert all(list(n) == ["name", "resources"] for n in state["nodes"])
    assert all(list(t) == ["namespace", "usage", "limits"] for t in state["tenants"])
    numbers = [v for n in state["nodes"] for cell in n["resources"].values() for v in cell.values()]
    numbers += [v for t in state["tenants"] for part in ("usage", "limits") for v in t[part].values()]
    assert numbers and all(type(v) is int for v in numbers)


def test_dump_state_sorts_by_namespace_then_name_and_shows_pending(tmp_path: Path) -> None:
    objects = [
        node_obj("b-node", {H100: 1}),
        node_obj("a-node", {H100: 1}),
        class_obj("h100", H100),
        gpu_obj("t2", "a", "h100", "vm"),
        gpu_obj("t1", "b", "h100", "vm"),
        gpu_obj("t1", "a", "missing-class", "vm2"),
        namespace_obj("t0"),
    ]
    load(write_snapshot(tmp_path / "c.yaml", objects))
    state = dump()  # before any pass: nothing placed, reasons empty
    assert [(d["namespace"], d["name"]) for d in state["devices"]] == [("t1", "a"), ("t1", "b"), ("t2", "a")]
    assert all(d["phase"] == "Pending" and d["node"] == "" for d in state["devices"])
    assert [n["name"] for n in state["nodes"]] == ["a-node", "b-node"]
    assert [t["namespace"] for t in state["tenants"]] == ["t0", "t1", "t2"]
    assert state["tenants"][0] == {"namespace": "t0", "usage": {}, "limits": {}}

    run_pass()
    state = dump()
    missing = state["devices"][0]
    assert (missing["phase"], missing["reason"]) == ("Pending", "pending: class missing-class does not exist")
    assert {d["node"] for d in state["devices"][1:]} == {"a-node", "b-node"}

    text = command("dump_state")  # the human form prints the same rows
    assert "t1/a" in text and "node a-node" in text and "tenant t0" in text


# -- determinism ----------------------------------------------------------------------------


def contested_cluster() -> list[dict[str, Any]]:
    """More orders than room, equal-sized nodes (ties by name), a NotReady node past grace
    holding a set, a drained node and a budget: many decisions that must not depend on order."""
    objects: list[dict[str, Any]] = [
        node_obj("n-a", {A10: 4}),
        node_obj("n-b", {A10: 4}),
        node_obj("n-c", {A10: 4}, labels={"gpuplane.io/drain": "true"}),
        node_obj("n-dead", {A10: 4}, ready=False, transition="2026-11-01T00:00:00Z"),
        class_obj("a10", A10),
        budget_obj("t3", {"a10": 2}),
    ]
    objects += [
        gpu_obj("t0", f"held{i}", "a10", "vm-held", phase="Bound", node="n-dead", since="2026-10-01T00:00:00Z")
        for i in range(2)
    ]
    objects += [
        gpu_obj("t0", f"drained{i}", "a10", "vm-drained", phase="Bound", node="n-c", since="2026-10-01T00:00:00Z")
        for i in range(1)
    ]
    for n in range(6):
        ns = f"t{n % 4}"
        size = 1 + n % 3
        objects += [gpu_obj(ns, f"o{n}-{i}", "a10", f"vm{n}", created="2026-11-20T10:00:00Z") for i in range(size)]
    return objects


def test_same_snapshot_gives_the_same_state(tmp_path: Path) -> None:
    objects = contested_cluster()
    path = write_snapshot(tmp_path / "cluster.yaml", objects)
    shuffled = list(objects)
    random.Random(7).shuffle(shuffled)
    shuffled_path = write_snapshot(tmp_path / "shuffled.yaml", shuffled)

    dumps = []
    for snapshot in (path, path, shuffled_path):
        load(snapshot, "--replace")
        command("run_pass")
        command("run_pass")
        dumps.append(command("dump_state", "--json"))
    assert dumps[0] == dumps[1] == dumps[2]
    state = json.loads(dumps[0])
    phases = {d["phase"] for d in state["devices"]}
    assert {"Bound", "Pending"} <= phases  # the cluster really was contested
    assert all(d["node"] not in ("n-c", "n-dead") for d in state["devices"])


# -- run_pass: writes only what changed -----------------------------------------------------


def scenario() -> list[dict[str, Any]]:
    """One order that binds, one over budget, one set on a node NotReady past grace."""
    return [
        node_obj("n-bad", {A10: 4}, ready=False, transition=iso(-timedelta(hours=1))),
        node_obj("n-good", {A10: 4}),
        class_obj("a10", A10),
        gpu_obj("t1", "m0", "a10", "vm-move", phase="Bound", node="n-bad", since="2026-11-29T10:00:00Z"),
        gpu_obj("t1", "m1", "a10", "vm-move", phase="Bound", node="n-bad", since="2026-11-29T10:00:00Z"),
        gpu_obj("t2", "b0", "a10", "vm-new", created="2026-11-20T10:00:00Z"),
        gpu_obj("t3", "o0", "a10", "vm-over", created="2026-11-21T10:00:00Z"),
        gpu_obj("t3", "o1", "a10", "vm-over", created="2026-11-21T10:00:00Z"),
        budget_obj("t3", {"a10": 1}),
    ]


def test_first_pass_counts_and_decisions(tmp_path: Path, settings: Any) -> None:
    settings.GPUPLANE_NODE_GRACE_SECONDS = 300
    load(write_snapshot(tmp_path / "s.yaml", scenario()))
    text = command("run_pass")
    run = models.PassRun.objects.get()
    assert run.kind == models.PassKind.FULL
    assert (run.bound, run.moved, run.lost, run.refused, run.restored) == (1, 1, 0, 1, 0)
    assert run.devices_seen == 5
    assert run.devices_written == 5  # 2 moved, 1 bound, 2 refused (their reason changed)
    assert run.skipped == ""
    assert run.finished is not None and run.duration_ms is not None
    assert f"full pass {run.pk}: 5 devices, 5 written; bound 1, moved 1, lost 0, refused 1" in text

    for name in ("m0", "m1"):
        moved = device("t1", name)
        assert (moved.phase, moved.node) == ("Bound", "n-good")
        assert moved.reason.startswith("moved from n-bad: node n-bad has been NotReady since")
        assert "300s grace period" in moved.reason
        assert moved.since is not None and moved.since >= run.started
    assert (device("t2", "b0").phase, device("t2", "b0").node) == ("Bound", "n-good")
    for name in ("o0", "o1"):
        over = device("t3", name)
        assert (over.phase, over.node) == ("Pending", "")
        assert over.reason.startswith("pending:") and "a10" in over.reason and "1" in over.reason

    decisions = {d.device_name: d for d in models.Decision.objects.all()}
    assert set(decisions) == {"m0", "m1", "b0"}  # refused orders did not change placement
    for name in ("m0", "m1"):
        d = decisions[name]
        assert (d.pass_run_id, d.namespace, d.vm_name) == (run.pk, "t1", "vm-move")
        assert (d.from_phase, d.from_node, d.to_phase, d.to_node) == ("Bound", "n-bad", "Bound", "n-good")
        assert d.reason == device("t1", name).reason
        assert d.created == run.started
    b0 = decisions["b0"]
    assert (b0.pass_run_id, b0.from_phase, b0.from_node, b0.to_phase, b0.to_node) == (
        run.pk,
        "Pending",
        "",
        "Bound",
        "n-good",
    )
    assert b0.reason == REASON_BOUND

    cls = models.GpuClass.objects.get(name="a10")
    assert (cls.status_allocatable, cls.status_bound, cls.status_lost) == (8, 3, 0)
    assert models.GpuBudget.objects.get(namespace__name="t3").used == {"a10": 0}


def test_second_pass_writes_nothing(tmp_path: Path) -> None:
    load(write_snapshot(tmp_path / "s.yaml", scenario()))
    run_pass()
    before = list(models.GpuDevice.objects.order_by("pk").values())
    decisions = models.Decision.objects.count()

    second = run_pass()
    assert second.devices_written == 0
    assert second.devices_seen == 5
    assert models.Decision.objects.count() == decisions
    assert not models.Decision.objects.filter(pass_run=second).exists()
    assert (second.bound, second.moved, second.lost) == (0, 0, 0)
    assert list(models.GpuDevice.objects.order_by("pk").values()) == before  # since kept, too


def test_set_goes_lost_when_no_node_has_room(tmp_path: Path) -> None:
    objects = scenario()
    objects[1]["status"]["allocatable"][A10] = "1"  # n-good can take b0 but not the 2-GPU set
    load(write_snapshot(tmp_path / "s.yaml", objects))
    run = run_pass()
    assert (run.moved, run.lost) == (0, 1)
    for name in ("m0", "m1"):
        lost = device("t1", name)
        assert (lost.phase, lost.node) == ("Lost", "")
        assert lost.reason.startswith("lost: node n-bad has been NotReady")
    decision = models.Decision.objects.get(device_name="m0")
    assert (decision.from_phase, decision.from_node, decision.to_phase, decision.to_node) == (
        "Bound",
        "n-bad",
        "Lost",
        "",
    )


# -- run_pass --answer-only ------------------------------------------------------------------


def test_answer_only_answers_and_moves_nothing(tmp_path: Path) -> None:
    objects = [
        node_obj("n-drain", {A10: 4}, labels={"gpuplane.io/drain": "true"}),
        node_obj("n-ok", {A10: 5}),
        class_obj("a10", A10),
        gpu_obj("t1", "h0", "a10", "vm-held", phase="Bound", node="n-drain"),
        gpu_obj("t1", "h1", "a10", "vm-held", phase="Bound", node="n-drain"),
        gpu_obj("t2", "r0", "a10", "vm-req", bind_request="req-1"),
        gpu_obj("t2", "r1", "a10", "vm-req", bind_request="req-1"),
        gpu_obj("t3", "p0", "a10", "vm-unasked"),  # an order nobody asked about yet
    ]
    load(write_snapshot(tmp_path / "a.yaml", objects))

    text = command("run_pass", "--answer-only")
    run = models.PassRun.objects.get()
    assert run.kind == models.PassKind.ANSWER
    assert text.startswith(f"answer pass {run.pk}:")
    for name in ("r0", "r1"):
        answered = device("t2", name)
        assert answered.answered_request == answered.bind_request == "req-1"
        assert answered.answer == "bound:n-ok"
        assert (answered.phase, answered.node) == ("Bound", "n-ok")
    for name in ("h0", "h1"):  # the drained node's set is not the answer pass's business
        held = device("t1", name)
        assert (held.phase, held.node) == ("Bound", "n-drain")
    assert device("t3", "p0").phase == "Pending"
    assert models.GpuClass.objects.get().status_bound == 0  # no cluster-wide status either
    assert set(models.Decision.objects.values_list("device_name", flat=True)) == {"r0", "r1"}

    # answered: a second answer pass has nothing to do
    again = run_pass(models.PassKind.ANSWER)
    assert again.devices_written == 0

    full = run_pass()
    assert full.moved == 1
    for name in ("h0", "h1"):
        held = device("t1", name)
        assert (held.phase, held.node) == ("Bound", "n-ok")
        assert held.reason == "moved from n-drain: node n-drain is labelled gpuplane.io/drain=true"
    assert device("t3", "p0").phase == "Bound"
    assert device("t2", "r0").answer == "bound:n-ok"  # still answered, not re-answered


def test_answer_only_refusal_says_why(tmp_path: Path) -> None:
    objects = [
        node_obj("n1", {A10: 1}),
        class_obj("a10", A10),
        gpu_obj("t1", "r0", "a10", "vm", bind_request="req-9"),
        gpu_obj("t1", "r1", "a10", "vm", bind_request="req-9"),
    ]
    load(write_snapshot(tmp_path / "a.yaml", objects))
    run_pass(models.PassKind.ANSWER)
    refused = device("t1", "r0")
    assert refused.phase == "Pending"
    assert refused.answered_request == "req-9"
    assert refused.answer.startswith("refused:")
    assert "no Ready, schedulable node" in refused.answer


# -- GPUPLANE_ENABLED=False ----------------------------------------------------------------------


def test_disabled_pass_places_nothing_and_says_why(tmp_path: Path, settings: Any) -> None:
    settings.GPUPLANE_ENABLED = False
    load(write_snapshot(tmp_path / "s.yaml", scenario()))
    before = list(models.GpuDevice.objects.order_by("pk").values())
    text = command("run_pass")
    run = models.PassRun.objects.get()
    assert "GPUPLANE_ENABLED" in run.skipped
    assert run.skipped in text
    assert (run.devices_written, run.bound, run.moved, run.lost, run.refused) == (0, 0, 0, 0, 0)
    assert list(models.GpuDevice.objects.order_by("pk").values()) == before
    assert not models.Decision.objects.exists()

    answer = run_pass(models.PassKind.ANSWER)
    assert "GPUPLANE_ENABLED" in answer.skipped

    settings.GPUPLANE_ENABLED = True
    assert run_pass().bound == 1


# -- demo --------------------------------------------------------------------------------------


def demo_like_file(tmp_path: Path) -> Path:
    objects = [
        namespace_obj("team-a"),
        node_obj("gpu-1", {H100: 8}),
        node_obj("gpu-2", {A10: 2}),
        class_obj("h100", H100),
        class_obj("a10", A10),
        *[gpu_obj("team-a", f"h{i}", "h100", "train") for i in range(4)],
        gpu_obj("team-a", "a0", "a10", "vdi"),
        budget_obj("team-a", {"h100": 8}),
    ]
    return write_snapshot(tmp_path / "demo.yaml", objects)


def test_demo_loads_places_and_creates_a_staff_login(tmp_path: Path, settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast; not under test
    path = DEMO_FILE if DEMO_FILE.exists() else demo_like_file(tmp_path)
    text = command("demo", "--file", str(path), "--username", "demo-admin")
    assert text.startswith("loaded ")
    match = re.search(r"staff login: demo-admin / (\S+)", text)
    assert match, text
    assert "admin:" in text and "/admin/" in text

    user = get_user_model().objects.get(username="demo-admin")
    assert user.is_staff and user.is_superuser and user.is_active
    assert user.check_password(match.group(1))
    assert models.GpuDevice.objects.filter(phase=models.Phase.BOUND).exists()
    runs = list(models.PassRun.objects.order_by("pk"))
    assert len(runs) == 2
    assert runs[1].devices_written == 0  # the second pass confirms the first
    assert f"devices: {models.GpuDevice.objects.filter(phase='Pending').count()} Pending" in text
    # The printed tenant token reads its namespace and nothing else.
    token = re.search(r"Authorization: Token (gpp_\w+)", text)
    assert token, text
    tenant = Client(HTTP_AUTHORIZATION=f"Token {token.group(1)}")
    assert tenant.get("/api/v1/devices").status_code == 200
    assert {d["namespace"] for d in tenant.get("/api/v1/devices").json()["results"]} <= {"team-vision"}
    assert tenant.get("/admin/").status_code == 302

    # running it again replaces the mirror and resets the password
    again = command("demo", "--file", str(path), "--username", "demo-admin")
    new_password = re.search(r"staff login: demo-admin / (\S+)", again)
    assert new_password and new_password.group(1) != match.group(1)
    assert get_user_model().objects.filter(username="demo-admin").count() == 1


def test_demo_with_a_bad_file_fails_cleanly(tmp_path: Path) -> None:
    from django.core.management import CommandError

    bad = write_snapshot(tmp_path / "bad.yaml", [class_obj("zero", A10, units=0)])
    with pytest.raises(CommandError, match="GPUClass zero: spec.unitsPerDevice"):
        command("demo", "--file", str(bad))
    assert not get_user_model().objects.filter(username="admin").exists()


def test_answered_bind_requests_are_recorded_with_their_latency() -> None:
    from datetime import timedelta

    from django.utils import timezone

    from binder.mirror.snapshot import load_objects

    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 1})])
    load_objects(
        [
            gpu_obj("t1", "a-gpu0", "h100", "a", bind_request="req-a"),
            gpu_obj("t1", "b-gpu0", "h100", "b", bind_request="req-b", created="2026-11-21T10:00:00Z"),
        ]
    )
    models.GpuDevice.objects.filter(name="a-gpu0").update(bind_requested_at=timezone.now() - timedelta(seconds=2))
    run = run_pass(models.PassKind.ANSWER)
    answers = {a.device_name: a for a in models.BindAnswer.objects.filter(pass_run=run)}
    assert answers["a-gpu0"].allowed and answers["a-gpu0"].answer == "bound:n1"
    assert answers["a-gpu0"].latency_ms is not None and answers["a-gpu0"].latency_ms >= 2000
    assert not answers["b-gpu0"].allowed and answers["b-gpu0"].latency_ms is None
    # Answered once: the next pass records nothing more.
    again = run_pass(models.PassKind.FULL)
    assert not models.BindAnswer.objects.filter(pass_run=again).exists()

"""Hostile and broken input: clear errors naming what is wrong, nothing half-loaded.

A snapshot cut off mid-file, objects with fields of the wrong type, a file over the
size limit, and request bodies far over what a webhook call can be: every one gets an
error that names the object or field, never a traceback or a 500, and leaves the
mirror exactly as it was.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command
from django.test import Client

from binder import models
from binder.mirror import snapshot
from binder.mirror.snapshot import SnapshotError, load_file
from harness.shapes import A10, gpu_obj, namespace_obj, node_obj, plain_pod_obj, vmi_obj

DEMO = Path(__file__).resolve().parents[2] / "deploy" / "demo" / "cluster.yaml"

pytestmark = pytest.mark.django_db


def counts() -> dict[str, int]:
    return {
        m.__name__: m.objects.count()
        for m in (models.Namespace, models.Node, models.GpuClass, models.GpuDevice, models.Pod, models.GpuBudget)
    }


@pytest.fixture
def before(tmp_path: Path) -> dict[str, int]:
    """A loaded cluster whose rows must survive every bad file untouched."""
    load_file(DEMO)
    return counts()


# -- truncated files ------------------------------------------------------------------------


def test_a_snapshot_cut_anywhere_loads_whole_or_not_at_all(tmp_path: Path, before: dict[str, int]) -> None:
    """Cut the demo dump at 30 places: each load either succeeds (a cut between whole
    objects is a smaller valid dump) or fails with a SnapshotError naming a line or an
    object, and a failure changes nothing."""
    data = DEMO.read_bytes()
    failures = 0
    for i in range(1, 31):
        cut = len(data) * i // 31
        path = tmp_path / f"cut-{i}.yaml"
        path.write_bytes(data[:cut])
        try:
            load_file(path)
        except SnapshotError as exc:
            failures += 1
            text = str(exc)
            assert text.startswith("snapshot rejected, nothing loaded")
            assert "line" in text or "/" in text or ":" in text, text
            assert counts() == before, (cut, text)
    assert failures > 0  # the cuts did hit the middle of objects


# -- wrongly typed fields -------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = obj
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return mutate


WRONG_TYPES: dict[str, tuple[Callable[[], dict[str, Any]], str, Any, str]] = {
    "metadata-list": (lambda: gpu_obj("t1", "g", "a10", "vm"), "metadata", ["x"], "metadata"),
    "name-int": (lambda: gpu_obj("t1", "g", "a10", "vm"), "metadata.name", 42, "metadata.name"),
    "spec-string": (lambda: gpu_obj("t1", "g", "a10", "vm"), "spec", "oops", "spec"),
    "vmname-list": (lambda: gpu_obj("t1", "g", "a10", "vm"), "spec.vmName", ["vm"], "spec.vmName"),
    "labels-list": (lambda: node_obj("n9", {A10: 1}), "metadata.labels", ["a"], "metadata.labels"),
    "allocatable-list": (lambda: node_obj("n9", {A10: 1}), "status.allocatable", [1], "status.allocatable"),
    "unschedulable-string": (lambda: node_obj("n9", {A10: 1}), "spec.unschedulable", "yes", "spec.unschedulable"),
    "containers-dict": (lambda: plain_pod_obj("t1", "p", A10, 1, "n1"), "spec.containers", {}, "spec.containers"),
    "active-pods-list": (
        lambda: vmi_obj("t1", "v", ["g"], {"u": "n1"}, "n1"),
        "status.activePods",
        ["u"],
        "status.activePods",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrongly_typed_fields_are_named_and_nothing_loads(case: str, tmp_path: Path, before: dict[str, int]) -> None:
    build, path, value, field = WRONG_TYPES[case]
    obj = build()
    _set(path, value)(obj)
    good = [namespace_obj("t9"), node_obj("n-new", {A10: 8})]
    file = tmp_path / f"{case}.yaml"
    file.write_text(yaml.safe_dump_all([*good, obj, copy.deepcopy(good[1]) | {"metadata": {"name": "n-new2"}}]))
    with pytest.raises(SnapshotError) as info:
        load_file(file)
    assert any(field in problem for problem in info.value.problems), info.value.problems
    assert counts() == before
    assert not models.Node.objects.filter(name="n-new").exists()


# -- oversized ------------------------------------------------------------------------------


def test_an_oversized_snapshot_is_refused_before_parsing(
    tmp_path: Path, before: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "MAX_SNAPSHOT_BYTES", 10_000)
    big = tmp_path / "big.yaml"
    big.write_bytes(DEMO.read_bytes() * 3)
    with pytest.raises(CommandError, match=r"over the 10000 byte limit"):
        call_command("load_snapshot", str(big), stdout=io.StringIO())
    assert counts() == before


def test_an_oversized_webhook_body_is_413_without_being_read(settings: Any) -> None:
    settings.GPUPLANE_WEBHOOK_MAX_BYTES = 64 * 1024
    body = b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "pad": "' + b"x" * 100_000 + b'"}'
    answer = Client().post("/webhooks/vmi", data=body, content_type="application/json")
    assert answer.status_code == 413
    assert answer.json()["field"] == "(body)" and "at most 65536" in answer.json()["error"]
    # Just under the limit is read and judged on its content (a 400 naming the field).
    small = b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}'
    answer = Client().post("/webhooks/vmi", data=small, content_type="application/json")
    assert answer.status_code == 400 and answer.json()["field"] == "request"


def test_snapshot_times_are_stored_in_utc_and_impossible_ones_are_named(tmp_path: Path, before: dict[str, int]) -> None:
    far = gpu_obj("t1", "g-far", "a10", "vm-far", phase="Pending", created="2026-11-20T10:00:00+19:10")
    file = tmp_path / "far.yaml"
    file.write_text(yaml.safe_dump_all([namespace_obj("t1"), far]))
    load_file(file)  # an offset PostgreSQL would refuse is read as the same instant in UTC
    created = models.GpuDevice.objects.get(name="g-far").created
    assert created is not None and created.isoformat().startswith("2026-11-19T14:50")
    early = gpu_obj("t1", "g-early", "a10", "vm-early", created="0001-01-01T00:00:00+05:00")
    file.write_text(yaml.safe_dump_all([early]))
    with pytest.raises(SnapshotError, match="metadata.creationTimestamp.*outside the years 1-9999"):
        load_file(file)

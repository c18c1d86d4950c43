"""The VMI admission webhook: real AdmissionReview envelopes in, real shapes out.

Requests are the captured AdmissionReview (``admissionreview-v1-request-pod-create.json``)
with the resource swapped to a KubeVirt VMI and the object a VMI shaped like the captured
fedora06 naming gpuplane.io devices; responses are checked against the captured
response shapes, and every patch is decoded and applied with ``jsonpatch`` to the VMI
the apiserver would have patched (requests from ``harness.factories``, answers read by
``harness.webhook_calls``). The embedded default (no broker) runs the answer
pass in-process at commit, so the Pending-set tests exercise the whole flow; on
PostgreSQL one test runs a real Celery worker and checks that LISTEN/NOTIFY wakes the
webhook at once.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import psycopg
import pytest
from django.db import connection
from django.test import Client

from binder import models
from binder.engine import Device, GpuClass, Phase
from binder.mirror.snapshot import load_objects
from binder.runtime.answers import ANSWERS_CHANNEL
from binder.runtime.passes import run_pass
from harness.factories import new_vmi, review
from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    node_obj,
    plain_pod_obj,
    real,
    vmi_obj,
)
from harness.webhook_calls import URL, allowed_patch, answer_of, denied, post
from harness.workers import Worker
from webhooks import admission, binding, views
from webhooks.admission import Action, MirrorView, ReviewError

ROOT = Path(__file__).resolve().parents[2]


# -- the patched VMI ----------------------------------------------------------------------


def gpus(vmi: dict[str, Any]) -> list[tuple[str, str]]:
    return [(g["name"], g["deviceName"]) for g in vmi["spec"]["domain"]["devices"]["gpus"]]


# -- the cluster ---------------------------------------------------------------------------


def cluster(*objects: dict[str, Any], h100: int = 4, a10: int = 4) -> None:
    """Two nodes; class h100 (1 unit of H100 per device), a10x2 (2 units of A10)."""
    load_objects(
        [
            class_obj("h100", H100),
            class_obj("a10x2", A10, units=2),
            node_obj("n1", {H100: h100, A10: a10}),
            node_obj("n2", {H100: h100, A10: a10}),
            *objects,
        ]
    )


def vm1_set(**kwargs: Any) -> list[dict[str, Any]]:
    """VM vm1 in t1: one h100 device and one a10x2 device."""
    return [gpu_obj("t1", "g0", "h100", "vm1", **kwargs), gpu_obj("t1", "g1", "a10x2", "vm1", **kwargs)]


def devices() -> dict[str, models.GpuDevice]:
    return {d.name: d for d in models.GpuDevice.objects.filter(namespace__name="t1")}


# -- allowed -------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_bound_set_is_allowed_with_a_patch_pinning_the_node_and_raw_devicenames(client: Client) -> None:
    cluster(*vm1_set(phase="Bound", node="n2"))
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n2"}
    # One gpus entry per unit: g1 is of class a10x2, two units of A10.
    assert gpus(patched) == [("gpu0", H100), ("gpu1", A10), ("gpu1-1", A10)]
    assert models.PassRun.objects.count() == 0  # a Bound set needs no binder
    assert not any(d.bind_request for d in devices().values())


@pytest.mark.django_db(transaction=True)
def test_a_bound_set_writes_admitted_on_its_first_member_before_the_pin(client: Client) -> None:
    """The webhook's end of "admission and moves exclude each other": the first member by name
    (g0) carries when the VMI was admitted; a dry run writes nothing."""
    cluster(*vm1_set(phase="Bound", node="n2"))
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]), dryRun=True)
    allowed_patch(post(client, body), body)
    assert devices()["g0"].admitted is None
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    patched = allowed_patch(post(client, body), body)
    assert patched["metadata"]["annotations"]["gpuplane.io/pinned"] == "n2"
    assert devices()["g0"].admitted is not None and devices()["g1"].admitted is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ready": False}, "which is NotReady: its launcher could not start there"),
        ({"unschedulable": True}, "which is cordoned: kube-scheduler places no new pod there"),
    ],
    ids=["not-ready", "cordoned"],
)
def test_a_bound_set_on_a_node_that_cannot_start_its_launcher_is_refused_saying_why(
    client: Client, change: dict[str, Any], words: str
) -> None:
    """A set keeps its node while the node takes nothing new, but a VMI pinned there would wait
    for a launcher kube-scheduler never places (and the set may move away meanwhile)."""
    cluster(*vm1_set(phase="Bound", node="n2"))
    models.Node.objects.filter(name="n2").update(**change)
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    message = denied(post(client, body), body)
    assert "its GPUs are held on node n2" in message and words in message, message
    assert devices()["g0"].admitted is None


@pytest.mark.django_db(transaction=True)
def test_a_patched_vmi_reviewed_again_is_allowed_untouched(client: Client) -> None:
    """With ``reinvocationPolicy: IfNeeded`` the apiserver may call again with our own
    result: it names raw resources only, so it passes untouched."""
    cluster(*vm1_set(phase="Bound", node="n2"))
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    again = review(allowed_patch(post(client, body), body))
    assert answer_of(post(client, again), again) == {"uid": again["request"]["uid"], "allowed": True}


@pytest.mark.django_db(transaction=True)
def test_the_patch_keeps_other_node_selectors_and_devices(client: Client) -> None:
    cluster(*vm1_set(phase="Bound", node="n1"))
    vmi = new_vmi("t1", "vm1", ["g0", "g1"], extra_gpus=[{"deviceName": "nvidia.com/GRID_T4-1Q", "name": "gpu1-1"}])
    vmi["spec"]["nodeSelector"] = {"kubevirt.io/schedulable": "true"}
    body = review(vmi)
    answer = answer_of(post(client, body), body)
    ops = json.loads(base64.b64decode(answer["patch"]))
    assert {"op": "add", "path": "/spec/nodeSelector/kubernetes.io~1hostname", "value": "n1"} in ops
    patched = jsonpatch.apply_patch(vmi, ops)
    assert patched["spec"]["nodeSelector"] == {"kubevirt.io/schedulable": "true", "kubernetes.io/hostname": "n1"}
    assert gpus(patched) == [("gpu0", H100), ("gpu1", A10), ("gpu1-2", A10), ("gpu1-1", "nvidia.com/GRID_T4-1Q")]
    assert len({name for name, _ in gpus(patched)}) == 4


@pytest.mark.django_db(transaction=True)
def test_a_pending_set_is_placed_by_an_in_process_answer_pass_and_allowed(client: Client) -> None:
    cluster(*vm1_set(), h100=4, a10=4)
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    patched = allowed_patch(post(client, body), body)
    rows = devices()
    node = rows["g0"].node
    assert {d.phase for d in rows.values()} == {"Bound"} and rows["g1"].node == node
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == node
    assert gpus(patched) == [("gpu0", H100), ("gpu1", A10), ("gpu1-1", A10)]
    request_ids = {d.bind_request for d in rows.values()}
    assert len(request_ids) == 1 and request_ids == {d.answered_request for d in rows.values()}
    assert all(d.bind_requested_at is not None for d in rows.values())
    runs = list(models.PassRun.objects.all())  # newest first
    # The answer pass placed the set and asked for a full pass (usage records, status).
    assert [r.kind for r in runs] == ["full", "answer"]
    assert runs[0].records_opened == 2
    assert models.BindAnswer.objects.filter(allowed=True).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_lost_set_is_rebound_and_allowed(client: Client) -> None:
    cluster(*vm1_set(phase="Lost"))
    body = review(new_vmi("t1", "vm1", ["g1", "g0"]))
    patched = allowed_patch(post(client, body), body)
    rows = devices()
    assert {d.phase for d in rows.values()} == {"Bound"}
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == rows["g0"].node


@pytest.mark.django_db
def test_a_vmi_without_gpuplane_devices_is_allowed_untouched_without_any_query(
    client: Client, django_assert_num_queries: Any
) -> None:
    vmi = real("vmi-with-gpus.yaml", 0)  # names nvidia.com/GA102GL_A10 directly
    body = review(vmi)
    with django_assert_num_queries(0):
        answer = answer_of(post(client, body), body)
    assert answer == {"uid": body["request"]["uid"], "allowed": True}
    assert models.PassRun.objects.count() == 0


@pytest.mark.django_db
def test_a_vmi_without_any_devices_section_is_allowed_untouched(client: Client) -> None:
    vmi = new_vmi("t1", "vm1", [])
    del vmi["spec"]["domain"]["devices"]
    body = review(vmi)
    assert answer_of(post(client, body), body) == {"uid": body["request"]["uid"], "allowed": True}


@pytest.mark.django_db
def test_operations_other_than_create_are_allowed_untouched(client: Client) -> None:
    cluster(*vm1_set())
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]), operation="UPDATE")
    assert answer_of(post(client, body), body)["allowed"] is True
    assert not any(d.bind_request for d in devices().values())


@pytest.mark.django_db(transaction=True)
def test_a_dry_run_places_nothing(client: Client) -> None:
    cluster(*vm1_set())
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]), dryRun=True)
    answer = answer_of(post(client, body), body)
    assert answer["allowed"] is True and "patch" not in answer and answer["warnings"]
    assert not any(d.bind_request for d in devices().values())
    assert models.PassRun.objects.count() == 0


# -- denied --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_over_budget_is_denied_with_the_binders_reason(client: Client) -> None:
    cluster(*vm1_set(), budget_obj("t1", {"a10x2": 1}))
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    message = denied(post(client, body), body)
    assert "over budget: class key a10x2 has limit 1 in the budget, 0 used, and this set needs 2 more" in message
    assert models.PassRun.objects.count() == 0  # advisory: decided from the mirror
    assert not any(d.bind_request for d in devices().values())


@pytest.mark.django_db(transaction=True)
def test_raw_budget_counts_the_tenants_raw_pods_through_the_shared_reader(client: Client) -> None:
    # A forged launcher (owner reference to vm0, but not in vm0's activePods) uses raw A10.
    vm0 = vmi_obj("t1", "vm0", [], {}, "n1")
    forged = launcher_obj(vm0, A10, 1, "n1")
    cluster(*vm1_set(), vm0, forged, plain_pod_obj("t1", "train", A10, 1, "n2"), budget_obj("t1", {A10: 3}))
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    message = denied(post(client, body), body)
    assert f"raw key {A10} has limit 3 in the budget, 2 used, and this set needs 2 more" in message


@pytest.mark.django_db(transaction=True)
def test_a_binder_refusal_is_denied_with_its_reason(client: Client) -> None:
    cluster(*vm1_set(), h100=4, a10=1)  # no node has 2 A10 units
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    message = denied(post(client, body), body)
    assert "no Ready, schedulable node matching the set's classes has room for" in message
    rows = devices()
    assert all(d.answer.startswith("refused:") and d.answered_request == d.bind_request for d in rows.values())
    assert {d.phase for d in rows.values()} == {"Pending"}


@pytest.mark.django_db(transaction=True)
def test_a_timeout_is_denied_with_try_again(client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster(*vm1_set())
    monkeypatch.setattr("binder.queue.send_answer_pass", lambda: None)  # the queue never runs it
    settings.GPUPLANE_BIND_WAIT_SECONDS = 0.3
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    started = time.monotonic()
    message = denied(post(client, body), body)
    elapsed = time.monotonic() - started
    assert "try again" in message and "0.3s" in message
    assert 0.3 <= elapsed < 3
    rows = devices()
    assert all(d.bind_request and not d.answered_request for d in rows.values())
    assert {d.phase for d in rows.values()} == {"Pending"}


@pytest.mark.django_db(transaction=True)
def test_a_set_that_changes_under_the_check_is_denied_with_try_again(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror read said g0, g1 and g2 make the set; by the write g2 is gone."""
    cluster(*vm1_set(), gpu_obj("t1", "g2", "h100", "vm1"))
    stale = binding.mirror_view("t1")
    models.GpuDevice.objects.filter(name="g2").delete()
    monkeypatch.setattr(views, "mirror_view", lambda namespace: stale)
    body = review(new_vmi("t1", "vm1", ["g0", "g1", "g2"]))
    assert "changed while it was checked; try again" in denied(post(client, body), body)
    assert not any(d.bind_request for d in devices().values())  # rolled back
    assert models.PassRun.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_failing_answer_pass_is_a_denial_not_a_500(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster(*vm1_set())

    def broken(kind: str) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr("binder.tasks.run_pass", broken)
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    assert "could not run an answer pass; try again" in denied(post(client, body), body)
    assert all(d.bind_request for d in devices().values())  # the next full pass answers them


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("names", "vm", "expected"),
    [
        (["g0", "ghost"], "vm1", "device gpuplane.io/ghost does not exist in namespace t1"),
        (["g0", "g1", "other"], "vm1", "device gpuplane.io/other belongs to VM vm2, not to vm1"),
        (["g0"], "vm1", "names only part of its set of 2 devices; it must also name gpuplane.io/g1"),
        (["g0", "g1", "theirs"], "vm1", "device gpuplane.io/theirs does not exist in namespace t1"),
        (["g0", "g1", "g0"], "vm1", "names device gpuplane.io/g0 more than once"),
        (["g9"], "vm9", "device gpuplane.io/g9 has class nope, which does not exist"),
    ],
    ids=["unknown", "another-vm", "partial-set", "another-namespace", "twice", "missing-class"],
)
def test_bad_device_names_are_denied_naming_the_device(
    client: Client, names: list[str], vm: str, expected: str
) -> None:
    cluster(
        *vm1_set(),
        gpu_obj("t1", "other", "h100", "vm2"),
        gpu_obj("t2", "theirs", "h100", "vm1"),
        gpu_obj("t1", "g9", "nope", "vm9"),
    )
    body = review(new_vmi("t1", vm, names))
    assert expected in denied(post(client, body), body)
    assert not any(d.bind_request for d in models.GpuDevice.objects.all())
    assert models.PassRun.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_gpus_turned_off_denies_vmis_naming_devices(client: Client, settings: Any) -> None:
    cluster(*vm1_set(phase="Bound", node="n1"))
    settings.GPUPLANE_ENABLED = False
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    assert "GPUs are turned off" in denied(post(client, body), body)
    plain = review(real("vmi-with-gpus.yaml", 0))
    assert answer_of(post(client, plain), plain)["allowed"] is True  # nothing of ours: untouched


# -- malformed -----------------------------------------------------------------------------


def _valid() -> dict[str, Any]:
    return review(new_vmi("t1", "vm1", ["g0", "g1"]))


def _without(path: str) -> dict[str, Any]:
    body = _valid()
    *parents, last = path.split(".")
    node = body
    for part in parents:
        node = node[part]
    del node[last]
    return body


def _with(path: str, value: Any) -> dict[str, Any]:
    body = _valid()
    *parents, last = path.split(".")
    node: Any = body
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return body


MALFORMED: list[tuple[str, Any, str]] = [
    ("pod-review", real("admissionreview-v1-request-pod-create.json"), "request.kind"),
    ("array", [1, 2], "(body)"),
    ("string", "AdmissionReview", "(body)"),
    ("null", None, "(body)"),
    ("empty-object", {}, "apiVersion"),
    ("v1beta1", _with("apiVersion", "admission.k8s.io/v1beta1"), "apiVersion"),
    ("wrong-kind", _with("kind", "AdmissionResponse"), "kind"),
    ("no-request", _without("request"), "request"),
    ("request-list", _with("request", []), "request"),
    ("no-uid", _without("request.uid"), "request.uid"),
    ("empty-uid", _with("request.uid", ""), "request.uid"),
    ("uid-number", _with("request.uid", 7), "request.uid"),
    ("no-kind", _without("request.kind"), "request.kind"),
    ("no-object", _without("request.object"), "request.object"),
    ("object-null", _with("request.object", None), "request.object"),
    ("object-pod", _with("request.object.kind", "Pod"), "request.object.kind"),
    ("object-apps", _with("request.object.apiVersion", "apps/v1"), "request.object.apiVersion"),
    ("gpus-object", _with("request.object.spec.domain.devices.gpus", {"a": 1}), "devices.gpus"),
    ("gpu-string", _with("request.object.spec.domain.devices.gpus.0", "gpuplane.io/g0"), "gpus[0]"),
    ("devicename-int", _with("request.object.spec.domain.devices.gpus.1.deviceName", 3), "gpus[1].deviceName"),
    ("hostdevices-int", _with("request.object.spec.domain.devices.hostDevices", 3), "devices.hostDevices"),
    ("spec-list", _with("request.object.spec", []), "request.object.spec"),
    ("no-namespace", _with("request.namespace", None), "request.namespace"),
    ("dryrun-string", _with("request.dryRun", "yes"), "request.dryRun"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("body", "field"), [(b, f) for _, b, f in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed_reviews_get_400_naming_the_field(client: Client, body: Any, field: str) -> None:
    if field == "request.namespace":
        body["request"]["object"]["metadata"].pop("namespace")
    resp = post(client, body)
    assert resp.status_code == 400, resp.content
    error = resp.json()
    assert field in error["field"] and error["error"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("raw", "content_type"),
    [
        (b"{not json", "application/json"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": ', "application/json"),
        (b"", "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),
        (b'{"a": NaN}', "application/json"),
        (b"apiVersion: admission.k8s.io/v1", "application/yaml"),
        (b"uid=1", "application/x-www-form-urlencoded"),
        (bytes(range(256)) * 8, "application/octet-stream"),
    ],
    ids=["broken", "truncated", "empty", "binary", "deep", "nan", "yaml", "form", "bytes"],
)
def test_garbage_bodies_get_400_json_never_500(client: Client, raw: bytes, content_type: str) -> None:
    resp = client.post(URL, data=raw, content_type=content_type)
    assert resp.status_code == 400, resp.content[:300]
    assert resp["Content-Type"].startswith("application/json")
    assert resp.json()["error"]


@pytest.mark.django_db
def test_other_methods_are_refused_cleanly_and_answers_are_always_json(client: Client) -> None:
    assert client.get(URL).status_code == 405
    body = review(real("vmi-with-gpus.yaml", 0))
    resp = client.post(URL, data=json.dumps(body), content_type="application/json", HTTP_ACCEPT="text/html")
    assert resp["Content-Type"].startswith("application/json") and answer_of(resp, body)["allowed"] is True


# -- the pure decision, exhaustively ---------------------------------------------------------


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


def _replaced(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    body = copy.deepcopy(body)
    node = body
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return body


def _view() -> MirrorView:
    return MirrorView(
        namespace="t1",
        devices=(
            Device("t1", "g0", "h100", "vm1", phase=Phase.BOUND, node="n1"),
            Device("t1", "g1", "a10x2", "vm1", phase=Phase.BOUND, node="n1"),
        ),
        classes=(GpuClass("h100", H100), GpuClass("a10x2", A10, units_per_device=2)),
    )


def test_any_field_of_a_review_replaced_by_any_json_value_gives_a_verdict_or_a_review_error() -> None:
    """Every path of a real review (the whole VMI included), replaced by values of every
    JSON type: the decision either stands or names the field; it never crashes."""
    body = _valid()
    odd: list[Any] = [None, 0, -1.5, "", "x", True, [], {}, ["gpuplane.io/g0"], {"deviceName": 1}]
    outcomes: dict[str, int] = {}
    for path in _paths(body):
        for value in odd:
            try:
                verdict = admission.decide(_replaced(body, path, value), _view())
                if verdict.action is not Action.BIND:
                    admission.response(verdict)
                outcomes[verdict.action.value] = outcomes.get(verdict.action.value, 0) + 1
            except ReviewError as exc:
                assert exc.field and exc.message
                outcomes["400"] = outcomes.get("400", 0) + 1
    assert outcomes["patch"] and outcomes["400"] and outcomes["deny"] and outcomes["allow"]


def test_build_patch_gives_one_entry_per_unit_with_unique_names() -> None:
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["domain"]["devices"]["hostDevices"] = [
        {"deviceName": "gpuplane.io/g1", "name": "gpu0"},
        {"deviceName": "example.com/nic", "name": "gpu0-2"},
    ]
    ops = admission.build_patch(vmi, "n7", {"g0": (H100, 3), "g1": (A10, 2)}, hostname="n7")
    patched = jsonpatch.apply_patch(vmi, ops)
    assert patched["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n7"}
    assert gpus(patched) == [("gpu0", H100), ("gpu0-1", H100), ("gpu0-3", H100)]
    host = [(d["name"], d["deviceName"]) for d in patched["spec"]["domain"]["devices"]["hostDevices"]]
    assert host == [("gpu0-4", A10), ("gpu0-5", A10), ("gpu0-2", "example.com/nic")]


def test_a_response_never_carries_a_patch_without_its_type_and_bind_has_none() -> None:
    patch = admission.Verdict(Action.PATCH, "u1", node="n1", patch=({"op": "add", "path": "/a", "value": 1},))
    body = admission.response(patch)["response"]
    assert body["patchType"] == "JSONPatch" and json.loads(base64.b64decode(body["patch"]))[0]["path"] == "/a"
    allow = admission.response(admission.Verdict(Action.ALLOW, "u2"))["response"]
    assert allow == {"uid": "u2", "allowed": True}
    with pytest.raises(ValueError, match="BIND"):
        admission.response(admission.Verdict(Action.BIND, "u3", bind=("g0",)))


def test_conclude_denies_on_refusal_or_disagreement_and_patches_on_one_node() -> None:
    parsed = admission.parse_review(_valid())
    view = _view()
    refused = admission.conclude(parsed, view, {"g0": "bound:n1", "g1": "refused:over budget: class key x"})
    assert refused.action is Action.DENY and "over budget: class key x" in refused.message
    split = admission.conclude(parsed, view, {"g0": "bound:n1", "g1": "bound:n2"})
    assert split.action is Action.DENY and "try again" in split.message
    ok = admission.conclude(parsed, view, {"g0": "bound:n3", "g1": "bound:n3"})
    assert ok.action is Action.PATCH and ok.node == "n3"


def test_a_set_split_or_growing_needs_the_binder() -> None:
    parsed = admission.parse_review(_valid())
    base = _view()
    for g1 in (
        Device("t1", "g1", "a10x2", "vm1", phase=Phase.BOUND, node="n2"),
        Device("t1", "g1", "a10x2", "vm1"),
        Device("t1", "g1", "a10x2", "vm1", phase=Phase.LOST),
    ):
        view = MirrorView(namespace="t1", devices=(base.devices[0], g1), classes=base.classes)
        verdict = admission.decide(parsed, view)
        assert verdict.action is Action.BIND and verdict.bind == ("g0", "g1")


# -- PostgreSQL: LISTEN/NOTIFY ---------------------------------------------------------------


def _postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY needs PostgreSQL (make test-postgres)")


@pytest.mark.django_db(transaction=True)
def test_a_pass_that_answers_notifies_at_commit() -> None:
    _postgres()
    cluster(gpu_obj("t1", "g0", "h100", "vm1", bind_request="r1"))
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as listener:
        listener.execute(f"LISTEN {ANSWERS_CHANNEL}")
        run = run_pass("answer")
        notes = list(listener.notifies(timeout=5, stop_after=1))
        assert [(n.channel, n.payload) for n in notes] == [(ANSWERS_CHANNEL, str(run.pk))]
        run_pass("answer")  # nothing left to answer: no notification
        assert list(listener.notifies(timeout=0.3)) == []


@pytest.mark.django_db(transaction=True)
def test_with_a_real_worker_the_webhook_is_woken_by_notify(
    client: Client,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[..., Worker],
) -> None:
    """The answer pass runs in a separate `celery worker`; the webhook learns of it only
    through NOTIFY (the fallback re-read is pushed beyond the wait), well before the timeout."""
    _postgres()
    cluster(*vm1_set())
    start_worker()
    settings.GPUPLANE_BIND_WAIT_SECONDS = 8
    monkeypatch.setattr(binding, "RECHECK_SECONDS", 60.0)
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    started = time.monotonic()
    patched = allowed_patch(post(client, body), body)
    elapsed = time.monotonic() - started
    assert elapsed < 3, f"{elapsed:.2f}s: the notification did not wake the webhook"
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == devices()["g0"].node
    assert [r.kind for r in models.PassRun.objects.all()] == ["answer"]


# -- purity and settings -------------------------------------------------------------------


def test_the_decision_module_imports_no_django() -> None:
    """``webhooks.admission`` (and the engine it uses) loads without Django at all."""
    code = (
        "import sys, webhooks.admission; "
        "bad = sorted(m for m in sys.modules if m == 'django' or m.startswith(('django.', 'rest_framework')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("", 8.0), ("0.5", 0.5), ("3", 3.0), ("0.05", None), ("nan", None), ("inf", None), ("x", None)],
)
def test_bind_wait_accepts_fractions_of_a_second_down_to_a_tenth(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: float | None
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from gpuplane.settings import env_float

    monkeypatch.setenv("GPUPLANE_BIND_WAIT_SECONDS", raw)
    if expected is None:
        with pytest.raises(ImproperlyConfigured, match="GPUPLANE_BIND_WAIT_SECONDS"):
            env_float("GPUPLANE_BIND_WAIT_SECONDS", 8.0, minimum=0.1)
    else:
        assert env_float("GPUPLANE_BIND_WAIT_SECONDS", 8.0, minimum=0.1) == expected


@pytest.mark.django_db
def test_a_device_moved_to_another_vm_while_waiting_ends_the_wait_with_a_denial() -> None:
    """The answers are read for this VM's devices only: a device whose spec.vmName was
    edited during the wait answers for its new set, not for this VMI (found by the
    stateful test's review)."""
    cluster(*vm1_set())
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    parsed = admission.parse_review(body)
    models.GpuDevice.objects.filter(name__in=["g0", "g1"]).update(answered_request="r1", answer="bound: n1")
    assert binding.answers_of(parsed, ("g0", "g1"), "r1") == {"g0": "bound: n1", "g1": "bound: n1"}
    models.GpuDevice.objects.filter(name="g1").update(vm_name="vm2")
    verdict = binding.answers_of(parsed, ("g0", "g1"), "r1")
    assert isinstance(verdict, admission.Verdict) and verdict.action is Action.DENY
    assert "gpuplane.io/g1" in verdict.message and "no longer belongs to VM vm1" in verdict.message

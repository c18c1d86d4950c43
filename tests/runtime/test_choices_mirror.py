"""Orders with alternatives through the product: the parser, the mirror, the pass's writes,
``dump_state --json``, the cluster-mode status and the webhook's patch.

A set held as its second choice must look, to everything downstream, exactly like a set
of that class: its held class is what the webhook pins and what usage counts.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from django.core.management import call_command
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from binder import models
from binder.engine import types as e
from binder.kube.objects import ObjectError, parse_object
from binder.mirror.convert import from_parsed
from binder.mirror.snapshot import load_objects
from binder.runtime.cluster import device_status
from binder.runtime.passes import run_pass
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, engine, gpu_obj, namespace_obj, node_obj
from harness.webhook_calls import allowed_patch, post
from usage.models import UsageRecord
from webhooks import admission
from webhooks.admission import Action, MirrorView

A100 = "nvidia.com/GA100_A100_SXM4_80GB"
A100_TOLERATION = {"key": "gpu.example.com/a100", "operator": "Exists", "effect": "NoSchedule"}


def gpu_with(ns: str, name: str, vm: str, alternatives: list[Any], **kw: Any) -> dict[str, Any]:
    obj = gpu_obj(ns, name, kw.pop("class_name", "h100"), vm, **kw)
    obj["spec"]["alternativeClassNames"] = alternatives
    return obj


def a100_class() -> dict[str, Any]:
    obj = class_obj("a100", A100)
    obj["spec"]["tolerations"] = [A100_TOLERATION]
    return obj


def objects(h100_free: int = 0) -> list[dict[str, Any]]:
    """t1's vm1 orders 2 x (h100 or a100); the only h100 node has ``h100_free`` units."""
    return [
        namespace_obj("t1"),
        class_obj("h100", H100),
        a100_class(),
        node_obj("nh", {H100: h100_free}),
        node_obj("na", {A100: 4}),
        gpu_with("t1", "g0", "vm1", ["a100"]),
        gpu_with("t1", "g1", "vm1", ["a100"]),
    ]


def dump() -> dict[str, Any]:
    out = io.StringIO()
    call_command("dump_state", "--json", stdout=out)
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


# -- the parser ---------------------------------------------------------------------------------


def test_alternatives_are_parsed_in_order() -> None:
    parsed = parse_object(gpu_with("t1", "g0", "vm1", ["a100", "l40s"]))
    assert parsed is not None
    assert parsed.values["alternative_class_names"] == ["a100", "l40s"]
    assert parsed.values["status_class_name"] == ""
    assert parse_object(gpu_obj("t1", "g0", "h100", "vm1")).values["alternative_class_names"] == []  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("alternatives", "message"),
    [
        (["a100", "a100"], "spec.alternativeClassNames[1]: lists 'a100' twice"),
        (["h100"], "spec.alternativeClassNames[0]: repeats spec.className 'h100'"),
        ([f"c{i}" for i in range(9)], "spec.alternativeClassNames: must list at most 8 classes, got 9"),
        (["a100", 7], "spec.alternativeClassNames[1]: must be a class name, got int 7"),
        ([""], "spec.alternativeClassNames[0]: must be a class name"),
        ("a100", "spec.alternativeClassNames: must be a list, got str"),
    ],
)
def test_bad_alternatives_are_refused_naming_the_entry(alternatives: Any, message: str) -> None:
    with pytest.raises(ObjectError) as caught:
        parse_object(gpu_with("t1", "g0", "vm1", alternatives))
    assert message in str(caught.value)


def test_status_class_name_is_read_for_held_devices_only() -> None:
    bound = gpu_with("t1", "g0", "vm1", ["a100"], phase="Bound", node="na")
    bound["status"]["className"] = "a100"
    device = engine(bound)
    assert (device.class_name, device.choices) == ("a100", ("h100", "a100"))
    pending = copy.deepcopy(bound)
    pending["status"] = {"phase": "Pending", "className": "a100"}
    assert from_parsed(parse_object(pending)).class_name == "h100"  # type: ignore[arg-type]
    # Without alternatives the held class is always spec.className.
    plain = gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node="nh")
    plain["status"]["className"] = "a100"
    assert engine(plain).class_name == "h100"


# -- the mirror, the pass, dump_state -----------------------------------------------------------


@pytest.mark.django_db
def test_an_order_placed_on_its_second_choice_is_stored_and_dumped_as_held() -> None:
    load_objects(objects(h100_free=0))
    run_pass("full")
    rows = {d.name: d for d in models.GpuDevice.objects.all()}
    assert {(d.phase, d.node, d.class_name, d.status_class_name) for d in rows.values()} == {
        ("Bound", "na", "h100", "a100")
    }
    assert rows["g0"].alternative_class_names == ["a100"]
    assert "as a100 (passed over h100: no h100 node has room for 2 x" in rows["g0"].reason
    state = dump()
    assert [(d["name"], d["class"], d["choices"]) for d in state["devices"]] == [
        ("g0", "a100", ["h100", "a100"]),
        ("g1", "a100", ["h100", "a100"]),
    ]
    (tenant,) = [t for t in state["tenants"] if t["namespace"] == "t1"]
    assert tenant["usage"] == {"a100": 2, A100: 2}
    # Usage records carry the held class and its resource.
    assert set(UsageRecord.objects.values_list("subject", "key", "resource_name", "units")) == {
        ("g0", "a100", A100, 1),
        ("g1", "a100", A100, 1),
    }
    # A second pass reads the held class back and changes nothing.
    second = run_pass("full")
    assert (second.devices_written, second.bound, second.moved, second.lost) == (0, 0, 0, 0)


@pytest.mark.django_db
def test_a_device_without_alternatives_dumps_no_choices_and_records_its_held_class() -> None:
    load_objects(
        [namespace_obj("t1"), class_obj("h100", H100), node_obj("nh", {H100: 4}), gpu_obj("t1", "g0", "h100", "v")]
    )
    run_pass("full")
    (device,) = dump()["devices"]
    assert "choices" not in device and device["class"] == "h100"
    assert models.GpuDevice.objects.get().status_class_name == "h100"


@pytest.mark.django_db
def test_a_pending_order_dumps_its_first_choice_and_every_choice() -> None:
    docs = objects(h100_free=0)
    docs[4] = node_obj("na", {A100: 1})
    load_objects(docs)
    run_pass("full")
    devices = dump()["devices"]
    assert [(d["phase"], d["class"], d["choices"]) for d in devices] == [("Pending", "h100", ["h100", "a100"])] * 2
    assert models.GpuDevice.objects.filter(status_class_name="").count() == 2
    assert devices[0]["reason"].startswith("pending: none of the set's classes can take it: h100: ")


# -- cluster mode: the status the binder writes -------------------------------------------------


def test_cluster_status_carries_the_held_class() -> None:
    held = e.Device("t1", "g0", "a100", "vm1", e.Phase.BOUND, "na", choices=("h100", "a100"))
    assert device_status(held)["className"] == "a100"
    lost = e.Device("t1", "g0", "a100", "vm1", e.Phase.LOST, choices=("h100", "a100"))
    assert device_status(lost)["className"] == "a100"
    # A merge patch with null removes status.className when the device returns to Pending.
    assert device_status(e.Device("t1", "g0", "h100", "vm1"))["className"] is None


# -- the webhook ---------------------------------------------------------------------------------


def test_a_set_held_as_its_second_choice_is_pinned_with_that_class() -> None:
    held = []
    for name in ("g0", "g1"):
        obj = gpu_with("t1", name, "vm1", ["a100"], phase="Bound", node="na")
        obj["status"]["className"] = "a100"
        held.append(engine(obj))
    view = MirrorView(
        namespace="t1",
        devices=tuple(held),
        classes=(engine(class_obj("h100", H100)), engine(a100_class())),
        nodes=(engine(node_obj("na", {A100: 4})),),
    )
    vmi = new_vmi("t1", "vm1", ["g0", "g1"])
    verdict = admission.decide(review(vmi), view)
    assert verdict.action is Action.PATCH and verdict.node == "na"
    patched = jsonpatch.apply_patch(vmi, list(verdict.patch))
    assert [g["deviceName"] for g in patched["spec"]["domain"]["devices"]["gpus"]] == [A100, A100]
    assert A100_TOLERATION in patched["spec"]["tolerations"]


def test_the_crd_refuses_an_alternative_repeating_class_name() -> None:
    """The apiserver checks this one with a CEL rule (the loader refuses it too), so an
    order the cluster accepted never stops parsing."""
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy/base/crds/gpus.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = spec["x-kubernetes-validations"]
    assert rule["rule"] == "!has(self.alternativeClassNames) || !(self.className in self.alternativeClassNames)"


def _order_view(limits: dict[str, int]) -> MirrorView:
    return MirrorView(
        namespace="t1",
        devices=tuple(engine(gpu_with("t1", n, "vm1", ["a100"])) for n in ("g0", "g1")),
        classes=(engine(class_obj("h100", H100)), engine(a100_class())),
        budgets=(engine({"apiVersion": "gpuplane.io/v1alpha1", "kind": "GPUBudget",
                         "metadata": {"name": "b", "namespace": "t1"}, "spec": {"limits": limits}}),),
    )  # fmt: skip


def test_the_advisory_budget_check_denies_only_when_every_choice_is_over_budget() -> None:
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    assert admission.decide(body, _order_view({"h100": 0})).action is Action.BIND
    denied = admission.decide(body, _order_view({"h100": 0, "a100": 1}))
    assert denied.action is Action.DENY
    assert "over budget for every class the set accepts: h100: over budget: class key h100 has limit 0" in (
        denied.message
    )
    assert "; a100: over budget: class key a100 has limit 1" in denied.message


@pytest.mark.django_db
def test_metrics_count_a_held_device_under_its_held_class(client: Any) -> None:
    load_objects(objects(h100_free=0))
    run_pass("full")
    response = client.get("/metrics")
    assert response.status_code == 200
    by_class = {
        (s.labels["class"], s.labels["phase"]): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
        if s.name == "gpuplane_class_devices"
    }
    assert (by_class[("a100", "Bound")], by_class[("h100", "Bound")]) == (2, 0)


@pytest.mark.django_db
def test_the_admin_device_list_shows_the_held_class_and_the_choices(admin_client: Any) -> None:
    load_objects(objects(h100_free=0))
    run_pass("full")
    page = admin_client.get(reverse("admin:binder_gpudevice_changelist")).content.decode()
    assert "a100 (choices h100, a100)" in page


@pytest.mark.django_db(transaction=True)
def test_bind_and_wait_pins_a_set_bound_as_its_second_choice_with_that_class(client: Any) -> None:
    """The answer pass binds the order as a100 (no h100 room): the patch the waiting call
    answers with names a100's resource and toleration, not the first choice's, because the
    view it builds the patch from is read after the answer, not before the bind."""
    load_objects(objects(h100_free=0))
    vmi = new_vmi("t1", "vm1", ["g0", "g1"])
    body = review(vmi)
    patched = allowed_patch(post(client, body), body)
    assert {(d.phase, d.node, d.status_class_name) for d in models.GpuDevice.objects.all()} == {("Bound", "na", "a100")}
    assert [g["deviceName"] for g in patched["spec"]["domain"]["devices"]["gpus"]] == [A100, A100]
    assert A100_TOLERATION in patched["spec"]["tolerations"]
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "na"


def _pending_view(classes: tuple[dict[str, Any], ...]) -> MirrorView:
    devices = tuple(engine(gpu_with("t1", n, "vm1", ["a100"])) for n in ("g0", "g1"))
    return MirrorView(namespace="t1", devices=devices, classes=tuple(engine(c) for c in classes))


def test_an_order_whose_first_choice_is_missing_is_not_denied_while_another_exists() -> None:
    vmi = new_vmi("t1", "vm1", ["g0", "g1"])
    verdict = admission.decide(review(vmi), _pending_view((a100_class(),)))
    assert verdict.action is Action.BIND, verdict.message
    denied = admission.decide(review(vmi), _pending_view(()))
    assert denied.action is Action.DENY
    assert "has classes h100, a100, none of which exists" in denied.message

"""The VMI's node selector on demand.

The webhook writes the VMI's own ``spec.nodeSelector`` with the bind request
(``gpuplane.io/bind-node-selector``, JSON); while the request is unanswered the binder, in an
answer pass or a full pass, places the set only on nodes carrying those labels, so the pin
that follows never contradicts the VMI (which the webhook would then have to deny).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from binder import models, sync
from binder.engine import ANSWER_BOUND, ANSWER_REFUSED, Cluster, answer_pass, full_pass
from binder.engine import types as e
from binder.kube.objects import ObjectError, parse_object
from binder.mirror.snapshot import load_objects
from harness.cluster_mode import cluster_gpus, seed_cluster
from harness.factories import new_vmi, review
from harness.scheduler import launcher_for, schedulable
from harness.shapes import A10, H100, NOW, class_obj, engine, gpu, gpu_class, gpu_obj, node, node_obj
from harness.webhook_calls import allowed_patch, denied, post

ZONE = "topology.kubernetes.io/zone"
ANNOTATION = "gpuplane.io/bind-node-selector"


def zoned(name: str, zone: str, units: int) -> dict[str, Any]:
    return node_obj(name, {H100: units, A10: 4}, labels={ZONE: zone})


def requested(vm: str, n: int, selector: dict[str, str], request: str = "r1") -> list[e.Device]:
    return [
        e.Device("t1", f"{vm}-gpu{i}", "h100", vm, bind_request=request, bind_node_selector=selector) for i in range(n)
    ]


# -- parsing ---------------------------------------------------------------------------------------


def test_the_annotation_is_parsed_into_the_device() -> None:
    obj = gpu_obj("t1", "g0", "h100", "vm1", bind_request="r1")
    obj["metadata"]["annotations"][ANNOTATION] = json.dumps({ZONE: "eu-west-1b"})
    device = engine(obj)
    assert device.bind_node_selector == {ZONE: "eu-west-1b"} and device.wants_answer


@pytest.mark.parametrize("raw", ["{zone: a}", '["a"]', '{"a": 1}', "null"])
def test_a_malformed_annotation_is_an_error_naming_it(raw: str) -> None:
    obj = gpu_obj("t1", "g0", "h100", "vm1", bind_request="r1")
    obj["metadata"]["annotations"][ANNOTATION] = raw
    with pytest.raises(ObjectError) as error:
        parse_object(obj)
    assert error.value.field == f"metadata.annotations[{ANNOTATION}]"
    assert "GPU t1/g0" in str(error.value)


# -- the engine ------------------------------------------------------------------------------------


def _cluster(*devices: e.Device) -> Cluster:
    # "a" is the fuller node: without the selector the set would go there.
    return Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(engine(zoned("na", "eu-west-1a", 2)), engine(zoned("nb", "eu-west-1b", 8))),
        devices=devices,
    )


@pytest.mark.parametrize("run", [answer_pass, full_pass])
def test_an_unanswered_request_is_placed_only_on_nodes_with_the_vmis_labels(run: Any) -> None:
    c = _cluster(*requested("vm", 2, {ZONE: "eu-west-1b"}))
    result = run(c)
    assert {(d.phase, d.node) for d in result.devices} == {(e.Phase.BOUND, "nb")}
    assert {d.answer for d in result.devices} == {ANSWER_BOUND + "nb"}
    # Without a selector the fullest node with room wins.
    plain = run(_cluster(*requested("vm", 2, {})))
    assert {d.node for d in plain.devices} == {"na"}


def test_no_node_with_the_labels_refuses_and_says_which_labels() -> None:
    result = answer_pass(_cluster(*requested("vm", 2, {ZONE: "us-east-1a"})))
    answers = {d.answer for d in result.devices}
    assert len(answers) == 1
    (answer,) = answers
    assert answer.startswith(ANSWER_REFUSED) and f"{ZONE}=us-east-1a" in answer


def test_an_answered_request_no_longer_restricts_the_full_pass() -> None:
    devices = [
        e.Device("t1", f"vm-gpu{i}", "h100", "vm", bind_request="r1", answered_request="r1",
                 answer="refused:x", bind_node_selector={ZONE: "us-east-1a"})
        for i in range(2)
    ]  # fmt: skip
    result = full_pass(_cluster(*devices))
    assert {d.node for d in result.devices} == {"na"}


# -- through the webhook -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_webhook_writes_the_selector_and_the_set_lands_where_the_launcher_can_run(client: Client) -> None:
    nb = zoned("nb", "eu-west-1b", 8)
    load_objects([class_obj("h100", H100), zoned("na", "eu-west-1a", 2), nb, gpu_obj("t1", "g0", "h100", "vm1")])
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["nodeSelector"] = {ZONE: "eu-west-1b"}
    body = review(vmi)
    patched = allowed_patch(post(client, body), body)
    row = models.GpuDevice.objects.get(name="g0")
    assert row.bind_node_selector == {ZONE: "eu-west-1b"} and row.node == "nb"
    assert patched["spec"]["nodeSelector"] == {ZONE: "eu-west-1b", "kubernetes.io/hostname": "nb"}
    assert schedulable(launcher_for(patched), nb)


@pytest.mark.django_db(transaction=True)
def test_a_selector_no_node_carries_is_denied_with_the_binders_reason(client: Client) -> None:
    load_objects([class_obj("h100", H100), zoned("na", "eu-west-1a", 8), gpu_obj("t1", "g0", "h100", "vm1")])
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["nodeSelector"] = {ZONE: "eu-west-1c"}
    body = review(vmi)
    message = denied(post(client, body), body)
    assert f"{ZONE}=eu-west-1c" in message
    assert models.GpuDevice.objects.get(name="g0").phase == "Pending"


@pytest.mark.django_db(transaction=True)
def test_cluster_mode_writes_the_selector_annotation_on_the_gpu_object(apiserver: Any, client: Any) -> None:
    seed_cluster(apiserver)
    sync.sync_once()
    vmi = new_vmi("t2", "vm9", ["vm9-gpu0", "vm9-gpu1"])
    vmi["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "n2"}
    body = review(vmi)
    allowed_patch(post(client, body), body)
    for name in ("vm9-gpu0", "vm9-gpu1"):
        annotations = cluster_gpus(apiserver)[("t2", name)]["metadata"]["annotations"]
        assert json.loads(annotations[ANNOTATION]) == {"kubernetes.io/hostname": "n2"}


def test_two_devices_asking_one_label_two_ways_match_no_node() -> None:
    a = requested("vm", 1, {ZONE: "eu-west-1a"})[0]
    b = e.Device("t1", "vm-gpu1", "h100", "vm", bind_request="r1", bind_node_selector={ZONE: "eu-west-1b"})
    result = answer_pass(_cluster(a, b))
    assert all(d.answer.startswith(ANSWER_REFUSED) for d in result.devices)
    assert node("x", {H100: 1}).labels  # the shapes' nodes carry labels; the rule reads them
    assert gpu("t1", "g", "h100", "v").bind_node_selector == {}


def test_a_label_asked_two_ways_is_refused_naming_both_values() -> None:
    """The refusal says which values conflict, not a placeholder (and no NUL reaches the
    reason the webhook denies with)."""
    a = requested("vm", 1, {ZONE: "eu-west-1a"})[0]
    b = e.Device("t1", "vm-gpu1", "h100", "vm", bind_request="r1", bind_node_selector={ZONE: "eu-west-1b"})
    for device in answer_pass(_cluster(a, b)).devices:
        assert f"{ZONE} (conflicting values eu-west-1a and eu-west-1b)" in device.answer
        assert "\x00" not in device.answer and "\x00" not in device.reason

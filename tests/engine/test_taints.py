"""Taints and tolerations.

Dedicated GPU nodes are commonly tainted (the captured ``hgx-h100-07`` carries
``nvidia.com/gpu=dedicated:NoSchedule``). A class that does not tolerate a node's
NoSchedule/NoExecute taint gets no new devices there (the catalog counts free units the
same way), lifecycle taints under ``node.kubernetes.io/`` are left to the Ready and cordon
rules, a taint never moves a held set, and the webhook gives the VMI the classes'
tolerations so its launcher pod schedules where the devices are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from django.test import Client

from binder.engine import Cluster, Taint, Toleration, full_pass, gpu_options
from binder.engine import types as e
from binder.kube.objects import ObjectError, parse_object
from binder.mirror.snapshot import load_objects
from harness.factories import new_vmi, review
from harness.scheduler import launcher_for, schedulable
from harness.shapes import H100, NOW, class_obj, engine, gpu, gpu_class, gpu_obj, node, real
from harness.webhook_calls import allowed_patch, post

DEDICATED = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "dedicated", "effect": "NoSchedule"}


def tainted_obj(name: str = "hgx-h100-07", units: int = 8) -> dict[str, Any]:
    """The captured tainted HGX node (``nvidia.com/gpu=dedicated:NoSchedule``), uncordoned."""
    obj = real("node-with-gpus.yaml", 1)
    obj["metadata"]["name"] = name
    obj["metadata"]["labels"]["kubernetes.io/hostname"] = name
    obj["spec"]["unschedulable"] = False
    # Uncordoned: the node lifecycle controller removes its unschedulable taint.
    obj["spec"]["taints"] = [t for t in obj["spec"]["taints"] if not t["key"].startswith("node.kubernetes.io/")]
    obj["status"]["allocatable"] = {k: v for k, v in obj["status"]["allocatable"].items() if "/" not in k}
    obj["status"]["allocatable"][H100] = str(units)
    return obj


def tolerating(cls: e.GpuClass, *tolerations: Toleration) -> e.GpuClass:
    return dataclasses.replace(cls, tolerations=tolerations)


def order(vm: str, n: int, cls: str = "h100") -> list[e.Device]:
    return [gpu("t1", f"{vm}-gpu{i}", cls, vm) for i in range(n)]


def after(cluster: Cluster) -> dict[str, e.Device]:
    result = full_pass(cluster)
    merged = {d.name: d for d in cluster.devices}
    merged.update({d.name: d for d in result.devices})
    return merged


# -- parsing ---------------------------------------------------------------------------------


def test_the_captured_taints_are_mirrored() -> None:
    parsed = parse_object(real("node-with-gpus.yaml", 1))
    assert parsed is not None
    assert parsed.values["taints"] == [
        {"key": "nvidia.com/gpu", "value": "dedicated", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
    ]
    n = engine(real("node-with-gpus.yaml", 1))
    assert n.taints == (Taint("nvidia.com/gpu", "dedicated", "NoSchedule"), Taint("node.kubernetes.io/unschedulable"))
    assert engine(real("node-with-gpus.yaml", 0)).taints == ()


@pytest.mark.parametrize(
    ("taints", "field"),
    [
        ([{"effect": "NoSchedule"}], "spec.taints[0].key"),
        ([{"key": "a", "effect": "Never"}], "spec.taints[0].effect"),
        ([{"key": "a", "effect": "NoSchedule", "value": 3}], "spec.taints[0].value"),
        ({"key": "a"}, "spec.taints"),
    ],
)
def test_a_malformed_taint_is_an_error_naming_the_field(taints: Any, field: str) -> None:
    obj = tainted_obj()
    obj["spec"]["taints"] = taints
    with pytest.raises(ObjectError) as error:
        parse_object(obj)
    assert error.value.field == field and "hgx-h100-07" in str(error.value)


def test_class_tolerations_are_parsed_in_the_kubernetes_spelling() -> None:
    obj = class_obj("h100", H100)
    obj["spec"]["tolerations"] = [
        {"key": "nvidia.com/gpu", "value": "dedicated", "effect": "NoSchedule"},
        {"operator": "Exists"},
        {"key": "maint", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    parsed = parse_object(obj)
    assert parsed is not None
    assert parsed.values["tolerations"] == [
        DEDICATED,
        {"operator": "Exists"},
        {"key": "maint", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    cls = engine(obj)
    assert cls.tolerations[0] == Toleration("nvidia.com/gpu", "Equal", "dedicated", "NoSchedule")
    assert cls.tolerations[2].toleration_seconds == 60


@pytest.mark.parametrize(
    ("toleration", "field"),
    [
        ({"key": "a", "operator": "Near"}, "spec.tolerations[0].operator"),
        ({"key": "a", "operator": "Exists", "value": "b"}, "spec.tolerations[0].value"),
        ({"value": "b"}, "spec.tolerations[0].operator"),
        ({"key": "a", "effect": "Sometimes"}, "spec.tolerations[0].effect"),
        ({"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}, "spec.tolerations[0].tolerationSeconds"),
        ({"key": 1}, "spec.tolerations[0].key"),
        ("a", "spec.tolerations[0]"),
    ],
)
def test_a_malformed_toleration_is_an_error_naming_the_field(toleration: Any, field: str) -> None:
    obj = class_obj("h100", H100)
    obj["spec"]["tolerations"] = [toleration]
    with pytest.raises(ObjectError) as error:
        parse_object(obj)
    assert error.value.field == field


# -- Kubernetes' matching rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toleration", "taint", "tolerated"),
    [
        (Toleration("nvidia.com/gpu", "Equal", "dedicated", "NoSchedule"), Taint("nvidia.com/gpu", "dedicated"), True),
        (Toleration("nvidia.com/gpu", "Equal", "shared", "NoSchedule"), Taint("nvidia.com/gpu", "dedicated"), False),
        (Toleration("nvidia.com/gpu", "Exists"), Taint("nvidia.com/gpu", "dedicated", "NoExecute"), True),
        (Toleration("nvidia.com/gpu", "Exists", effect="NoExecute"), Taint("nvidia.com/gpu", "x"), False),
        (Toleration("", "Exists"), Taint("anything", "at-all", "NoExecute"), True),
        (Toleration("other", "Exists"), Taint("nvidia.com/gpu"), False),
        (Toleration("nvidia.com/gpu", "Equal", ""), Taint("nvidia.com/gpu"), True),
        (Toleration("nvidia.com/gpu", "Equal", "", "NoSchedule"), Taint("nvidia.com/gpu", "v"), False),
    ],
)
def test_toleration_matching_follows_kubernetes(toleration: Toleration, taint: Taint, tolerated: bool) -> None:
    assert toleration.tolerates(taint) is tolerated


# -- the binder ----------------------------------------------------------------------------------


def test_an_order_of_a_class_without_the_toleration_is_not_placed_on_the_tainted_node() -> None:
    c = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(engine(tainted_obj(units=8)), node("plain", {H100: 8})),
        devices=(*order("big", 6), *order("small", 4)),
    )
    devices = after(c)
    assert {d.node for d in devices.values() if d.vm_name == "big"} == {"plain"}
    # "small" would fit only on the tainted node: it waits, and says why.
    small = devices["small-gpu0"]
    assert small.phase is e.Phase.PENDING
    assert "not tolerated: hgx-h100-07" in small.reason
    assert "nvidia.com/gpu=dedicated:NoSchedule, which class h100 does not tolerate" in small.reason


def test_an_order_of_a_tolerating_class_goes_to_the_tainted_node() -> None:
    cls = tolerating(gpu_class("h100", H100), Toleration("nvidia.com/gpu", "Equal", "dedicated", "NoSchedule"))
    c = Cluster(now=NOW, classes=(cls,), nodes=(engine(tainted_obj(units=8)),), devices=tuple(order("vm", 4)))
    assert {(d.phase, d.node) for d in after(c).values()} == {(e.Phase.BOUND, "hgx-h100-07")}


def test_prefer_no_schedule_and_lifecycle_taints_do_not_keep_devices_off() -> None:
    obj = tainted_obj()
    obj["spec"]["taints"] = [
        {"key": "nvidia.com/gpu", "value": "dedicated", "effect": "PreferNoSchedule"},
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"},
    ]
    c = Cluster(now=NOW, classes=(gpu_class("h100", H100),), nodes=(engine(obj),), devices=tuple(order("vm", 2)))
    assert {(d.phase, d.node) for d in after(c).values()} == {(e.Phase.BOUND, "hgx-h100-07")}


def test_a_taint_never_moves_a_held_set() -> None:
    held = [gpu("t1", f"vm-gpu{i}", "h100", "vm", phase="Bound", node="hgx-h100-07") for i in range(2)]
    c = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(engine(tainted_obj()), node("plain", {H100: 8})),
        devices=(*held, *order("new", 1)),
    )
    result = full_pass(c)
    devices = after(c)
    assert {(d.phase, d.node) for d in devices.values() if d.vm_name == "vm"} == {(e.Phase.BOUND, "hgx-h100-07")}
    assert not [ch for ch in result.changes if ch.vm_name == "vm"]
    assert devices["new-gpu0"].node == "plain"


def test_the_catalog_counts_free_units_as_the_binder_places() -> None:
    plain = gpu_class("h100", H100)
    nodes = (engine(tainted_obj(units=8)), node("plain", {H100: 2}))
    free = gpu_options(Cluster(now=NOW, classes=(plain,), nodes=nodes), "t1")[0]
    assert (free.cluster_free, free.largest_set) == (2, 2)
    cls = tolerating(plain, Toleration("nvidia.com/gpu", "Exists"))
    free = gpu_options(Cluster(now=NOW, classes=(cls,), nodes=nodes), "t1")[0]
    assert (free.cluster_free, free.largest_set) == (10, 8)


# -- the webhook ---------------------------------------------------------------------------------


def _load_tainted(tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    cls = class_obj("h100", H100)
    cls["spec"]["tolerations"] = tolerations
    tainted = tainted_obj()
    load_objects([cls, tainted, gpu_obj("t1", "g0", "h100", "vm1")])
    return tainted


@pytest.mark.django_db(transaction=True)
def test_the_patch_adds_the_class_tolerations_and_the_launcher_schedules_on_the_tainted_node(client: Client) -> None:
    tainted = _load_tainted([DEDICATED, {"key": "maint", "operator": "Exists", "effect": "NoExecute"}])
    body = review(new_vmi("t1", "vm1", ["g0"]))
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "hgx-h100-07"
    assert DEDICATED in patched["spec"]["tolerations"]
    pod = launcher_for(patched)
    assert schedulable(pod, tainted)
    # Without the added tolerations the launcher would stay Pending on the tainted node.
    bare = launcher_for({**patched, "spec": {k: v for k, v in patched["spec"].items() if k != "tolerations"}})
    assert not schedulable(bare, tainted)


@pytest.mark.django_db(transaction=True)
def test_a_toleration_the_vmi_already_has_is_not_added_twice(client: Client) -> None:
    _load_tainted([DEDICATED, {"key": "other", "operator": "Exists"}])
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "value": "dedicated", "effect": "NoSchedule"}]
    body = review(vmi)
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "value": "dedicated", "effect": "NoSchedule"},
        {"key": "other", "operator": "Exists"},
    ]

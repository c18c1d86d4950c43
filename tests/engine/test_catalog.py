"""The catalog of GPU options: the pure engine function and the DRF endpoint.

Objects are built from the real Kubernetes/KubeVirt captures (harness/shapes.py). The
numbers must come from the engine's ledger and the shared launcher reader: a pod that
forges a launcher's owner reference and labels (its uid not in the VMI's activePods)
lowers the free capacity and the remaining raw budget; the real launcher does not.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from binder.engine import Cluster, DefaultBudget, Settings
from binder.engine import types as e
from binder.engine.catalog import GpuOption, gpu_options
from binder.mirror.snapshot import load_objects
from harness.accounts import account, token_client
from harness.shapes import (
    A10,
    H100,
    NOW,
    budget,
    budget_obj,
    class_obj,
    engine,
    gpu,
    gpu_class,
    gpu_obj,
    launcher_obj,
    node,
    node_obj,
    plain_pod_obj,
    vmi_obj,
)

URL = "/api/v1/catalog/gpu-options"
LAUNCHER_UID = "e566efd1-741e-4def-b164-403f2585fbba"  # the captured launcher's uid


def by_name(options: list[GpuOption]) -> dict[str, GpuOption]:
    return {o.name: o for o in options}


def running_vm(forged_units: int = 0) -> tuple[list[e.Device], list[e.Vmi], list[e.Pod]]:
    """t1/vm1: two h100 devices Bound on n1, its real launcher, and optionally a forged one."""
    devices = [gpu("t1", f"vm1-gpu{i}", "h100", "vm1", phase="Bound", node="n1") for i in range(2)]
    vmi = vmi_obj("t1", "vm1", [d.name for d in devices], {LAUNCHER_UID: "n1"}, "n1")
    pods = [engine(launcher_obj(vmi, H100, 2, "n1", uid=LAUNCHER_UID))]
    if forged_units:
        forged = launcher_obj(vmi, H100, forged_units, "n1", name="virt-launcher-vm1-fake1")
        assert forged["metadata"]["ownerReferences"][0]["name"] == "vm1"
        assert forged["metadata"]["uid"] not in vmi["status"]["activePods"]
        pods.append(engine(forged))
    return devices, [engine(vmi)], pods


# -- engine --------------------------------------------------------------------------------


def test_real_launcher_counts_once_and_forged_launcher_lowers_free_and_raw_budget() -> None:
    def options(forged_units: int) -> GpuOption:
        devices, vmis, pods = running_vm(forged_units)
        cluster = Cluster(
            now=NOW,
            classes=(gpu_class("h100", H100),),
            nodes=(node("n1", {H100: 8}),),
            devices=tuple(devices),
            vmis=tuple(vmis),
            pods=tuple(pods),
            budgets=(budget("t1", {"h100": 6, H100: 6}),),
        )
        return gpu_options(cluster, "t1")[0]

    honest = options(0)
    # Only the two devices count: the real launcher's 2 GPUs are those devices.
    assert (honest.used, honest.remaining, honest.cluster_free, honest.largest_set) == (2, 4, 6, 4)
    forged = options(3)
    # The forged pod's 3 GPUs are raw usage in full: 3 fewer free units, raw key 6 − 5 = 1.
    assert forged.cluster_free == 3
    assert forged.used == 2  # the class key counts devices only
    assert forged.remaining == 1
    assert forged.largest_set == 1


def test_unusable_nodes_do_not_count() -> None:
    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100, selector={"gpu": "h100"}),),
        nodes=(
            node("ok", {H100: 3}, labels={"gpu": "h100"}),
            node("cordoned", {H100: 8}, labels={"gpu": "h100"}, unschedulable=True),
            node("notready", {H100: 8}, labels={"gpu": "h100"}, ready=False),
            node("drained", {H100: 8}, labels={"gpu": "h100", "gpuplane.io/drain": "true"}),
            node("other", {H100: 8}, labels={"gpu": "a100"}),
            node("unlabelled", {H100: 8}),
        ),
    )
    option = gpu_options(cluster, "t1")[0]
    assert (option.cluster_free, option.largest_set) == (3, 3)
    assert option.limit is None and option.remaining is None


def test_largest_set_is_per_node_in_devices_and_negative_free_counts_as_zero() -> None:
    # n1 over-booked by a raw pod (free −2), n2 has 5 free units = 2 devices of 2 units.
    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("a10x2", A10, units=2),),
        nodes=(node("n1", {A10: 2}), node("n2", {A10: 5}), node("n3", {A10: 3})),
        pods=(engine(plain_pod_obj("t2", "trainer", A10, 4, "n1")),),
    )
    option = gpu_options(cluster, "t1")[0]
    assert option.cluster_free == 8
    assert option.largest_set == 2
    assert option.units_per_device == 2


def test_budget_class_key_and_raw_key() -> None:
    devices = [gpu("t1", f"g{i}", "a10x2", "vm1", phase="Bound", node="n1") for i in range(2)]  # 4 units
    lost = [gpu("t1", "l0", "a10x2", "vm2", phase="Lost")]  # 2 units, still counted
    pending = [gpu("t1", "p0", "a10x2", "vm3")]  # nothing
    raw = engine(plain_pod_obj("t1", "trainer", A10, 1, "n2"))  # 1 raw unit
    base = Cluster(
        now=NOW,
        classes=(gpu_class("a10x2", A10, units=2), gpu_class("h100", H100)),
        nodes=(node("n1", {A10: 8, H100: 4}), node("n2", {A10: 8})),
        devices=(*devices, *lost, *pending),
        pods=(raw,),
    )
    # Class key 10 units: 10 − 6 = 4 units = 2 devices; raw key 12: 12 − 7 = 5 units = 2 devices.
    cluster = Cluster(**{**_fields(base), "budgets": (budget("t1", {"a10x2": 10, A10: 12}),)})
    options = by_name(gpu_options(cluster, "t1"))
    a10 = options["a10x2"]
    assert (a10.limit, a10.used, a10.remaining) == (10, 6, 2)
    assert a10.cluster_free == 4 + 7 and a10.largest_set == 2
    assert options["h100"].limit is None and options["h100"].remaining is None  # not in the budget
    # The raw key is tighter: 9 − 7 = 2 units = 1 device; largest set capped by it.
    cluster = Cluster(**{**_fields(base), "budgets": (budget("t1", {"a10x2": 10, A10: 9}),)})
    a10 = by_name(gpu_options(cluster, "t1"))["a10x2"]
    assert (a10.limit, a10.remaining, a10.largest_set) == (10, 1, 1)
    # Raw key only: limit (class key) is null, remaining still bounded.
    cluster = Cluster(**{**_fields(base), "budgets": (budget("t1", {A10: 8}),)})
    a10 = by_name(gpu_options(cluster, "t1"))["a10x2"]
    assert (a10.limit, a10.used, a10.remaining) == (None, 6, 0)
    assert a10.largest_set == 0
    # Over budget never goes negative; two budgets: the smallest limit wins.
    cluster = Cluster(
        **{**_fields(base), "budgets": (budget("t1", {"a10x2": 10}), budget("t1", {"a10x2": 4}, name="b2"))}
    )
    a10 = by_name(gpu_options(cluster, "t1"))["a10x2"]
    assert (a10.limit, a10.remaining) == (4, 0)


def test_key_limited_to_zero_hides_the_class_and_deny_default_hides_all() -> None:
    classes = (gpu_class("a10x2", A10, units=2), gpu_class("h100", H100), gpu_class("h100b", H100))
    nodes = (node("n1", {A10: 8, H100: 4}),)
    cluster = Cluster(now=NOW, classes=classes, nodes=nodes, budgets=(budget("t1", {"h100": 0, A10: 4}),))
    assert [o.name for o in gpu_options(cluster, "t1")] == ["a10x2", "h100b"]
    cluster = Cluster(now=NOW, classes=classes, nodes=nodes, budgets=(budget("t1", {H100: 0}),))
    assert [o.name for o in gpu_options(cluster, "t1")] == ["a10x2"]
    deny = Settings(default_budget=DefaultBudget.DENY)
    assert gpu_options(Cluster(now=NOW, classes=classes, nodes=nodes, settings=deny), "t1") == []
    # With a budget, deny-by-default does not apply: keys it does not name are unlimited.
    cluster = Cluster(now=NOW, classes=classes, nodes=nodes, settings=deny, budgets=(budget("t1", {"h100": 2}),))
    assert [(o.name, o.limit, o.remaining) for o in gpu_options(cluster, "t1")] == [
        ("a10x2", None, None),
        ("h100", 2, 2),
        ("h100b", None, None),
    ]


def _fields(cluster: Cluster) -> dict[str, Any]:
    return {name: getattr(cluster, name) for name in Cluster.__dataclass_fields__}


# -- API -----------------------------------------------------------------------------------


def load_cluster(*, forged: bool = False) -> None:
    vmi = vmi_obj("t1", "vm1", ["g0", "g1"], {LAUNCHER_UID: "n1"}, "n1")
    objects: list[dict[str, Any]] = [
        class_obj("h100", H100),
        class_obj("a10x2", A10, units=2, selector={"gpu": "a10"}),
        node_obj("n1", {H100: 8}),
        node_obj("n2", {H100: 4, A10: 4}, labels={"gpu": "a10"}),
        node_obj("n3", {H100: 8, A10: 8}, labels={"gpu": "a10"}, unschedulable=True),
        gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node="n1"),
        gpu_obj("t1", "g1", "h100", "vm1", phase="Bound", node="n1"),
        vmi,
        launcher_obj(vmi, H100, 2, "n1", uid=LAUNCHER_UID),
        budget_obj("t1", {"h100": 6, H100: 6}),
        budget_obj("t2", {"a10x2": 4}),
    ]
    if forged:
        objects.append(launcher_obj(vmi, H100, 3, "n1", name="virt-launcher-vm1-fake1"))
    load_objects(objects)


def user(name: str, *namespaces: str, staff: bool = False) -> User:
    """A tenant, or staff with the admin's permissions (staff without them read no tenant)."""
    return account(name, *namespaces, superuser=staff)


@pytest.mark.django_db
def test_tenant_reads_own_options_with_token() -> None:
    load_cluster()
    client = token_client(user("alice", "t1"))
    answer = client.get(URL, {"namespace": "t1"})
    assert answer.status_code == 200, answer.content
    assert answer.json() == [
        {
            "name": "a10x2",
            "displayName": "a10x2",
            "resourceName": A10,
            "unitsPerDevice": 2,
            "limit": None,
            "used": 0,
            "remaining": None,
            "clusterFree": 4,  # n3 is cordoned, n1 lacks the label
            "largestSet": 2,
            "borrowing": None,
            "borrowable": 0,
        },
        {
            "name": "h100",
            "displayName": "h100",
            "resourceName": H100,
            "unitsPerDevice": 1,
            "limit": 6,
            "used": 2,
            "remaining": 4,
            "clusterFree": 6 + 4,  # n1: 8 − 2 devices; n2: 4; cordoned n3 not counted
            "largestSet": 4,
            "borrowing": None,
            "borrowable": 0,
        },
    ]


@pytest.mark.django_db
def test_forged_launcher_pod_lowers_free_and_remaining_through_the_api() -> None:
    load_cluster(forged=True)
    client = token_client(user("alice", "t1"))
    h100 = {o["name"]: o for o in client.get(URL, {"namespace": "t1"}).json()}["h100"]
    assert (h100["used"], h100["clusterFree"], h100["remaining"], h100["largestSet"]) == (2, 3 + 4, 1, 1)


@pytest.mark.django_db
def test_staff_see_any_namespace_with_session() -> None:
    load_cluster()
    client = Client()
    client.force_login(user("root", staff=True))
    answer = client.get(URL, {"namespace": "t2"})
    assert answer.status_code == 200
    assert {o["name"]: o["limit"] for o in answer.json()} == {"a10x2": 4, "h100": None}


@pytest.mark.django_db
def test_other_tenant_and_unknown_namespace_are_404_alike() -> None:
    load_cluster()
    client = token_client(user("alice", "t1", "ghost"))
    other = client.get(URL, {"namespace": "t2"})
    assert other.status_code == 404
    unknown = client.get(URL, {"namespace": "ghost"})  # granted, but no such namespace
    assert unknown.status_code == 404
    staff = Client()
    staff.force_login(user("root", staff=True))
    assert staff.get(URL, {"namespace": "nope"}).status_code == 404
    assert other.json() == {"detail": "namespace 't2' not found"}
    assert set(unknown.json()) == {"detail"}


@pytest.mark.django_db
def test_missing_credentials_401_and_bad_token_401() -> None:
    load_cluster()
    answer = Client().get(URL, {"namespace": "t1"})
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"].startswith("Token")
    assert Client(HTTP_AUTHORIZATION="Token nope").get(URL, {"namespace": "t1"}).status_code == 401


@pytest.mark.django_db
def test_missing_namespace_is_400_naming_it() -> None:
    client = token_client(user("alice", "t1"))
    for query in ({}, {"namespace": ""}):
        answer = client.get(URL, query)
        assert answer.status_code == 400
        assert "required" in answer.json()["namespace"][0]


@pytest.mark.django_db
def test_deny_default_lists_nothing_for_a_tenant_without_budget(settings: Any) -> None:
    settings.GPUPLANE_DEFAULT_BUDGET = "deny"
    load_cluster()
    load_objects([gpu_obj("t3", "x0", "h100", "vmx")])  # t3 exists, has no budget
    client = Client()
    client.force_login(user("root", staff=True))
    assert client.get(URL, {"namespace": "t3"}).json() == []
    assert [o["name"] for o in client.get(URL, {"namespace": "t1"}).json()] == ["a10x2", "h100"]


@pytest.mark.django_db
def test_schema_documents_the_catalog() -> None:
    client = Client()
    client.force_login(user("root", staff=True))
    answer = client.get("/api/schema/", {"format": "json"})
    assert answer.status_code == 200
    schema = answer.json()
    operation = schema["paths"][URL]["get"]
    params = {p["name"]: p for p in operation["parameters"]}
    assert set(params) == {"namespace", "devices", "classes"}
    assert params["namespace"]["required"] is True
    assert not params["devices"].get("required") and not params["classes"].get("required")
    answer_ref = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    one_of = schema["components"]["schemas"][answer_ref.rsplit("/", 1)[1]]["oneOf"]
    options, order = one_of
    order_fit = schema["components"]["schemas"][order["$ref"].rsplit("/", 1)[1]]
    assert set(order_fit["properties"]) == {"devices", "choices", "fits", "className", "reason", "budget", "borrowed"}
    ref = options["items"]["$ref"]
    component = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(component["properties"]) == {
        "name",
        "displayName",
        "resourceName",
        "unitsPerDevice",
        "limit",
        "used",
        "remaining",
        "clusterFree",
        "largestSet",
        "borrowing",
        "borrowable",
    }


# -- an order with choices ------------------------------------------------------------------


@pytest.mark.django_db
def test_an_order_with_choices_is_answered_with_the_class_it_would_be_held_as() -> None:
    load_cluster()
    client = token_client(user("alice", "t1"))
    first = client.get(URL, {"namespace": "t1", "devices": "2", "classes": "h100,a10x2"})
    assert first.status_code == 200, first.content
    body = first.json()
    assert (body["devices"], body["choices"], body["fits"], body["className"]) == (2, ["h100", "a10x2"], True, "h100")
    assert body["budget"] == [
        {"key": "h100", "limit": 6, "used": 2, "after": 4},
        {"key": H100, "limit": 6, "used": 2, "after": 4},
    ]
    # The order of preference decides when both fit.
    other = client.get(URL, {"namespace": "t1", "devices": "2", "classes": "a10x2,h100"}).json()
    assert (other["fits"], other["className"]) == (True, "a10x2")
    assert [b["key"] for b in other["budget"]] == ["a10x2", A10]
    # Over the h100 budget and no room for 5 x a10x2: it does not fit, and says why for each choice.
    refused = client.get(URL, {"namespace": "t1", "devices": "5", "classes": "h100,a10x2"}).json()
    assert (refused["fits"], refused["className"], refused["budget"]) == (False, "", [])
    assert "h100" in refused["reason"] and "a10x2" in refused["reason"], refused["reason"]
    # Nothing was written: the options are as before.
    assert by_name_api(client)["h100"]["used"] == 2


def by_name_api(client: Any) -> dict[str, Any]:
    return {o["name"]: o for o in client.get(URL, {"namespace": "t1"}).json()}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "field", "words"),
    [
        ({"devices": "2"}, "classes", "required with devices"),
        ({"classes": "h100"}, "devices", "required with classes"),
        ({"devices": "0", "classes": "h100"}, "devices", "from 1 to 1024"),
        ({"devices": "two", "classes": "h100"}, "devices", "whole number"),
        ({"devices": "1", "classes": "h100,H100!"}, "classes", "is not a class name"),
        ({"devices": "1", "classes": "h100,h100"}, "classes", "listed once"),
        ({"devices": "1", "classes": ",".join(f"c{i}" for i in range(10))}, "classes", "at most 9"),
    ],
)
def test_a_bad_order_query_is_400_naming_the_parameter(query: dict[str, str], field: str, words: str) -> None:
    load_cluster()
    client = token_client(user("alice", "t1"))
    answer = client.get(URL, {"namespace": "t1", **query})
    assert answer.status_code == 400, answer.content
    assert words in answer.json()[field][0]


@pytest.mark.django_db
def test_an_order_query_for_another_tenant_is_404() -> None:
    load_cluster()
    client = token_client(user("bob", "t2"))
    assert client.get(URL, {"namespace": "t1", "devices": "1", "classes": "h100"}).status_code == 404

"""Orders with alternatives on the staff console: every page that lists devices (the set's
decision log, the device page, the Lost sets view, search, the node page) names the class
a device is held as beside its choices, and a device without alternatives reads as before;
the explanation of a Pending or Lost set covers every choice, on every page that shows it.
"""

from __future__ import annotations

import html
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from binder import models
from binder.engine.explain import explain_sets
from binder.mirror.read import read_cluster
from binder.mirror.snapshot import load_objects
from binder.reports.formatting import choices_words, class_words
from binder.runtime.passes import run_pass
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj

pytestmark = pytest.mark.django_db

A100 = "nvidia.com/GA100_A100_SXM4_80GB"
HELD = "held as a100 (choices h100, a100)"


def order(namespace: str, name: str, vm: str, **kw: Any) -> dict[str, Any]:
    """A GPU of class h100 that also accepts a100."""
    obj = gpu_obj(namespace, name, "h100", vm, **kw)
    obj["spec"]["alternativeClassNames"] = ["a100"]
    return obj


def cluster(a100_units: int, *extra: dict[str, Any]) -> list[dict[str, Any]]:
    """t1's vm1 orders 2 x (h100 or a100); the h100 node has no room; ``extra`` adds devices."""
    return [
        namespace_obj("t1"),
        namespace_obj("t2"),
        class_obj("h100", H100),
        class_obj("a100", A100),
        node_obj("nh", {H100: 0}),
        node_obj("na", {A100: a100_units}),
        order("t1", "g0", "vm1"),
        order("t1", "g1", "vm1"),
        *extra,
    ]


@pytest.fixture
def held() -> None:
    """vm1 held as its second choice (a100) on na, beside t1's plain a100 device p0."""
    load_objects(cluster(4, gpu_obj("t1", "p0", "a100", "plain")))
    run_pass("full")
    rows = {d.name: (d.phase, d.node, d.status_class_name) for d in models.GpuDevice.objects.all()}
    assert rows == {"g0": ("Bound", "na", "a100"), "g1": ("Bound", "na", "a100"), "p0": ("Bound", "na", "a100")}


def _page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.content[:500]
    return html.unescape(response.content.decode())


def _device(name: str) -> models.GpuDevice:
    return models.GpuDevice.objects.get(name=name)


def test_the_words_for_held_pending_and_plain_devices(held: None) -> None:
    assert choices_words(_device("g0")) == class_words(_device("g0")) == HELD
    assert (choices_words(_device("p0")), class_words(_device("p0"))) == ("", "a100")
    models.GpuDevice.objects.filter(name="g0").update(phase=models.Phase.PENDING, node="", status_class_name="")
    assert class_words(_device("g0")) == "choices h100, a100"


def test_the_node_page_names_the_held_class_and_the_choices(admin_client: Client, held: None) -> None:
    page = _page(admin_client, reverse("admin:node-detail", args=["na"]))
    assert f"g0</a> ({HELD})" in page and f"g1</a> ({HELD})" in page
    assert "p0</a> (a100)" in page


def test_the_set_page_names_the_held_class_and_the_choices(admin_client: Client, held: None) -> None:
    url = reverse("admin:decisions")
    page = _page(admin_client, f"{url}?namespace=t1&vm=vm1")
    assert page.count(f'<td class="device-class">{HELD}</td>') == 2
    page = _page(admin_client, f"{url}?namespace=t1&vm=plain")
    assert '<td class="device-class">a100</td>' in page and "choices" not in page


def test_search_names_the_held_class_and_the_choices(admin_client: Client, held: None) -> None:
    page = _page(admin_client, reverse("admin:search") + "?q=t1/g0")
    assert f"{HELD}, VM vm1: Bound on na" in page
    page = _page(admin_client, reverse("admin:search") + "?q=t1/p0")
    assert "a100, VM plain: Bound on na" in page and "choices" not in page


def test_the_device_page_names_the_held_class_and_the_choices(admin_client: Client, held: None) -> None:
    page = _page(admin_client, reverse("admin:binder_gpudevice_change", args=[_device("g0").pk]))
    assert f'<p class="device-choices" id="device-choices">{HELD}</p>' in page
    page = _page(admin_client, reverse("admin:binder_gpudevice_change", args=[_device("p0").pk]))
    assert 'id="device-choices"' not in page


def test_a_lost_set_shows_its_held_class_and_is_explained_for_every_choice(admin_client: Client) -> None:
    """Held as a100, then Lost: neither class has room for both devices anywhere."""
    lost = []
    for name in ("g0", "g1"):
        obj = order("t1", name, "vm1", phase="Lost")
        obj["status"]["className"] = "a100"
        lost.append(obj)
    load_objects([*cluster(1)[:6], *lost])
    page = _page(admin_client, reverse("admin:binder_lostset_changelist"))
    row = page[page.index('class="lost-set" data-set="t1/vm1"') :]
    row = row[: row.index("</tr>")]
    assert f"g0 ({HELD}), g1 ({HELD})" in row
    assert "needs 2 × h100 on one node" in row and "needs 2 × a100 on one node" in row
    device = _page(admin_client, reverse("admin:binder_gpudevice_change", args=[_device("g0").pk]))
    assert HELD in device
    assert "needs 2 × h100 on one node" in device and "needs 2 × a100 on one node" in device


def test_a_pending_set_is_explained_for_every_choice(admin_client: Client) -> None:
    load_objects(cluster(1))
    run_pass("full")
    assert set(models.GpuDevice.objects.values_list("phase", flat=True)) == {"Pending"}
    page = _page(admin_client, reverse("admin:binder_lostset_changelist"))
    row = page[page.index('class="pending-set" data-set="t1/vm1"') :]
    row = row[: row.index("</tr>")]
    assert "needs 2 × h100 on one node" in row and "needs 2 × a100 on one node" in row
    device = _page(admin_client, reverse("admin:binder_gpudevice_change", args=[_device("g0").pk]))
    assert '<p class="device-choices" id="device-choices">choices h100, a100</p>' in device
    assert "needs 2 × h100 on one node" in device and "needs 2 × a100 on one node" in device


def test_the_device_page_counts_what_holds_an_alternative_class(admin_client: Client) -> None:
    """Another tenant's device on the a100 node: the device page (which reads only what the
    set's explanation counts) must read it, or it would say the a100 node has room."""
    load_objects(cluster(2, gpu_obj("t2", "x0", "a100", "other", phase="Bound", node="na")))
    run_pass("full")
    assert _device("x0").phase == "Bound" and _device("g0").phase == "Pending"
    (whole,) = [why for key, why in explain_sets(read_cluster(timezone.now())[0]).items() if key == ("t1", "vm1")]
    assert "the largest gap is 1 on na, 1 held by set t2/other" in whole.summary
    device = _page(admin_client, reverse("admin:binder_gpudevice_change", args=[_device("g0").pk]))
    assert whole.summary in device


def test_the_board_names_the_held_class_and_the_choices(admin_client: Client, held: None) -> None:
    page = _page(admin_client, reverse("admin:placement-board"))
    assert page.count(f"· {HELD}") == 2  # g0 and g1, in their cells' titles
    assert "tenant t1 · class a100" in page  # p0 has no alternatives: its class alone

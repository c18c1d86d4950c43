"""The staff search box and the node page: one box on every staff page
finds tenants, VMs (``tenant/VM`` too), devices, nodes and pods, grouped with links; the
node page lists a node's sets and pods with the ledger's figures."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from binder import models
from binder.engine import ledger_for
from binder.mirror.read import read_cluster
from binder.reports.nodes import node_report
from binder.reports.search import MAX_QUERY
from harness.shapes import A10, H100
from harness.staff_cluster import SEG_TRAIN_LAUNCHER

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

SEARCH = "admin:search"


class Hits(HTMLParser):
    """kind -> [(label, first link)] from the results page."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: dict[str, list[tuple[str, str]]] = {}
        self._kind = ""
        self._label = ""
        self._href = ""
        self._in_link = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "li" and "hit" in a.get("class", ""):
            self._kind, self._label = a["data-kind"], a["data-name"]
        elif tag == "a" and "hit-link" in a.get("class", ""):
            self.hits.setdefault(self._kind, []).append((self._label, a["href"]))


def hits(client: Client, q: str) -> dict[str, list[tuple[str, str]]]:
    response = client.get(reverse(SEARCH), {"q": q})
    assert response.status_code == 200, response.content
    parser = Hits()
    parser.feed(response.content.decode())
    return parser.hits


def labels(found: dict[str, list[tuple[str, str]]], kind: str) -> list[str]:
    return [label for label, _ in found.get(kind, [])]


def test_the_search_box_is_on_every_staff_page(admin_client: Client, placed: models.PassRun) -> None:
    pages = [
        reverse("admin:index"),
        reverse("admin:placement-board"),
        reverse("admin:budgets"),
        reverse("admin:binder_lostset_changelist"),
        reverse("admin:binder_gpudevice_changelist"),
        reverse("admin:binder_passrun_changelist"),
        reverse("admin:node-detail", args=["n1"]),
        reverse(SEARCH),
    ]
    for url in pages:
        html = admin_client.get(url).content.decode()
        assert f'action="{reverse(SEARCH)}"' in html and 'name="q"' in html, url
    login = Client().get(reverse("admin:login")).content.decode()
    assert 'id="gp-search"' not in login  # not for the anonymous


def test_a_tenant_finds_the_tenant_and_what_it_has(admin_client: Client, placed: models.PassRun) -> None:
    found = hits(admin_client, "team-vision")
    assert labels(found, "tenant") == ["team-vision"]
    assert labels(found, "vm") == ["team-vision/infer", "team-vision/notebook", "team-vision/seg-train"]
    assert "team-vision/seg-train-gpu0" in labels(found, "device")
    assert labels(found, "pod") == [f"team-vision/{SEG_TRAIN_LAUNCHER}"]
    tenant_link = found["tenant"][0][1]
    namespace = models.Namespace.objects.get(name="team-vision")
    assert tenant_link == reverse("admin:binder_gpudevice_changelist") + f"?namespace__id__exact={namespace.pk}"
    listing = admin_client.get(tenant_link)
    assert {d.namespace.name for d in listing.context["cl"].result_list} == {"team-vision"}


def test_tenant_slash_vm(admin_client: Client, placed: models.PassRun) -> None:
    found = hits(admin_client, "team-vision/seg-train")
    assert labels(found, "vm") == ["team-vision/seg-train"]
    assert labels(found, "device") == ["team-vision/seg-train-gpu0", "team-vision/seg-train-gpu1"]
    assert labels(found, "pod") == [f"team-vision/{SEG_TRAIN_LAUNCHER}"]
    assert "tenant" not in found and "node" not in found
    vm_link = found["vm"][0][1]
    assert vm_link == reverse("admin:decisions") + "?namespace=team-vision&vm=seg-train"
    page = admin_client.get(reverse(SEARCH), {"q": "team-vision/seg-train"}).content.decode()
    assert "2 devices: 2 Bound on n2" in page
    assert f'href="{reverse("admin:node-detail", args=["n2"])}"' in page
    # a part of the tenant's name works too; another tenant's VM of that name does not show
    assert labels(hits(admin_client, "vision/seg"), "vm") == ["team-vision/seg-train"]
    assert hits(admin_client, "team-nlp/seg-train") == {}


def test_devices_nodes_and_pods(admin_client: Client, placed: models.PassRun) -> None:
    device = models.GpuDevice.objects.get(name="rag-serve-gpu2")
    found = hits(admin_client, "rag-serve-gpu2")
    assert found["device"] == [("team-nlp/rag-serve-gpu2", reverse("admin:binder_gpudevice_change", args=[device.pk]))]
    found = hits(admin_client, "n3")
    assert found["node"] == [("n3", reverse("admin:node-detail", args=["n3"]))]
    pod = models.Pod.objects.get(name="trainer-0")
    assert hits(admin_client, "trainer")["pod"] == [
        ("team-nlp/trainer-0", reverse("admin:binder_pod_change", args=[pod.pk]))
    ]
    assert hits(admin_client, pod.uid)["pod"][0][0] == "team-nlp/trainer-0"
    assert hits(admin_client, "TEAM-NLP/RAG")["vm"][0][0] == "team-nlp/rag-serve"  # case does not matter


def test_nothing_found_and_bad_queries(admin_client: Client, placed: models.PassRun) -> None:
    response = admin_client.get(reverse(SEARCH), {"q": "no-such-thing"})
    assert response.status_code == 200 and 'id="search-nothing"' in response.content.decode()
    assert admin_client.get(reverse(SEARCH)).status_code == 200
    too_long = admin_client.get(reverse(SEARCH), {"q": "x" * (MAX_QUERY + 1)})
    assert too_long.status_code == 400
    assert f"at most {MAX_QUERY} are searched" in too_long.content.decode()
    assert admin_client.post(reverse(SEARCH), {"q": "x"}).status_code == 405


def test_groups_are_capped_with_the_total(admin_client: Client, placed: models.PassRun) -> None:
    models.Node.objects.bulk_create([models.Node(name=f"bulk-{i:03}") for i in range(40)])
    page = admin_client.get(reverse(SEARCH), {"q": "bulk-"}).content.decode()
    assert "40, the first 25 shown" in page
    assert len(labels(hits(admin_client, "bulk-"), "node")) == 25


def test_search_shows_only_what_the_user_may_see(client: Client, placed: models.PassRun) -> None:
    user = get_user_model().objects.create_user("helpdesk", password="pw-123456789", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_node"))
    client.login(username="helpdesk", password="pw-123456789")
    found = hits(client, "n")
    assert set(found) == {"node"}


def test_device_admin_search_includes_the_namespace(admin_client: Client, placed: models.PassRun) -> None:
    response = admin_client.get(reverse("admin:binder_gpudevice_changelist"), {"q": "team-vision"})
    assert {d.namespace.name for d in response.context["cl"].result_list} == {"team-vision"}
    assert len(response.context["cl"].result_list) == 4


# -- the node page --------------------------------------------------------------------------------


def test_node_page_lists_sets_and_pods(admin_client: Client, placed: models.PassRun) -> None:
    response = admin_client.get(reverse("admin:node-detail", args=["n2"]))
    assert response.status_code == 200
    report = response.context["report"]
    assert [s.key for s in report.sets] == ["team-vision/seg-train"]
    assert report.sets[0].units == {H100: 2}
    assert [(p.pod.name, p.launcher_of) for p in report.pods] == [(SEG_TRAIN_LAUNCHER, "team-vision/seg-train")]
    html = response.content.decode()
    assert 'data-set="team-vision/seg-train"' in html and "launcher of VMI team-vision/seg-train" in html

    n3 = admin_client.get(reverse("admin:node-detail", args=["n3"])).context["report"]
    assert [s.key for s in n3.sets] == ["team-vision/notebook"]
    assert [(p.pod.name, p.launcher_of, p.raw_units) for p in n3.pods] == [("trainer-0", "", {A10: 1})]
    assert [(r.resource, r.allocatable, r.booked, r.devices, r.free) for r in n3.resources] == [(A10, 4, 2, 1, 2)]


def test_node_page_figures_match_the_whole_cluster_ledger(placed: models.PassRun) -> None:
    cluster, _ = read_cluster(timezone.now())
    ledger = ledger_for(cluster)
    for node in ("n1", "n2", "n3"):
        report = node_report(node)
        assert report is not None
        for line in report.resources:
            assert (line.booked, line.free) == (ledger.booked[node][line.resource], ledger.free(node, line.resource))


def test_node_page_states_and_unknown_nodes(admin_client: Client, placed: models.PassRun) -> None:
    models.Node.objects.filter(name="n1").update(ready=False, ready_since=timezone.now(), unschedulable=True)
    report = admin_client.get(reverse("admin:node-detail", args=["n1"])).context["report"]
    assert report.states == ("NotReady", "cordoned")
    missing = admin_client.get(reverse("admin:node-detail", args=["no-such-node"]))
    assert missing.status_code == 404 and missing.context["error"].startswith("No node 'no-such-node'")


def test_node_names_link_to_the_node_page(admin_client: Client, placed: models.PassRun) -> None:
    n2 = reverse("admin:node-detail", args=["n2"])
    for url in ("admin:binder_gpudevice_changelist", "admin:binder_pod_changelist", "admin:binder_node_changelist"):
        assert f'href="{n2}"' in admin_client.get(reverse(url)).content.decode(), url

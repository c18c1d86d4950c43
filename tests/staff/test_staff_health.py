"""The admin's home page shows the health of the fleet first: Lost sets,
Pending sets with their reasons, NotReady, cordoned and draining nodes, budgets at their
limit, each linked; "as of" its time; auto-refresh off unless asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from binder import models
from binder.reports.formatting import iso
from binder.reports.health import fleet_health
from binder.runtime.passes import run_pass
from harness.clock import Clock
from harness.shapes import NOW
from harness.staff_cluster import load_staff_cluster

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]


@pytest.fixture
def troubled(tmp_path: Path, clock: Clock) -> None:
    """n1 drained (rag-serve Lost, infer moved to n2), n3 cordoned, n2 NotReady since NOW;
    team-nlp's h100 budget full (its Lost set still counts), big-order Pending over budget."""
    load_staff_cluster(tmp_path)
    node = models.Node.objects.get(name="n1")
    node.labels = {**node.labels, "gpuplane.io/drain": "True"}  # any case, as the engine reads it
    node.save()
    models.Node.objects.filter(name="n3").update(unschedulable=True)
    run_pass()
    models.Node.objects.filter(name="n2").update(ready=False, ready_since=NOW)
    clock.advance(minutes=3)


def test_home_page_lists_what_needs_attention(admin_client: Client, troubled: None) -> None:
    response = admin_client.get(reverse("admin:index"))
    assert response.status_code == 200
    health = response.context["health"]
    assert [s.key for s in health.lost.rows] == ["team-nlp/rag-serve"]
    assert [(s.key, s.reason.split(":")[0]) for s in health.pending.rows] == [("team-nlp/big-order", "pending")]
    assert "over budget" in health.pending.rows[0].reason
    assert [(n.name, n.states) for n in health.nodes.rows] == [
        ("n2", ("NotReady",)),
        ("n1", ("draining",)),
        ("n3", ("cordoned",)),
    ]
    assert [(b.namespace, b.key, b.used, b.limit) for b in health.budgets.rows] == [("team-nlp", "h100", 4, 4)]
    html = response.content.decode()
    decisions = reverse("admin:decisions")
    assert f'href="{decisions}?namespace=team-nlp&amp;vm=rag-serve"' in html
    assert f'href="{decisions}?namespace=team-nlp&amp;vm=big-order"' in html
    for node in ("n1", "n2", "n3"):
        assert f'href="{reverse("admin:node-detail", args=[node])}"' in html, node
    assert "NotReady 3 min (since 2026-11-30T12:00:00+0000)" in html
    assert f"as of <time>{iso(NOW.replace(minute=3))}</time>" in html
    assert html.index('id="fleet-health"') < html.index('id="staff-pages"')  # first on the page
    for link in (f"{decisions}?namespace=team-nlp&vm=rag-serve", reverse("admin:node-detail", args=["n2"])):
        assert admin_client.get(link).status_code == 200, link


def test_auto_refresh_is_off_unless_asked(admin_client: Client, troubled: None) -> None:
    html = admin_client.get(reverse("admin:index")).content.decode()
    assert 'http-equiv="refresh"' not in html and "auto-refresh off" in html
    assert f'href="{reverse("admin:index")}?refresh=30"' in html
    html = admin_client.get(reverse("admin:index"), {"refresh": "30"}).content.decode()
    assert '<meta http-equiv="refresh" content="30">' in html and "auto-refresh every 30 s" in html
    for bad in ("1", "abc", "-5", "99999"):
        html = admin_client.get(reverse("admin:index"), {"refresh": bad}).content.decode()
        assert 'http-equiv="refresh"' not in html, bad
    assert "script-src 'self'" in admin_client.get(reverse("admin:index")).headers["Content-Security-Policy"]


def test_a_healthy_fleet_says_so(admin_client: Client, tmp_path: Path) -> None:
    load_staff_cluster(tmp_path)
    models.GpuDevice.objects.filter(vm_name="big-order").delete()
    models.GpuBudget.objects.update(limits={"h100": 8})
    run_pass()
    health = fleet_health()
    assert health.healthy, health
    assert 'id="health-ok"' in admin_client.get(reverse("admin:index")).content.decode()


def test_health_needs_the_view_permissions(client: Client, troubled: None) -> None:
    user = get_user_model().objects.create_user("helpdesk", password="pw-123456789", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_node"))
    client.login(username="helpdesk", password="pw-123456789")
    response = client.get(reverse("admin:index"))
    assert response.status_code == 200 and "health" not in response.context


def test_health_lists_are_capped(troubled: None) -> None:
    models.Node.objects.bulk_create([models.Node(name=f"bad-{i:02}", ready=False) for i in range(30)])
    nodes = fleet_health(limit=20).nodes
    assert (len(nodes.rows), nodes.total, nodes.more) == (20, 33, 13)

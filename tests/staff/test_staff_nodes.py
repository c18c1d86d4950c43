"""Node actions: cordon, uncordon, drain and undrain from the node page,
confirmed on a page that shows where the binder would put the node's sets (the drain
preview: the engine's next full pass on a copy), written to the mirror in standalone and
to the API server in cluster mode, then a full pass triggered by the staff user; and
retries that report the truth."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from binder import models, sync
from binder.engine import types as e
from binder.engine.preview import NodeAction, preview
from binder.mirror.read import read_cluster
from binder.reports.nodes import node_preview
from binder.runtime.passes import run_pass
from harness.controlplane import UNION_USER, ControlPlane
from harness.shapes import H100
from harness.staff_cluster import staff_objects

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_passwords")]


def action_url(node: str, action: str) -> str:
    return reverse("admin:node-action", args=[node, action])


def placement(namespace: str, vm: str) -> set[tuple[str, str]]:
    return set(models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm).values_list("phase", "node"))


def last_message(response: Any) -> tuple[str, str]:
    stored = list(get_messages(response.wsgi_request))
    assert stored, "no message"
    return stored[-1].level_tag, stored[-1].message


def test_drain_preview_lists_the_sets_and_where_they_would_go(admin_client: Client, placed: models.PassRun) -> None:
    response = admin_client.get(action_url("n1", "drain"))
    assert response.status_code == 200
    shown = response.context["preview"]
    targets = {s.key: (s.after_phase.value, s.after_nodes) for s in shown.on_node}
    assert targets == {"team-nlp/rag-serve": ("Lost", ()), "team-vision/infer": ("Bound", ("n2",))}
    assert shown.elsewhere == ()
    assert [s.key for s in shown.lost] == ["team-nlp/rag-serve"]
    html = response.content.decode()
    assert 'data-set="team-vision/infer" data-target="n2"' in html
    assert 'data-set="team-nlp/rag-serve" data-target="Lost"' in html
    assert "1 set would go Lost" in html
    assert f'href="{reverse("admin:node-detail", args=["n2"])}"' in html
    # a GET writes nothing
    assert not models.Node.objects.get(name="n1").draining
    assert models.PassRun.objects.count() == 1


def test_the_preview_matches_what_the_next_pass_does(admin_client: Client, placed: models.PassRun) -> None:
    shown = node_preview("n1", NodeAction.DRAIN)
    response = admin_client.post(action_url("n1", "drain"), follow=True)
    assert response.redirect_chain == [(reverse("admin:node-detail", args=["n1"]), 302)]
    assert models.Node.objects.get(name="n1").draining
    run = models.PassRun.objects.order_by("-pk").first()
    assert run is not None and run.triggered_by == "staff:admin" and (run.moved, run.lost) == (1, 1)
    for s in (*shown.on_node, *shown.elsewhere):
        expected = {(s.after_phase.value, node) for node in s.after_nodes} or {(s.after_phase.value, "")}
        assert placement(s.namespace, s.vm) == expected, s.key
    level, text = last_message(response)
    assert level == "warning"  # a set it held went Lost
    assert text.startswith("Drain n1: label gpuplane.io/drain=true")
    assert "team-nlp/rag-serve Lost" in text and "team-vision/infer Bound on n2" in text


def test_preview_is_the_pass_on_a_copy() -> None:
    """Pure: the engine's preview of every action agrees with full_pass on the changed cluster."""
    node = e.Node("n1", {H100: 2})
    cluster = e.Cluster(
        now=timezone.now(),
        classes=(e.GpuClass("h100", H100),),
        nodes=(node, e.Node("n2", {H100: 2})),
        devices=(e.Device("t", "g0", "h100", "vm", phase=e.Phase.BOUND, node="n1"),),
        budgets=(),
        vmis=(),
        pods=(),
        settings=e.Settings(),
    )
    drained = preview(cluster, "n1", NodeAction.DRAIN)
    assert [(s.key, s.target) for s in drained.on_node] == [("t/vm", "n2")]
    cordoned = preview(cluster, "n1", NodeAction.CORDON)
    assert [(s.key, s.target) for s in cordoned.on_node] == [("t/vm", "stays on n1")]
    assert preview(cluster, "n1", NodeAction.UNCORDON).already
    assert cluster.nodes[0] is node  # the copy, not the cluster, was changed


def test_cordon_uncordon_drain_undrain_write_the_mirror(admin_client: Client, placed: models.PassRun) -> None:
    steps = [
        ("cordon", lambda n: n.unschedulable),
        ("uncordon", lambda n: not n.unschedulable),
        ("drain", lambda n: n.draining and n.labels["gpuplane.io/drain"] == "true"),
        ("undrain", lambda n: not n.draining and "gpuplane.io/drain" not in n.labels),
    ]
    for action, holds in steps:
        before = models.PassRun.objects.count()
        response = admin_client.post(action_url("n3", action))
        assert response.status_code == 302, action
        node = models.Node.objects.get(name="n3")
        assert holds(node), action
        assert models.PassRun.objects.count() == before + 1, action
        assert models.PassRun.objects.order_by("-pk").first().triggered_by == "staff:admin"  # type: ignore[union-attr]
    # the node page offers the action that applies now
    html = admin_client.get(reverse("admin:node-detail", args=["n3"])).content.decode()
    assert f'href="{action_url("n3", "cordon")}"' in html and f'href="{action_url("n3", "drain")}"' in html
    admin_client.post(action_url("n3", "cordon"))
    html = admin_client.get(reverse("admin:node-detail", args=["n3"])).content.decode()
    assert f'href="{action_url("n3", "uncordon")}"' in html


def test_bad_actions_and_nodes(admin_client: Client, placed: models.PassRun) -> None:
    assert admin_client.get(action_url("n1", "explode")).status_code == 400
    assert admin_client.post(action_url("n1", "explode")).status_code == 400
    assert admin_client.get(action_url("no-such-node", "drain")).status_code == 404
    response = admin_client.post(action_url("no-such-node", "drain"), follow=True)
    assert last_message(response) == ("error", "no node no-such-node in the mirror; nothing was changed")
    assert models.PassRun.objects.count() == 1


def test_node_actions_need_change_node(client: Client, placed: models.PassRun) -> None:
    user = get_user_model().objects.create_user("viewer", password="pw-123456789", is_staff=True)
    for codename in ("view_node", "view_gpudevice", "view_pod"):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.login(username="viewer", password="pw-123456789")
    assert client.get(reverse("admin:node-detail", args=["n1"])).status_code == 200
    assert client.get(action_url("n1", "drain")).status_code == 403
    assert client.post(action_url("n1", "drain")).status_code == 403
    assert not models.Node.objects.get(name="n1").draining


# -- cluster mode -------------------------------------------------------------------------------


def test_in_cluster_mode_the_action_writes_the_api_server(
    admin_client: Client, apiserver: ControlPlane, settings: Any
) -> None:
    apiserver.seed(*staff_objects())
    sync.sync_once()
    run_pass()
    assert placement("team-nlp", "rag-serve") == {("Bound", "n1")}
    shown = node_preview("n1", NodeAction.DRAIN)
    response = admin_client.post(action_url("n1", "drain"), follow=True)
    level, text = last_message(response)
    assert "written to the API server" in text, text
    node = apiserver.request("GET", "/api/v1/nodes/n1")
    assert node["metadata"]["labels"]["gpuplane.io/drain"] == "true"
    assert any(
        c.rbac == ("", "nodes", "patch") and c.name == "n1" and c.code == 200 for c in apiserver.calls(UNION_USER)
    )
    assert models.Node.objects.get(name="n1").draining  # mirrored at once, not at the watch event
    for s in shown.on_node:  # the API server keeps no VMI status on create: n2 has no room here
        assert placement(s.namespace, s.vm) == {(s.after_phase.value, n) for n in s.after_nodes or ("",)}, s.key
    assert models.PassRun.objects.order_by("-pk").first().triggered_by == "staff:admin"  # type: ignore[union-attr]

    admin_client.post(action_url("n1", "undrain"))
    node = apiserver.request("GET", "/api/v1/nodes/n1")
    assert "gpuplane.io/drain" not in node["metadata"]["labels"]
    admin_client.post(action_url("n1", "cordon"))
    assert apiserver.request("GET", "/api/v1/nodes/n1")["spec"]["unschedulable"] is True
    admin_client.post(action_url("n1", "uncordon"))
    assert not apiserver.request("GET", "/api/v1/nodes/n1")["spec"].get("unschedulable")


def test_in_cluster_mode_a_conflict_writes_nothing(
    admin_client: Client, apiserver: ControlPlane, settings: Any
) -> None:
    apiserver.seed(*staff_objects())
    sync.sync_once()
    passes = models.PassRun.objects.count()
    apiserver.faults.decide = lambda verb, kind, ns, name: 409 if kind.plural == "nodes" else None
    response = admin_client.post(action_url("n1", "cordon"), follow=True)
    level, text = last_message(response)
    assert level == "error" and "409 Conflict" in text and "nothing was changed" in text
    assert not apiserver.request("GET", "/api/v1/nodes/n1")["spec"].get("unschedulable")
    assert not models.Node.objects.get(name="n1").unschedulable
    assert models.PassRun.objects.count() == passes


# -- retries report the truth -----------------------------------------------------------------


def test_a_retry_that_leaves_the_set_lost_is_a_warning(admin_client: Client, placed: models.PassRun) -> None:
    admin_client.post(action_url("n1", "drain"))
    assert placement("team-nlp", "rag-serve") == {("Lost", "")}
    lost_sets = reverse("admin:binder_lostset_changelist")
    response = admin_client.post(lost_sets, {"retry": "team-nlp/rag-serve"}, follow=True)
    level, text = last_message(response)
    assert level == "warning" and "team-nlp/rag-serve is still Lost" in text
    html = response.content.decode()
    assert 'class="warning"' in html
    # room again: the retry binds it, and only then is it a success
    admin_client.post(action_url("n1", "undrain"))  # the pass of the undrain already rebinds it
    models.GpuDevice.objects.filter(vm_name="rag-serve").update(phase="Lost", node="")
    response = admin_client.post(lost_sets, {"retry": "team-nlp/rag-serve"}, follow=True)
    level, text = last_message(response)
    assert level == "success" and "team-nlp/rag-serve is now Bound on n1" in text, text


def test_preview_of_the_cluster_matches_read_cluster(placed: models.PassRun) -> None:
    cluster, _ = read_cluster(timezone.now())
    assert node_preview("n2", NodeAction.CORDON).on_node == preview(cluster, "n2", NodeAction.CORDON).on_node

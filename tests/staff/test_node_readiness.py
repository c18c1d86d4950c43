"""Standalone mode: staff mark a node Ready or NotReady from its page (the database is the
cluster, so staff stand in for the kubelet), previewed like the other node actions, and the
message says what the pass did, also to sets that were not on the node. In cluster mode the
kubelet owns Ready: neither offered nor written."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from binder import models
from binder.engine.preview import NodeAction, preview
from binder.mirror.read import read_cluster

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_passwords")]


def messages_of(response: Any) -> list[str]:
    return [m.message for m in get_messages(response.wsgi_request)]


def test_mark_not_ready_then_ready_writes_the_mirror_and_says_what_the_pass_did(
    admin_client: Client, placed: models.PassRun
) -> None:
    node = models.Node.objects.filter(ready=True).order_by("name").first()
    assert node is not None
    page = reverse("admin:node-detail", args=[node.name])
    assert (
        f'href="{reverse("admin:node-action", args=[node.name, "not-ready"])}"'
        in admin_client.get(page).content.decode()
    )
    response = admin_client.post(reverse("admin:node-action", args=[node.name, "not-ready"]), follow=True)
    node.refresh_from_db()
    assert not node.ready and node.ready_since is not None
    assert any(
        m.startswith(f"Mark NotReady {node.name}: mark NotReady") and "Full pass #" in m for m in messages_of(response)
    )
    html = response.content.decode()
    assert f'href="{reverse("admin:node-action", args=[node.name, "ready"])}"' in html
    admin_client.post(reverse("admin:node-action", args=[node.name, "ready"]))
    node.refresh_from_db()
    assert node.ready


def said(namespace: str, vm: str) -> str:
    """How the message names a set now: "ns/vm Bound on n1", "ns/vm Lost"."""
    rows = set(models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm).values_list("phase", "node"))
    phase = (
        "Bound" if any(p == "Bound" for p, _ in rows) else "Lost" if any(p == "Lost" for p, _ in rows) else "Pending"
    )
    nodes = sorted({n for _, n in rows if n})
    return f"{namespace}/{vm} {phase}" + (f" on {', '.join(nodes)}" if nodes else "")


def test_the_message_names_every_set_the_pass_changed(
    admin_client: Client, placed: models.PassRun, settings: Any
) -> None:
    """NotReady past the grace period sends a node's sets away; Ready again brings a Lost
    set back, though it was on no node: the message names both, as they are after the pass."""
    settings.GPUPLANE_NODE_GRACE_SECONDS = 0
    held = sorted(
        set(models.GpuDevice.objects.filter(node="n2", phase="Bound").values_list("namespace__name", "vm_name"))
    )
    assert held, "the staff cluster has sets on n2"
    response = admin_client.post(reverse("admin:node-action", args=["n2", "not-ready"]), follow=True)
    (message,) = [m for m in messages_of(response) if m.startswith("Mark NotReady n2")]
    for key in held:
        assert said(*key) in message
    lost = sorted(set(models.GpuDevice.objects.filter(phase="Lost").values_list("namespace__name", "vm_name")))
    assert lost, "n2's sets had nowhere else to go"
    response = admin_client.post(reverse("admin:node-action", args=["n2", "ready"]), follow=True)
    (message,) = [m for m in messages_of(response) if m.startswith("Mark Ready n2")]
    for key in lost:
        assert said(*key).endswith("on n2") and said(*key) in message


def test_the_preview_of_ready_is_the_next_pass_with_the_node_ready(placed: models.PassRun, settings: Any) -> None:
    settings.GPUPLANE_NODE_GRACE_SECONDS = 0
    models.Node.objects.filter(name="n2").update(ready=False)
    cluster = read_cluster(timezone.now())[0]
    shown = preview(cluster, "n2", NodeAction.READY)
    assert not shown.already
    assert preview(cluster, "n2", NodeAction.NOT_READY).already
    assert all(s.after_nodes == ("n2",) for s in shown.on_node)


def test_cluster_mode_offers_no_readiness_and_refuses_it(
    admin_client: Client, placed: models.PassRun, settings: Any
) -> None:
    settings.GPUPLANE_CLUSTER = "kubernetes"
    node = models.Node.objects.order_by("name").first()
    assert node is not None
    html = admin_client.get(reverse("admin:node-detail", args=[node.name])).content.decode()
    assert 'data-action="ready"' not in html and 'data-action="not-ready"' not in html
    response = admin_client.post(reverse("admin:node-action", args=[node.name, "not-ready"]), follow=True)
    assert any("the kubelet reports whether" in m for m in messages_of(response))
    node.refresh_from_db()
    assert node.ready

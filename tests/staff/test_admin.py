"""The staff admin: every page of the binder app on a loaded, passed cluster, the
Lost sets view and its retry, the device's decision history, and who may get in at all."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from binder import models
from binder.mirror.snapshot import load_file
from binder.runtime.passes import run_pass
from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    vmi_obj,
    write_snapshot,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

CHANGELISTS = (
    "namespace",
    "node",
    "gpuclass",
    "gpudevice",
    "gpubudget",
    "virtualmachineinstance",
    "virtualmachine",
    "pod",
    "passrun",
    "decision",
    "lostset",
)
LOST_SETS = "admin:binder_lostset_changelist"


@pytest.fixture
def cluster(tmp_path: Path) -> dict[str, Any]:
    """A placed cluster with a Lost set whose VMI still runs (its node was deleted), a Lost
    set without a VMI, a Bound set with its launcher, a raw pod and an order over budget."""
    uid_lost, uid_ok = "5d7f1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b", "6e8a2b3c-4d5e-4f6a-9b0c-1d2e3f4a5b6c"
    vmi_lost = vmi_obj("team-a", "vm-lost", ["l0", "l1"], {uid_lost: "gone-node"}, "gone-node")
    vmi_ok = vmi_obj("team-b", "vm-ok", ["k0"], {uid_ok: "n1"}, "n1")
    objects = [
        namespace_obj("team-a"),
        namespace_obj("team-b"),
        node_obj("n1", {A10: 2}),
        node_obj("n2", {H100: 1}, unschedulable=True),
        class_obj("a10", A10),
        class_obj("h100", H100),
        gpu_obj("team-a", "l0", "a10", "vm-lost", phase="Bound", node="gone-node", since="2026-11-29T10:00:00Z"),
        gpu_obj("team-a", "l1", "a10", "vm-lost", phase="Bound", node="gone-node", since="2026-11-29T10:00:00Z"),
        gpu_obj("team-a", "s0", "h100", "vm-stopped", phase="Lost", since="2026-11-28T10:00:00Z"),
        gpu_obj("team-b", "k0", "a10", "vm-ok", created="2026-11-01T00:00:00Z"),
        gpu_obj("team-b", "over0", "h100", "vm-over"),
        budget_obj("team-b", {"h100": 0, A10: 2}),
        vmi_lost,
        vmi_ok,
        launcher_obj(vmi_lost, A10, 2, "gone-node", uid=uid_lost, name="virt-launcher-vm-lost-q8x2z"),
        launcher_obj(vmi_ok, A10, 1, "n1", uid=uid_ok, name="virt-launcher-vm-ok-m3n4p"),
        plain_pod_obj("team-b", "trainer-0", A10, 1, "n1"),
    ]
    load_file(write_snapshot(tmp_path / "cluster.yaml", objects))
    run = run_pass()
    assert (run.lost, run.bound) == (1, 1), run.__dict__
    return {"run": run}


def test_every_binder_changelist_opens(admin_client: Client, cluster: dict[str, Any]) -> None:
    for name in CHANGELISTS:
        response = admin_client.get(reverse(f"admin:binder_{name}_changelist"))
        assert response.status_code == 200, name
    index = admin_client.get(reverse("admin:index"))
    assert index.status_code == 200
    for name in CHANGELISTS:
        assert reverse(f"admin:binder_{name}_changelist") in index.content.decode(), name


def test_changelists_show_placement_and_booking(admin_client: Client, cluster: dict[str, Any]) -> None:
    nodes = admin_client.get(reverse("admin:binder_node_changelist")).content.decode()
    # n1: k0 (1) + trainer-0 (1) booked of 2; vm-ok's launcher holds only k0's unit
    assert f"{A10} 2/2 (0)" in nodes
    lost = admin_client.get(reverse("admin:binder_gpudevice_changelist") + "?phase__exact=Lost")
    assert sorted(d.name for d in lost.context["cl"].result_list) == ["l0", "l1", "s0"]
    budgets = admin_client.get(reverse("admin:binder_gpubudget_changelist")).content.decode()
    assert f"{A10}: 2/2" in budgets and "h100: 0/0" in budgets
    passes = admin_client.get(reverse("admin:binder_passrun_changelist")).content.decode()
    assert str(cluster["run"].pk) in passes


def test_change_pages_open(admin_client: Client, cluster: dict[str, Any]) -> None:
    pages = [
        ("namespace", models.Namespace.objects.get(name="team-a")),
        ("node", models.Node.objects.get(name="n1")),
        ("gpuclass", models.GpuClass.objects.get(name="a10")),
        ("gpudevice", models.GpuDevice.objects.get(name="k0")),
        ("gpubudget", models.GpuBudget.objects.get()),
        ("virtualmachineinstance", models.VirtualMachineInstance.objects.get(name="vm-ok")),
        ("pod", models.Pod.objects.get(name="trainer-0")),
        ("passrun", cluster["run"]),
        ("decision", models.Decision.objects.first()),
    ]
    for name, obj in pages:
        response = admin_client.get(reverse(f"admin:binder_{name}_change", args=[obj.pk]))
        assert response.status_code == 200, name


def test_lost_sets_page_lists_each_set(admin_client: Client, cluster: dict[str, Any]) -> None:
    response = admin_client.get(reverse(LOST_SETS))
    assert response.status_code == 200
    rows = {(r["namespace"], r["vm"]): r for r in response.context["rows"]}
    assert set(rows) == {("team-a", "vm-lost"), ("team-a", "vm-stopped")}

    lost = rows[("team-a", "vm-lost")]
    assert [d.name for d in lost["devices"]] == ["l0", "l1"]
    assert lost["reason"] == models.GpuDevice.objects.get(name="l0").reason
    assert lost["reason"].startswith("lost: node gone-node was deleted")
    assert lost["vmi_running"] is True and lost["vmi_node"] == "gone-node"
    stopped = rows[("team-a", "vm-stopped")]
    assert stopped["vmi_running"] is False

    html = response.content.decode()
    row = html[html.index('data-set="team-a/vm-lost"') :]
    row = re.sub(r"<[^>]+>", "", row[: row.index("</tr>")])  # the text, links aside
    for text in (
        "team-a",
        "vm-lost",
        "2 devices",
        "l0, l1",
        "lost: node gone-node was deleted",
        "running on gone-node",
    ):
        assert text in row, text
    other = html[html.index('data-set="team-a/vm-stopped"') :]
    assert "not running" in other[: other.index("</tr>")]
    assert 'name="retry" value="team-a/vm-lost"' in html


def test_lost_sets_page_when_nothing_is_lost(admin_client: Client) -> None:
    response = admin_client.get(reverse(LOST_SETS))
    assert response.status_code == 200
    assert "No Lost sets." in response.content.decode()


def test_retry_queues_a_full_pass(
    admin_client: Client, cluster: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    passes = models.PassRun.objects.count()
    # make room for the lost set: the retry's pass rebinds it
    models.Node.objects.filter(name="n2").update(allocatable={A10: 2}, unschedulable=False)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = admin_client.post(reverse(LOST_SETS), {"retry": "team-a/vm-lost"}, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain == [(reverse(LOST_SETS), 302)]  # a reload does not queue again
    assert len(callbacks) == 1
    assert models.PassRun.objects.count() == passes + 1
    new = models.PassRun.objects.order_by("-pk").first()
    assert new is not None and new.kind == models.PassKind.FULL and new.bound == 1
    assert "Queued a full pass to retry team-a/vm-lost" in response.content.decode()
    lost = models.GpuDevice.objects.get(name="l0")
    assert (lost.phase, lost.node) == ("Bound", "n2")
    after = admin_client.get(reverse(LOST_SETS))
    assert [(r["namespace"], r["vm"]) for r in after.context["rows"]] == [("team-a", "vm-stopped")]


def test_run_full_pass_action(
    admin_client: Client, cluster: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    passes = models.PassRun.objects.count()
    node = models.Node.objects.get(name="n1")
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(
            reverse("admin:binder_node_changelist"),
            {"action": "run_full_pass", "_selected_action": [node.pk]},
            follow=True,
        )
    assert response.status_code == 200
    assert "Queued a full pass" in response.content.decode()
    assert models.PassRun.objects.count() == passes + 1


def test_device_change_page_shows_decision_history(admin_client: Client, cluster: dict[str, Any]) -> None:
    device = models.GpuDevice.objects.get(namespace__name="team-a", name="l0")
    decision = models.Decision.objects.get(namespace="team-a", device_name="l0")
    assert (decision.from_phase, decision.from_node, decision.to_phase) == ("Bound", "gone-node", "Lost")
    response = admin_client.get(reverse("admin:binder_gpudevice_change", args=[device.pk]))
    assert response.status_code == 200
    html = response.content.decode()
    assert "why is this gpu here?" in html.lower()
    assert f"<td>{cluster['run'].pk}</td>" in html
    assert "Bound gone-node" in html
    assert decision.reason in html

    never_moved = models.GpuDevice.objects.get(name="over0")
    html = admin_client.get(reverse("admin:binder_gpudevice_change", args=[never_moved.pk])).content.decode()
    assert "no placement changes recorded" in html


def test_placement_fields_are_read_only(admin_client: Client, cluster: dict[str, Any]) -> None:
    device = models.GpuDevice.objects.get(name="k0")
    url = reverse("admin:binder_gpudevice_change", args=[device.pk])
    form = admin_client.get(url).context["adminform"].form
    assert not {"phase", "node", "since", "reason", "bind_request", "answered_request", "answer"} & set(form.fields)
    data = {
        "namespace": device.namespace_id,
        "name": "k0",
        "class_name": "a10",
        "vm_name": "vm-ok",
        "created_0": "2026-11-01",
        "created_1": "00:00:00",
        # a hand-made request that tries to move the device anyway
        "phase": "Lost",
        "node": "elsewhere",
        "bind_request": "forged",
    }
    response = admin_client.post(url, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    device.refresh_from_db()
    assert (device.phase, device.node, device.bind_request) == ("Bound", "n1", "")


def test_anonymous_is_sent_to_login(client: Client, cluster: dict[str, Any]) -> None:
    for url in (reverse("admin:index"), reverse(LOST_SETS), reverse("admin:binder_gpudevice_changelist")):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("admin:login"))
    passes = models.PassRun.objects.count()
    response = client.post(reverse(LOST_SETS), {"retry": "team-a/vm-lost"})
    assert response.status_code == 302
    assert models.PassRun.objects.count() == passes


def test_non_staff_user_cannot_open_the_admin(client: Client, cluster: dict[str, Any]) -> None:
    get_user_model().objects.create_user(username="tenant", password="tenant-pass-1234")
    assert client.login(username="tenant", password="tenant-pass-1234")
    for url in (reverse("admin:index"), reverse(LOST_SETS), reverse("admin:binder_node_changelist")):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("admin:login"))


def test_staff_without_permission_cannot_see_or_retry_lost_sets(
    client: Client, cluster: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    user = get_user_model().objects.create_user(username="helpdesk", password="helpdesk-pass-1234", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_node"))
    assert client.login(username="helpdesk", password="helpdesk-pass-1234")
    assert client.get(reverse("admin:binder_node_changelist")).status_code == 200
    assert client.get(reverse("admin:binder_gpudevice_changelist")).status_code == 403
    assert client.get(reverse(LOST_SETS)).status_code == 403
    passes = models.PassRun.objects.count()
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse(LOST_SETS), {"retry": "team-a/vm-lost"})
    assert response.status_code == 403
    assert models.PassRun.objects.count() == passes

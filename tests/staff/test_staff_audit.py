"""The audit trail: passes, decisions, bind answers and sync status can be
read but not added, edited or deleted in the admin; mirrored objects are read-only in
cluster mode; and every pass records what triggered it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from binder import models
from binder.queue import queue_full_pass
from binder.tasks import answer_pass_task, resync_task
from harness.staff_cluster import load_staff_cluster

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]


@pytest.fixture
def placed(tmp_path: Path) -> models.PassRun:
    run = load_staff_cluster(tmp_path)
    models.SyncStatus.objects.create(kind="GPU", resource_version="42")
    models.BindAnswer.objects.create(
        pass_run=run,
        namespace="team-vision",
        device_name="seg-train-gpu0",
        request="req-1",
        allowed=True,
        answer="bound:n1",
        answered_at=timezone.now(),
    )
    return run


def audit_rows(run: models.PassRun) -> dict[str, Any]:
    return {
        "passrun": run,
        "decision": models.Decision.objects.filter(pass_run=run).first(),
        "bindanswer": models.BindAnswer.objects.get(),
        "syncstatus": models.SyncStatus.objects.get(),
    }


def test_audit_records_cannot_be_added_changed_or_deleted(admin_client: Client, placed: models.PassRun) -> None:
    for name, obj in audit_rows(placed).items():
        assert obj is not None, name
        change = reverse(f"admin:binder_{name}_change", args=[obj.pk])
        page = admin_client.get(change)
        assert page.status_code == 200, name  # readable
        html = page.content.decode()
        assert 'name="_save"' not in html and "deletelink" not in html, name
        assert admin_client.get(reverse(f"admin:binder_{name}_add")).status_code == 403, name
        assert admin_client.post(reverse(f"admin:binder_{name}_add"), {}).status_code == 403, name
        assert admin_client.post(change, {"reason": "forged", "kind": "answer"}).status_code == 403, name
        delete = reverse(f"admin:binder_{name}_delete", args=[obj.pk])
        assert admin_client.get(delete).status_code == 403, name
        assert admin_client.post(delete, {"post": "yes"}).status_code == 403, name
        # no bulk delete either: the action is not offered, and posting it deletes nothing
        changelist = reverse(f"admin:binder_{name}_changelist")
        assert "delete_selected" not in admin_client.get(changelist).content.decode(), name
        admin_client.post(changelist, {"action": "delete_selected", "_selected_action": [obj.pk], "post": "yes"})
        assert type(obj).objects.filter(pk=obj.pk).exists(), name


def test_pass_page_decisions_are_read_only(admin_client: Client, placed: models.PassRun) -> None:
    assert models.Decision.objects.filter(pass_run=placed).count() == 8
    html = admin_client.get(reverse("admin:binder_passrun_change", args=[placed.pk])).content.decode()
    # no empty form to add from (the inline script offers "Add another" only from one) and a
    # formset that accepts no forms beyond the pass's own
    assert 'id="decisions-empty"' not in html and "empty-form" not in html
    assert 'name="decisions-MAX_NUM_FORMS" value="0"' in html
    assert "-DELETE" not in html
    assert "decisions-0-reason" not in html  # no form fields, only text
    assert "seg-train-gpu0" in html


def test_mirror_objects_are_read_only_in_cluster_mode(
    admin_client: Client, placed: models.PassRun, settings: Any
) -> None:
    device = models.GpuDevice.objects.get(name="seg-train-gpu0")
    node = models.Node.objects.get(name="n1")
    pages = {"gpudevice": device, "node": node, "namespace": device.namespace, "pod": models.Pod.objects.first()}
    # standalone: the database is the source of truth, staff edit it here
    for name, obj in pages.items():
        html = admin_client.get(reverse(f"admin:binder_{name}_change", args=[obj.pk])).content.decode()
        assert 'name="_save"' in html, name
    settings.GPUPLANE_CLUSTER = "kubernetes"
    for name, obj in pages.items():
        change = reverse(f"admin:binder_{name}_change", args=[obj.pk])
        html = admin_client.get(change).content.decode()
        assert 'name="_save"' not in html and "deletelink" not in html, name
        assert admin_client.post(change, {"name": "renamed"}).status_code == 403, name
        delete = reverse(f"admin:binder_{name}_delete", args=[obj.pk])
        assert admin_client.post(delete, {"post": "yes"}).status_code == 403, name
        assert admin_client.get(reverse(f"admin:binder_{name}_add")).status_code == 403, name
    assert models.GpuDevice.objects.filter(pk=device.pk, name="seg-train-gpu0").exists()
    assert models.Node.objects.filter(pk=node.pk, name="n1").exists()


# -- triggered_by --------------------------------------------------------------------------------


def last_pass() -> models.PassRun:
    run = models.PassRun.objects.order_by("-pk").first()
    assert run is not None
    return run


def test_the_run_pass_command_and_direct_calls(placed: models.PassRun) -> None:
    assert placed.triggered_by == "direct"
    call_command("run_pass", verbosity=0)
    assert last_pass().triggered_by == "command"


@pytest.mark.django_db(transaction=True)
def test_staff_actions_name_the_user(admin_client: Client, tmp_path: Path) -> None:
    load_staff_cluster(tmp_path)
    posts = [
        (reverse("admin:run-pass"), {}),
        (reverse("admin:binder_lostset_changelist"), {"retry": "team-nlp/rag-serve"}),
        (reverse("admin:binder_passrun_changelist"), {"action": "run_full_pass", "_selected_action": [1]}),
    ]
    for url, data in posts:
        before = last_pass().pk
        admin_client.post(url, data)
        assert last_pass().pk > before, url
        assert last_pass().triggered_by == "staff:admin", url


def test_resync(placed: models.PassRun) -> None:
    resync_task.apply()
    assert last_pass().triggered_by == "resync"


def test_mirror_events(placed: models.PassRun, settings: Any, django_capture_on_commit_callbacks: Any) -> None:
    settings.GPUPLANE_AUTO_PASS = True
    with django_capture_on_commit_callbacks(execute=True):
        node = models.Node.objects.get(name="n2")
        node.labels = {**node.labels, "pool": "b"}
        node.save()
    assert last_pass().triggered_by == "event"


def test_answers(placed: models.PassRun, django_capture_on_commit_callbacks: Any) -> None:
    # an answer pass that binds asks for a full pass: "answer"
    models.GpuBudget.objects.filter(namespace__name="team-nlp").update(limits={"h100": 8})
    models.GpuDevice.objects.filter(name="big-order-gpu0").update(bind_request="req-7")
    before = last_pass().pk
    with django_capture_on_commit_callbacks(execute=True):
        answer_pass_task.apply()
    runs = list(models.PassRun.objects.filter(pk__gt=before).order_by("pk").values_list("kind", "triggered_by"))
    assert runs == [("answer", "webhook"), ("full", "answer")]


@pytest.mark.django_db(transaction=True)
def test_requests_collapsed_into_one_pass_keep_the_first_trigger(tmp_path: Path) -> None:
    load_staff_cluster(tmp_path)
    with transaction.atomic():
        queue_full_pass(triggered_by="staff:alice")
        queue_full_pass()  # an event in the same transaction: collapsed, adds nothing
        queue_full_pass(triggered_by="staff:bob")
    runs = list(models.PassRun.objects.order_by("pk").values_list("triggered_by", flat=True))
    assert runs == ["direct", "staff:alice"]

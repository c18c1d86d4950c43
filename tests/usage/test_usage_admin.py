"""The usage records admin: staff filter by tenant and date and export CSV; nobody edits."""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest
from django.test import Client

from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from harness.accounts import account
from harness.clock import Clock
from harness.factories import A100, second_choice
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db


def staff_client() -> Client:
    user = account("root", staff=True)
    user.is_superuser = True
    user.save()
    c = Client()
    c.force_login(user)
    return c


def test_records_list_filters_and_csv_export_of_what_is_shown(cluster: Any) -> None:
    c = staff_client()
    page = c.get("/admin/usage/usagerecord/", {"namespace": "t1"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "vm1-gpu0" in html and "trainer" not in html
    assert "export.csv?namespace=t1" in html
    answer = c.get("/admin/usage/usagerecord/export.csv", {"namespace": "t1", "phase__exact": "Bound"})
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(answer.streaming_content).decode())))
    expected = UsageRecord.objects.filter(namespace="t1", phase="Bound").count()
    assert len(rows) == expected > 0
    assert {r["namespace"] for r in rows} == {"t1"} and {r["phase"] for r in rows} == {"Bound"}
    assert c.get("/admin/usage/usagerecord/", {"start__year": "2026"}).status_code == 200  # date drill-down


def test_records_cannot_be_added_changed_or_deleted_in_the_admin(cluster: Any) -> None:
    c = staff_client()
    record = UsageRecord.objects.filter(end__isnull=False).first()
    assert record is not None
    assert c.get("/admin/usage/usagerecord/add/").status_code == 403
    assert c.post(f"/admin/usage/usagerecord/{record.pk}/delete/", {"post": "yes"}).status_code == 403
    page = c.get(f"/admin/usage/usagerecord/{record.pk}/change/")
    assert page.status_code == 200 and 'name="_save"' not in page.content.decode()  # view only
    assert c.post(f"/admin/usage/usagerecord/{record.pk}/change/", {"units": "99"}).status_code == 403
    assert UsageRecord.objects.filter(pk=record.pk).exists()


def test_tenants_do_not_open_the_records_admin(cluster: Any) -> None:
    tenant = Client()
    tenant.force_login(account("alice", "t1"))
    assert tenant.get("/admin/usage/usagerecord/").status_code == 302
    assert tenant.get("/admin/usage/usagerecord/export.csv").status_code == 302


def test_a_device_held_as_its_second_choice_is_listed_and_exported_under_that_class(clock: Clock) -> None:
    """The set orders h100 or a100 and is held as a100: its records' key is a100 (the class
    budgets and bills count), with a100's resource, and none is filed under h100."""
    load_objects(second_choice())
    run_pass("full")
    clock.advance(hours=2)
    c = staff_client()
    page = c.get("/admin/usage/usagerecord/", {"key": "a100"})
    assert page.status_code == 200 and "vm1-gpu0" in page.content.decode()
    answer = c.get("/admin/usage/usagerecord/export.csv", {"key": "a100"})
    assert answer.status_code == 200
    rows = list(csv.DictReader(io.StringIO(b"".join(answer.streaming_content).decode())))
    assert sorted((r["subject"], r["key"], r["resourceName"], r["units"], r["node"]) for r in rows) == [
        ("vm1-gpu0", "a100", A100, "1", "na"),
        ("vm1-gpu1", "a100", A100, "1", "na"),
    ]
    assert [float(r["gpuHours"]) for r in rows] == [2.0, 2.0]
    everything = c.get("/admin/usage/usagerecord/export.csv")
    keys = {r["key"] for r in csv.DictReader(io.StringIO(b"".join(everything.streaming_content).decode()))}
    assert keys == {"a100"}

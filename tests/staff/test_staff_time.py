"""One time format on the staff pages: ISO 8601 with seconds and the zone,
ages, rounded durations, counts that say what they count, a pass button on the pass list
that needs no ticked rows, and no "View site" link to a 404."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from binder import models
from binder.reports.formatting import age, duration_ms, duration_s, iso
from binder.runtime.passes import run_pass
from harness.clock import Clock
from harness.shapes import NOW
from harness.staff_cluster import load_staff_cluster

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

LONG_FLOAT = re.compile(r"\d+\.\d{4,}")
MINUTE_ONLY = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d(?!:)")


def test_the_formats() -> None:
    moment = datetime(2026, 11, 30, 12, 0, 5, 123456, tzinfo=UTC)
    assert iso(moment) == "2026-11-30T12:00:05+0000"
    assert iso(None) == ""
    assert age(moment - timedelta(seconds=42), moment) == "42 s"
    assert age(moment - timedelta(minutes=7, seconds=59), moment) == "7 min"
    assert age(moment - timedelta(hours=3, minutes=5), moment) == "3 h 5 min"
    assert age(moment - timedelta(hours=5), moment) == "5 h"
    assert age(moment - timedelta(days=2, hours=4), moment) == "2 d 4 h"
    assert age(moment + timedelta(minutes=1), moment) == "0 s"  # a clock a little ahead
    assert duration_ms(13.531410000041433) == "13.5 ms"
    assert duration_ms(0.4242) == "0.42 ms"
    assert duration_ms(1234.5) == "1.23 s"
    assert duration_ms(125_000) == "2 min 5 s"
    assert duration_ms(None) == ""
    assert duration_s(0.0123) == "12.3 ms"


@pytest.fixture
def placed(tmp_path: Path, clock: Clock) -> models.PassRun:
    run = load_staff_cluster(tmp_path)
    models.PassRun.objects.filter(pk=run.pk).update(duration_ms=13.531410000041433)
    models.Node.objects.filter(name="n1").update(ready=False, ready_since=NOW)
    clock.advance(minutes=10)  # past the grace period (300 s)
    lost = run_pass()
    assert lost.lost == 1, lost.__dict__  # rag-serve: n2 has 2 free, it needs 4
    clock.advance(minutes=7)
    return run


def test_pass_pages_round_durations_and_name_what_they_count(admin_client: Client, placed: models.PassRun) -> None:
    listing = admin_client.get(reverse("admin:binder_passrun_changelist")).content.decode()
    assert "13.5 ms" in listing and "13.531" not in listing
    for header in ("sets bound", "sets moved", "sets lost", "orders refused", "triggered by"):
        assert header in listing.lower(), header
    assert iso(placed.started) in listing
    detail = admin_client.get(reverse("admin:binder_passrun_change", args=[placed.pk])).content.decode()
    assert "13.5 ms" in detail and "13.531" not in detail
    assert iso(placed.started) in detail
    assert not MINUTE_ONLY.search(detail)


def test_times_carry_seconds_and_zone_and_ages(admin_client: Client, placed: models.PassRun) -> None:
    lost_since = models.GpuDevice.objects.filter(vm_name="rag-serve").values_list("since", flat=True)[0]
    assert lost_since is not None
    lost = admin_client.get(reverse("admin:binder_lostset_changelist")).content.decode()
    assert f"{iso(lost_since)} (Lost 7 min)" in lost
    devices = admin_client.get(reverse("admin:binder_gpudevice_changelist")).content.decode()
    assert f"{iso(lost_since)} (Lost 7 min)" in devices
    nodes = admin_client.get(reverse("admin:binder_node_changelist")).content.decode()
    assert iso(NOW) == "2026-11-30T12:00:00+0000" and iso(NOW) in nodes  # n1's ready_since
    log = admin_client.get(reverse("admin:decisions") + "?namespace=team-nlp&vm=rag-serve").content.decode()
    assert iso(lost_since) in log
    for page in (lost, devices, nodes, log):
        assert not MINUTE_ONLY.search(page)
        assert not LONG_FLOAT.search(re.sub(r"<[^>]*>", " ", page))  # no raw floats in the text


def test_date_inputs_are_iso(admin_client: Client, placed: models.PassRun) -> None:
    device = models.GpuDevice.objects.get(name="notebook-gpu0")
    html = admin_client.get(reverse("admin:binder_gpudevice_change", args=[device.pk])).content.decode()
    assert 'name="created_0" value="2026-11-03"' in html
    assert 'name="created_1" value="00:00:00"' in html


def test_run_a_full_pass_from_the_pass_list_without_ticking_rows(
    admin_client: Client, placed: models.PassRun, django_capture_on_commit_callbacks: Any
) -> None:
    passes = reverse("admin:binder_passrun_changelist")
    html = admin_client.get(passes).content.decode()
    assert f'action="{reverse("admin:run-pass")}"' in html and 'id="passes-run-full-pass"' in html
    before = models.PassRun.objects.count()
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(reverse("admin:run-pass"), {"next": passes}, follow=True)
    assert response.redirect_chain == [(passes, 302)]
    assert models.PassRun.objects.count() == before + 1
    assert "Queued a full pass" in response.content.decode()  # in this test's transaction: at its commit


def test_no_view_site_link(admin_client: Client) -> None:
    html = admin_client.get(reverse("admin:index")).content.decode()
    assert "View site" not in html

"""End to end in a real browser: staff log in to the admin served by the live server on the
demo cluster, read the placement board, find the Lost set and its decisions, free room and
retry it until it is Bound, then open the usage chart and download its CSV.

The browser is Debian's Chromium (``/usr/bin/chromium``, installed by ``.ci/run`` when
missing), driven by Playwright; a browser Playwright would download is never used.
Screenshots of the board and the chart are saved as artifacts (``GPUPLANE_ARTIFACTS``,
else ``var/artifacts``) in a directory per database, and ``.ci/run`` prints where.
The helpers are in harness/browsing.py, the ``browser``, ``page`` and ``demo`` fixtures in
tests/conftest.py.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.urls import reverse
from playwright.sync_api import Page, expect

from binder import models
from harness.browsing import artifacts_dir, login, orm
from usage.models import UsageRecord

LOST_SET = "team-nlp/llm-train-a"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_passwords")]


def test_board_lost_set_decisions_and_retry(demo: None, page: Page, live_server: Any) -> None:
    login(page, live_server, reverse("admin:placement-board"))

    # the board: 11 nodes, one cell per unit, node states marked
    expect(page.locator("#gp-board tr.node")).to_have_count(11)
    expect(page.locator('tr[data-node="hgx-h100-05"] .badge.notready')).to_contain_text("NotReady since")
    expect(page.locator('tr[data-node="hgx-h100-04"] .badge.cordoned')).to_have_text("cordoned")
    expect(page.locator('tr[data-node="hgx-h100-01"] .u')).to_have_count(8)
    expect(page.locator('tr[data-node="hgx-h100-03"] .u')).to_have_count(7)
    expect(page.locator('tr[data-node="hgx-h100-03"] i.u')).to_have_count(2)  # 2 free
    expect(page.locator("#board-legend")).to_contain_text("team-nlp")
    # the forged launcher pod's units are raw usage, drawn as such
    forged = page.locator('tr[data-node="hgx-h100-01"] a.u.p')
    expect(forged).to_have_count(1)
    assert "not a VMI's launcher" in (forged.get_attribute("title") or "")

    # hover shows who holds a unit; a click shows it in the panel with its decision log link
    cell = page.locator('tr[data-node="hgx-h100-02"] a.u[data-set="team-research/protein-fold"]').first
    title = cell.get_attribute("title") or ""
    for text in ("device team-research/protein-fold-gpu", "VM protein-fold", "tenant team-research", "reason: bound"):
        assert text in title, text
    cell.hover()
    cell.click()
    panel = page.locator("#cell-info")
    expect(panel).to_be_visible()
    expect(panel.locator(".what")).to_contain_text("VM protein-fold")
    expect(panel.locator("a.log")).to_have_attribute("href", re.compile(r"namespace=team-research&vm=protein-fold"))
    page.screenshot(path=artifacts_dir() / "placement-board.png", full_page=True)

    # the Lost set, and why: its decision log
    lost = page.locator(f'#gp-lost tr[data-set="{LOST_SET}"]')
    expect(lost).to_contain_text("hgx-h100-05 has been NotReady")
    expect(lost.locator("i.u.lost")).to_have_count(8)
    lost.locator("a.decisions-link").click()
    expect(page.locator("h1")).to_contain_text(f"Decision log of set {LOST_SET}")
    decisions = page.locator("#decision-log tr.decision")
    expect(decisions).to_have_count(1)  # one pass moved the set's 8 devices alike: one row
    expect(decisions.first.locator(".decision-devices")).to_contain_text("8 devices: llm-train-a-gpu")
    expect(decisions.first).to_contain_text("Bound hgx-h100-05")
    expect(decisions.first).to_contain_text("no other node has room")
    expect(page.locator('#set-devices tr[data-phase="Lost"]')).to_have_count(8)

    # free room: the node is Ready again (as the cluster would report), then retry
    orm(lambda: models.Node.objects.filter(name="hgx-h100-05").update(ready=True, ready_since=datetime.now(UTC)))
    page.click("nav.gp-nav >> text=Lost sets")
    row = page.locator(f'#lost-sets tr[data-set="{LOST_SET}"]')
    expect(row).to_contain_text("running on hgx-h100-05")  # its VMI still runs
    row.locator("button[name=retry]").click()
    expect(page.locator("ul.messagelist")).to_contain_text(f"{LOST_SET} is now Bound on hgx-h100-05.")
    expect(page.locator("#lost-sets")).to_have_count(0)

    # the board and the log agree: the set is Bound on hgx-h100-05, nothing is Lost
    page.click("nav.gp-nav >> text=Placement board")
    expect(page.locator(f'tr[data-node="hgx-h100-05"] a.u[data-set="{LOST_SET}"]')).to_have_count(8)
    expect(page.locator('tr[data-node="hgx-h100-05"] .badge:not(.taint)')).to_have_count(0)  # only its taint left
    expect(page.locator("#gp-lost")).to_have_count(0)
    page.goto(f"{live_server.url}{reverse('admin:decisions')}?namespace=team-nlp&vm=llm-train-a")
    expect(page.locator("#decision-log tr.decision")).to_have_count(2)  # Lost, then Bound again
    expect(page.locator("#decision-log tr.decision").first).to_contain_text("Bound hgx-h100-05")
    expect(page.locator('#set-devices tr[data-phase="Bound"]')).to_have_count(8)
    assert orm(lambda: set(models.GpuDevice.objects.filter(vm_name="llm-train-a").values_list("phase", "node"))) == {
        ("Bound", "hgx-h100-05")
    }


@pytest.fixture
def history() -> None:
    """A week of closed usage records (the demo's own start at its first pass), so the
    chart has days to draw: each tenant holds a few units for part of each day."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = []
    for back in range(1, 8):
        day = today - timedelta(days=back)
        for i, (namespace, key, units) in enumerate(
            [
                ("team-nlp", "h100", 8),
                ("team-vision", "h100", 4),
                ("team-research", "a10", 2),
                ("team-sandbox", "a10", 1),
            ]
        ):
            rows.append(
                UsageRecord(
                    namespace=namespace,
                    subject_kind="GPU",
                    subject=f"history-{back}-{i}",
                    vm_name="history",
                    key=key,
                    resource_name=key,
                    units=units,
                    node="hgx-h100-01",
                    phase="Bound",
                    start=day + timedelta(hours=i),
                    end=day + timedelta(hours=6 + 2 * ((back + i) % 8)),
                )
            )
    UsageRecord.objects.bulk_create(rows)


def test_usage_chart_and_its_csv(demo: None, history: None, page: Page, live_server: Any) -> None:
    today = datetime.now(UTC).date()
    window = f"from={today - timedelta(days=7)}&to={today}"
    login(page, live_server, reverse("admin:placement-board"))

    # run a full pass now: the outcome is shown
    page.click("#run-full-pass")
    expect(page.locator("ul.messagelist")).to_contain_text(
        re.compile(r"Full pass #\d+ ran: bound 0 sets, moved 0 sets, lost 0 sets")
    )

    page.click("nav.gp-nav >> text=Usage chart")
    page.goto(f"{live_server.url}{reverse('admin:usage-chart')}?{window}")
    expect(page.locator("#chart-tenant rect.seg").first).to_be_visible()
    page.screenshot(path=artifacts_dir() / "usage-chart.png", full_page=True)
    drawn: dict[str, dict[tuple[str, str], float]] = {}
    for kind in ("tenant", "class"):
        rects = page.eval_on_selector_all(
            f"#chart-{kind} rect.seg", "els => els.map(e => [e.dataset.day, e.dataset.series, e.dataset.hours])"
        )
        drawn[kind] = {(day, series): float(hours) for day, series, hours in rects}
    assert len(drawn["tenant"]) >= 7 * 4

    with page.expect_download() as info:
        page.click("#csv-link")
    download = info.value
    path = artifacts_dir() / download.suggested_filename
    download.save_as(path)
    assert download.suggested_filename == f"gpu-hours-{today - timedelta(days=7)}-{today}.csv"
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    sums: dict[str, dict[tuple[str, str], float]] = {"tenant": defaultdict(float), "class": defaultdict(float)}
    for row in rows:
        sums["tenant"][(row["day"], row["tenant"])] += float(row["gpu_hours"])
        sums["class"][(row["day"], row["class"])] += float(row["gpu_hours"])
    for kind in ("tenant", "class"):
        assert drawn[kind].keys() == sums[kind].keys(), kind
        for key, hours in sums[kind].items():
            assert drawn[kind][key] == pytest.approx(hours, abs=1e-5), (kind, key)
    # a past day's figure, worked out by hand: team-nlp 8 units from 00:00 for 6 + 2 × (1 % 8) h
    yesterday = str(today - timedelta(days=1))
    assert drawn["tenant"][(yesterday, "team-nlp")] == pytest.approx(8 * 8.0)

    # a bad window is a clear message, not an error page
    page.goto(f"{live_server.url}{reverse('admin:usage-chart')}?from=2026-02-30")
    expect(page.locator("#chart-errors")).to_contain_text("'from' must be a date as YYYY-MM-DD")

"""The staff console in a real browser: the search box on every
page finds a tenant, a tenant's VM, a node; the node page offers drain; the drain preview
says where each set would go; confirming drains the node and the sets land where the
preview said. Debian's Chromium through Playwright on the demo cluster; screenshots are
artifacts (harness/browsing.py). With ``GPUPLANE_UPDATE_SCREENSHOTS=1`` the preview's is also
copied to docs/screenshots/drain-preview.png for the staff console's page (not by default: a test run
leaves the checkout as it found it)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.urls import reverse
from playwright.sync_api import Page, expect

from binder import models
from harness.browsing import artifacts_dir, login, orm

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_passwords")]

DRAINED = "hgx-h100-01"
README_SCREENSHOT = Path(settings.BASE_DIR) / "docs" / "screenshots" / "drain-preview.png"


def search(page: Page, query: str) -> None:
    page.fill("#gp-search-q", query)
    page.press("#gp-search-q", "Enter")
    expect(page.locator("#search-summary")).to_contain_text(query)


def test_search_from_any_page(demo: None, page: Page, live_server: Any) -> None:
    login(page, live_server, reverse("admin:binder_passrun_changelist"))

    search(page, "team-vision")
    expect(page.locator('#search-tenant li.hit[data-name="team-vision"]')).to_have_count(1)
    expect(page.locator('#search-vm li.hit[data-name="team-vision/detector-train"]')).to_have_count(1)
    page.screenshot(path=artifacts_dir() / "search-tenant.png", full_page=True)

    search(page, "team-vision/detector-train")
    vm = page.locator('#search-vm li.hit[data-name="team-vision/detector-train"]')
    expect(vm).to_contain_text("4 devices: 4 Bound on")
    expect(page.locator("#search-device li.hit")).to_have_count(4)
    expect(page.locator("#search-tenant")).to_have_count(0)
    page.screenshot(path=artifacts_dir() / "search-tenant-vm.png", full_page=True)
    vm.locator("a.hit-link").click()
    expect(page.locator("h1")).to_contain_text("Decision log of set team-vision/detector-train")
    expect(page.locator('#set-devices tr[data-phase="Bound"]')).to_have_count(4)

    # from the decision log's own search box: a node, to its page
    search(page, DRAINED)
    page.locator(f'#search-node li.hit[data-name="{DRAINED}"] a.hit-link').click()
    expect(page.locator("h1")).to_have_text(f"Node {DRAINED}")
    expect(page.locator("#node-sets tr.node-set").first).to_be_visible()


def test_drain_preview_then_drain(demo: None, page: Page, live_server: Any) -> None:
    held = orm(
        lambda: sorted(
            set(models.GpuDevice.objects.filter(node=DRAINED, phase="Bound").values_list("namespace__name", "vm_name"))
        )
    )
    assert held, "the demo has sets on the node"
    login(page, live_server, reverse("admin:node-detail", args=[DRAINED]))
    expect(page.locator("#node-sets tr.node-set")).to_have_count(len(held))
    page.click('#node-actions a.node-action[data-action="drain"]')

    expect(page.locator("h1")).to_have_text(f"Drain {DRAINED}?")
    rows = page.locator("#preview-sets tr.preview-set")
    expect(rows).to_have_count(len(held))
    targets = dict(
        zip(
            rows.evaluate_all("rows => rows.map(r => r.dataset.set)"),
            rows.evaluate_all("rows => rows.map(r => r.dataset.target)"),
            strict=True,
        )
    )
    assert set(targets) == {f"{ns}/{vm}" for ns, vm in held}
    assert all(target != f"stays on {DRAINED}" for target in targets.values()), targets
    page.screenshot(path=artifacts_dir() / "drain-preview.png", full_page=True)
    if os.environ.get("GPUPLANE_UPDATE_SCREENSHOTS") == "1":
        README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifacts_dir() / "drain-preview.png", README_SCREENSHOT)
    assert orm(lambda: not models.Node.objects.get(name=DRAINED).draining)  # the preview wrote nothing

    page.click("#confirm-node-action")
    expect(page).to_have_url(re.compile(re.escape(reverse("admin:node-detail", args=[DRAINED])) + "$"))
    expect(page.locator("ul.messagelist")).to_contain_text(f"Drain {DRAINED}: label gpuplane.io/drain=true")
    expect(page.locator("#node-states")).to_contain_text("draining")
    page.screenshot(path=artifacts_dir() / "drained-node.png", full_page=True)

    # the sets are where the preview said
    def placements() -> dict[str, str]:
        out = {}
        for ns, vm in held:
            rows = set(models.GpuDevice.objects.filter(namespace__name=ns, vm_name=vm).values_list("phase", "node"))
            phases = {p for p, _ in rows}
            nodes = sorted({n for _, n in rows if n})
            out[f"{ns}/{vm}"] = ", ".join(nodes) if phases == {"Bound"} else "Lost" if "Lost" in phases else "Pending"
        return out

    assert orm(placements) == targets
    assert orm(lambda: models.PassRun.objects.order_by("-pk").first().triggered_by) == "staff:staff"  # type: ignore[union-attr]
    # and undrain is what the node page offers now
    expect(page.locator('#node-actions a.node-action[data-action="undrain"]')).to_be_visible()

    # the home page's fleet health lists the drained node and the sets it lost, linked
    page.click("#site-name a")
    health = page.locator("#fleet-health")
    expect(health.locator(f'tr.health-node[data-node="{DRAINED}"]')).to_contain_text("draining")
    for key, target in targets.items():
        if target == "Lost":
            lost = health.locator(f'#health-lost tr.health-set[data-set="{key}"]')
            expect(lost).to_contain_text(re.compile(r"Lost \d+ (s|min)"))
    expect(page.locator("#health-as-of")).to_contain_text("auto-refresh off")
    page.screenshot(path=artifacts_dir() / "fleet-health.png", full_page=True)
    health.locator(f'tr.health-node[data-node="{DRAINED}"] a').click()
    expect(page.locator("h1")).to_have_text(f"Node {DRAINED}")

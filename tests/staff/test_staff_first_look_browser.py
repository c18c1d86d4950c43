"""The staff console as a newcomer first sees it, at 1440 px, in Chromium (Debian's,
through Playwright; harness/browsing.py) on the demo cluster: the home page's fleet health
uses the width it has, and a device's page leads with its status."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse
from playwright.sync_api import Browser, expect

from binder import models
from harness.browsing import artifacts_dir, login, new_page, orm

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_passwords")]


def test_fleet_health_takes_the_width_of_the_window_without_scrolling(
    demo: None, browser: Browser, live_server: Any
) -> None:
    page = new_page(browser, viewport={"width": 1440, "height": 900})
    login(page, live_server, reverse("admin:index"))
    health = page.locator("#fleet-health")
    expect(health.locator("#health-lost tr.health-set")).to_have_count(1)
    page.screenshot(path=artifacts_dir() / "home-1440.png", full_page=True)
    width, scroll, client = health.evaluate("e => [e.getBoundingClientRect().width, e.scrollWidth, e.clientWidth]")
    assert scroll <= client, f"the fleet health scrolls sideways: {scroll} px of content in {client} px"
    assert width > 900, f"the fleet health is {width} px wide in a 1440 px window"
    # The Lost set's reason is shown whole, inside the box.
    reason = health.locator("#health-lost tr.health-set td").last
    box, cell = health.bounding_box(), reason.bounding_box()
    assert box and cell and cell["x"] + cell["width"] <= box["x"] + box["width"] + 1


def test_a_lost_devices_page_leads_with_its_status_and_the_node_it_was_lost_from(
    demo: None, browser: Browser, live_server: Any
) -> None:
    device = orm(lambda: models.GpuDevice.objects.filter(phase="Lost").order_by("name").first())
    assert device is not None
    page = new_page(browser, viewport={"width": 1440, "height": 900})
    login(page, live_server, reverse("admin:binder_gpudevice_change", args=[device.pk]))
    status = page.locator("#device-status")
    expect(status.locator("#status-phase")).to_have_text("Lost")
    expect(status.locator("#status-node")).to_contain_text("lost from hgx-h100-05")
    expect(status.locator("#status-reason")).to_contain_text(device.reason[:40])
    page.screenshot(path=artifacts_dir() / "device-lost-1440.png", full_page=True)
    # The status comes first and fits the first screen; the raw form is behind a summary.
    assert (status.bounding_box() or {"y": 10**6})["y"] < 300
    expect(page.locator("#device-raw-form")).not_to_have_attribute("open", "")
    expect(page.locator("#device-raw-form input[name=_save]")).not_to_be_visible()
    expect(page.locator("a.deletelink")).not_to_be_visible()


def test_a_lost_set_comes_back_from_its_would_fit_line_and_the_message_says_where(
    demo: None, browser: Browser, live_server: Any
) -> None:
    """Standalone mode: the Lost sets view links "bring it back to Ready" to the node's
    Mark Ready action; its preview, one confirmation, and the message names the set Bound."""
    page = new_page(browser, viewport={"width": 1440, "height": 900})
    login(page, live_server, reverse("admin:binder_lostset_changelist"))
    row = page.locator('#lost-sets tr[data-set="team-nlp/llm-train-a"]')
    link = row.locator('a.fit-action[data-node="hgx-h100-05"][data-action="ready"]')
    expect(link).to_have_text("Mark Ready hgx-h100-05…")
    link.click()
    expect(page.locator("h1")).to_have_text("Mark Ready hgx-h100-05?")
    page.click("#confirm-node-action")
    expect(page.locator("ul.messagelist")).to_contain_text("team-nlp/llm-train-a Bound on hgx-h100-05")
    expect(page.locator("ul.messagelist")).to_contain_text("Full pass #")
    page.screenshot(path=artifacts_dir() / "node-marked-ready.png", full_page=True)
    # The node page now offers the opposite, and nothing is Lost.
    expect(page.locator('#node-actions a.node-action[data-action="not-ready"]')).to_have_text("Mark NotReady…")
    assert orm(lambda: set(models.GpuDevice.objects.filter(vm_name="llm-train-a").values_list("phase", "node"))) == {
        ("Bound", "hgx-h100-05")
    }


def test_the_board_strikes_through_only_deleted_nodes_shows_taints_and_links_pending_sets(
    demo: None, browser: Browser, live_server: Any
) -> None:
    taint = {"key": "nvidia.com/maintenance", "value": "firmware", "effect": "NoSchedule"}
    orm(lambda: models.Node.objects.filter(name="gpu-a10-02").update(taints=[taint]))
    page = new_page(browser, viewport={"width": 1440, "height": 900})
    login(page, live_server, reverse("admin:placement-board"))
    notready = page.locator('#gp-board tr[data-node="hgx-h100-05"] th')
    expect(notready).to_be_visible()
    assert notready.evaluate("e => getComputedStyle(e).textDecorationLine") == "none"
    assert notready.locator("a").evaluate("e => getComputedStyle(e).textDecorationLine") != "line-through"
    state = page.locator('#gp-board tr[data-node="gpu-a10-02"] td').first
    expect(state.locator(".badge.taint")).to_have_text("taint nvidia.com/maintenance=firmware:NoSchedule")
    pending = page.locator("#gp-pending tr.pending-set").first
    name = pending.get_attribute("data-set") or ""
    namespace, vm = name.split("/")
    pending.locator("th a.set-link").click()
    expect(page.locator("h1")).to_contain_text(f"Decision log of set {namespace}/{vm}")

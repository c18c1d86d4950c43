"""The staff console in a real browser: a Lost set explained and Bound again in
at most 5 clicks, the board at 1,000 nodes paged, keyboard navigation, a phone-sized run
and axe-core accessibility scans, on Debian's Chromium driven by Playwright.

Screenshots go to the artifacts directory (as in ``test_staff_browser``) and the docs'
two to ``docs/screenshots/`` (board.png, lost-set.png).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from django.urls import reverse
from playwright.sync_api import Browser, Page, expect

from binder import models
from harness.browsing import add_staff, artifacts_dir, axe_violations, login, new_page, orm, readme_screenshot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_passwords")]

LOST_SET = "team-nlp/llm-train-a"
H100 = "nvidia.com/GH100_H100_SXM5_80GB"


@pytest.fixture
def thousand() -> None:
    """1,000 H100 nodes (bulk inserts): node i holds a set of i % 8 devices of tenant
    t{i % 40}; every 50th node is cordoned."""
    tenants = models.Namespace.objects.bulk_create([models.Namespace(name=f"t{i:02d}") for i in range(40)])
    models.GpuClass.objects.create(name="h100", resource_name=H100)
    models.Node.objects.bulk_create(
        [models.Node(name=f"node-{i:04d}", allocatable={H100: 8}, unschedulable=i % 50 == 3) for i in range(1000)]
    )
    models.GpuDevice.objects.bulk_create(
        [
            models.GpuDevice(
                namespace=tenants[i % 40],
                name=f"g{i}-{j}",
                class_name="h100",
                vm_name=f"vm-{i}",
                phase="Bound",
                node=f"node-{i:04d}",
            )
            for i in range(1000)
            for j in range(i % 8)
        ],
        batch_size=2000,
    )
    add_staff()


class Clicks:
    """Counts the clicks a flow takes (every click goes through here)."""

    def __init__(self, page: Page) -> None:
        self.page, self.count = page, 0

    def __call__(self, selector: str) -> None:
        self.count += 1
        self.page.click(selector)


def test_lost_set_explained_and_bound_again_in_at_most_five_clicks(
    demo: None, browser: Browser, live_server: Any
) -> None:
    page = new_page(browser)
    login(page, live_server, reverse("admin:placement-board"))
    click = Clicks(page)

    # the board says what the Lost set needs and what would fit, without a click
    row = page.locator(f'#gp-lost tr[data-set="{LOST_SET}"]')
    expect(row.locator(".needs")).to_contain_text("needs 8 × h100 on one node; the largest gap is 0 on hgx-h100-01")
    expect(row.locator(".vmi.notready")).to_contain_text("running on hgx-h100-05, which is NotReady since")
    expect(row.locator("ol.would-fit li").first).to_contain_text("on hgx-h100-05: bring it back to Ready")
    expect(row.locator("ol.would-fit")).to_contain_text("on hgx-h100-04: uncordon it and free 2")
    row.scroll_into_view_if_needed()
    row.screenshot(path=artifacts_dir() / "lost-set.png")
    readme_screenshot(page.locator("#gp-lost"), "lost-set.png")

    # click 1: the set's deep link highlights its cells
    click(f'#gp-lost tr[data-set="{LOST_SET}"] a.set-link')
    expect(page).to_have_url(re.compile(r"q=team-nlp%2Fllm-train-a"))
    expect(page.locator("#gp-lost i.u.pin")).to_have_count(8)
    expect(page.locator("#cell-info")).to_be_visible()

    # the cluster does what the explanation says: hgx-h100-05 is Ready again (its kubelet)
    orm(lambda: models.Node.objects.filter(name="hgx-h100-05").update(ready=True, ready_since=datetime.now(UTC)))

    # clicks 2 and 3: to the Lost sets view, retry now
    click(f'#gp-lost tr[data-set="{LOST_SET}"] a.retry-link')
    lost = page.locator(f'#lost-sets tr[data-set="{LOST_SET}"]')
    expect(lost).to_contain_text("hgx-h100-05 has room now: a pass would bind it there (retry)")
    click(f'#lost-sets tr[data-set="{LOST_SET}"] button[name=retry]')
    expect(page.locator("ul.messagelist")).to_contain_text(f"{LOST_SET} is now Bound on hgx-h100-05.")

    # click 4: the board shows it Bound
    click("nav.gp-nav >> text=Placement board")
    expect(page.locator(f'tr[data-node="hgx-h100-05"] a.u[data-set="{LOST_SET}"]')).to_have_count(8)
    expect(page.locator("#gp-lost")).to_have_count(0)
    assert click.count <= 5, click.count


def test_board_at_1000_nodes_is_paged_sorted_and_finds_a_set(
    thousand: None, browser: Browser, live_server: Any
) -> None:
    page = new_page(browser)
    login(page, live_server, reverse("admin:placement-board"))
    rows = page.locator("#gp-board tr.node")
    expect(rows).to_have_count(100)
    expect(page.locator("#board-pages")).to_contain_text("page 1 of 10")
    expect(rows.first).to_have_attribute("data-node", "node-0000")
    page.click("#board-pages a[rel=next]")
    expect(rows.first).to_have_attribute("data-node", "node-0100")
    page.click("#sort-free")  # the fewest free first: full and cordoned nodes
    expect(page).to_have_url(re.compile(r"sort=free"))
    expect(rows.first).to_have_attribute("data-free", "0")
    page.click("#sort-free")  # then the most free first
    expect(rows.first).to_have_attribute("data-free", "8")
    # ?q= of a set on page 7: its page, its cells pinned, its panel open beside the cell
    page.fill("#board-filters input[name=q]", "t25/vm-665")
    page.click("#board-filters button[type=submit]")
    expect(page.locator("#board-found")).to_contain_text("set t25/vm-665: Bound on node-0665")
    pinned = page.locator('tr[data-node="node-0665"] a.u.pin')
    expect(pinned).to_have_count(665 % 8)
    panel = page.locator("#cell-info")
    expect(panel).to_be_visible()
    expect(panel.locator("#cell-info-heading")).to_have_text("set t25/vm-665")
    cell, box = pinned.first.bounding_box(), panel.bounding_box()
    assert cell and box and box["x"] >= cell["x"] + cell["width"] and box["x"] + box["width"] <= 1280
    page.screenshot(path=artifacts_dir() / "board-1000-nodes.png")
    expect(page.locator("#board-legend a[data-tenant]")).to_have_count(7)  # a compact legend


def test_keyboard_tab_to_the_cells_arrows_enter_and_escape(demo: None, browser: Browser, live_server: Any) -> None:
    page = new_page(browser)
    login(page, live_server, reverse("admin:placement-board"))
    page.locator("body").focus()
    tabs = 0
    while tabs < 30:
        page.keyboard.press("Tab")
        tabs += 1
        if page.evaluate("() => document.activeElement.id") == "skip-to-cells":
            break
    assert tabs <= 10, f"{tabs} Tabs to the board's skip link"
    page.keyboard.press("Enter")
    focused = "() => [document.activeElement.className, document.activeElement.closest('tr')?.dataset.node]"
    assert page.evaluate(focused)[1] == "gpu-a10-01"
    assert "u" in page.evaluate(focused)[0].split()
    page.keyboard.press("ArrowRight")
    assert page.evaluate(focused)[1] == "gpu-a10-01"
    page.keyboard.press("ArrowDown")
    assert page.evaluate(focused)[1] == "gpu-a10-02"
    page.keyboard.press("Enter")
    panel = page.locator("#cell-info")
    expect(panel).to_be_visible()
    assert page.evaluate("() => document.activeElement.classList.contains('close')")
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    assert page.evaluate(focused)[1] == "gpu-a10-02"  # focus back on the cell
    # one Tab stop for all the cells: Tab goes on to the next node's link, not the next cell
    page.keyboard.press("Tab")
    assert not page.evaluate("() => document.activeElement.classList.contains('u')")


def test_phone_sized_board_has_32px_targets_and_a_panel_on_screen(
    demo: None, browser: Browser, live_server: Any
) -> None:
    page = new_page(browser, viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    login(page, live_server, reverse("admin:placement-board"))
    sizes = page.eval_on_selector_all(
        "#gp-board a.u", "els => els.map(e => [e.getBoundingClientRect().width, e.getBoundingClientRect().height])"
    )
    assert sizes and all(w >= 32 and h >= 32 for w, h in sizes), sizes[:3]
    wide = page.evaluate(
        """() => [...document.querySelectorAll("body *")]
                 .filter(e => e.getBoundingClientRect().right > 391)
                 .map(e => e.tagName + "." + e.className + " " + Math.round(e.getBoundingClientRect().right))"""
    )
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390, wide[:12]
    page.locator('tr[data-node="hgx-h100-02"] a.u').first.tap()
    panel = page.locator("#cell-info")
    expect(panel).to_be_visible()
    box = panel.bounding_box()
    assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844
    close = page.locator("#cell-info .close").bounding_box()
    assert close and close["width"] >= 32 and close["height"] >= 32
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    page.screenshot(path=artifacts_dir() / "board-phone.png")


def test_axe_finds_no_serious_violations(demo: None, browser: Browser, live_server: Any) -> None:
    # The test context skips the site's CSP so axe (an injected inline script) can run.
    page = new_page(browser, bypass_csp=True)
    login(page, live_server, reverse("admin:placement-board"))
    found = {}
    for name in ("admin:placement-board", "admin:binder_lostset_changelist", "admin:budgets"):
        page.goto(f"{live_server.url}{reverse(name)}")
        found[name] = axe_violations(page)
    assert found == {name: [] for name in found}, found


def test_board_screenshot_for_the_readme(demo: None, browser: Browser, live_server: Any) -> None:
    page = new_page(browser, viewport={"width": 1280, "height": 760})
    login(page, live_server, reverse("admin:placement-board"))
    cell = page.locator('tr[data-node="hgx-h100-02"] a.u[data-set="team-research/protein-fold"]').first
    cell.hover()
    cell.click()
    expect(page.locator("#cell-info")).to_be_visible()
    expect(page.locator('a.u.pin[data-set="team-research/protein-fold"]')).to_have_count(4)
    readme_screenshot(page, "board.png")
    page.screenshot(path=artifacts_dir() / "board.png", full_page=True)

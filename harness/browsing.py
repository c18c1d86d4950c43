"""Helpers for the browser tests of the staff console (not a test module): Debian's
Chromium driven by Playwright (never a browser Playwright would download), the ORM from
another thread, the demo cluster and its staff user, logging in, artifacts, axe-core.
The ``browser`` fixture built on :func:`launch_chromium` is in tests/conftest.py;
bench/board_bench.py launches Chromium with the same arguments."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, connections
from django.urls import reverse
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from binder.mirror.snapshot import load_file
from binder.runtime.passes import run_pass
from gpuplane.management.commands.demo import DEMO_FILE

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
PASSWORD = "staff-pass-1234"
AXE = Path(__file__).resolve().parents[1] / "tests" / "vendor" / "axe-core" / "axe.min.js"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "screenshots"


@contextmanager
def launch_chromium() -> Iterator[Browser]:
    """Debian's Chromium, closed on leaving: a test's browser must stop before its test
    database is flushed, for the same reason as :func:`orm`."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def new_page(browser: Browser, **options: Any) -> Page:
    """A page in a fresh context (1280 × 900 unless ``viewport`` says otherwise); a
    locator waits up to 15 s, as a page of the console on a busy CI machine may take."""
    context = browser.new_context(**{"viewport": {"width": 1280, "height": 900}, **options})
    context.set_default_timeout(15_000)
    return context.new_page()


def readme_screenshot(target: Page | Locator, name: str) -> None:
    """Refresh the docs' ``docs/screenshots/<name>`` only with ``GPUPLANE_UPDATE_SCREENSHOTS=1``,
    so an ordinary test run never edits the checkout (the artifacts get a copy every run)."""
    if os.environ.get("GPUPLANE_UPDATE_SCREENSHOTS") != "1":
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    target.screenshot(path=SCREENSHOTS / name)


def artifacts_dir() -> Path:
    """``GPUPLANE_ARTIFACTS`` (else ``var/artifacts``)/browser-<database vendor>."""
    base = Path(os.environ.get("GPUPLANE_ARTIFACTS") or settings.VAR_DIR / "artifacts")
    path = base / f"browser-{connection.vendor}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def orm[T](work: Callable[[], T]) -> T:
    """Run ORM work on another thread: Playwright's sync API keeps an event loop on this
    one while the browser is open, and Django refuses database calls from a thread with a
    running loop. (Fixtures that write the database run before the browser starts.)"""

    def run() -> T:
        try:
            return work()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def add_staff() -> None:
    """The superuser ``staff`` (:data:`PASSWORD`) that :func:`login` logs in as."""
    get_user_model().objects.create_user("staff", password=PASSWORD, is_staff=True, is_superuser=True)


def load_demo() -> None:
    """The demo cluster, placed as ``make demo`` places it (two full passes), and staff."""
    load_file(DEMO_FILE, replace=True)
    run_pass()
    run_pass()
    add_staff()


def login(page: Page, live_server: Any, next_url: str) -> None:
    page.goto(f"{live_server.url}{reverse('admin:login')}?next={next_url}")
    page.fill("#id_username", "staff")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page).to_have_url(re.compile(re.escape(next_url)))


def axe_violations(page: Page) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page (WCAG 2.1 A and AA rules)."""
    page.add_script_tag(path=str(AXE))
    result = page.evaluate(
        """() => axe.run(document, {runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]}})"""
    )
    assert result["passes"], "axe-core ran no rule"
    return [
        {"id": v["id"], "impact": v["impact"], "help": v["help"], "nodes": [n["target"] for n in v["nodes"][:5]]}
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]

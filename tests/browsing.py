"""Helpers for the browser tests of the staff console (not a test module): Debian's
Chromium driven by Playwright, the ORM from another thread, logging in, artifacts."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, connections
from django.urls import reverse
from playwright.sync_api import Page, expect

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
AXE = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "screenshots"


def artifacts_dir() -> Path:
    base = Path(os.environ.get("GPUPLANE_ARTIFACTS") or settings.VAR_DIR / "artifacts")
    path = base / f"browser-{connection.vendor}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def orm[T](work: Callable[[], T]) -> T:
    """Run ORM work on another thread: Django refuses database calls from the thread that
    runs Playwright's event loop."""

    def run() -> T:
        try:
            return work()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


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

"""Helpers for the Playwright tests of the staff console (Debian's Chromium, never a
downloaded browser): the launch, artifacts, ORM work beside the browser, the login.
``tests/test_staff_browser.py`` keeps its own copies; new browser tests use these."""

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


def artifacts_dir() -> Path:
    """``GPUPLANE_ARTIFACTS`` (else ``var/artifacts``)/browser-<database vendor>."""
    base = Path(os.environ.get("GPUPLANE_ARTIFACTS") or settings.VAR_DIR / "artifacts")
    path = base / f"browser-{connection.vendor}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def orm[T](work: Callable[[], T]) -> T:
    """Run ORM work on another thread: Playwright's sync API keeps an event loop on this one,
    and Django refuses database calls from a thread with a running loop."""

    def run() -> T:
        try:
            return work()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def login(page: Page, live_server: Any, next_url: str, username: str = "staff") -> None:
    page.goto(f"{live_server.url}{reverse('admin:login')}?next={next_url}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page).to_have_url(re.compile(re.escape(next_url)))

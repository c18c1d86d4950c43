"""Shared test setup.

Passes are driven by hand in tests (``GPUPLANE_AUTO_PASS`` off) unless a test turns
automatic passes on to check them. With ``GPUPLANE_FORBID_SKIPS=1`` (the PostgreSQL run
in CI) any skipped test fails the session, so a run that silently fell back is red.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from hypothesis import settings as hypothesis_settings

from tests.shapes import NOW

# Property tests, state machines and the schemathesis fuzzer search afresh on every local
# run (``make test``): that is how they find bugs. CI (``.ci/run``) sets
# HYPOTHESIS_PROFILE=ci: the same examples every run, so a red CI is a regression in the
# code, not the luck of the draw. Loaded here, before any test module builds its settings.
hypothesis_settings.register_profile("ci", derandomize=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _manual_passes(settings: Any) -> None:
    settings.GPUPLANE_AUTO_PASS = False


@pytest.fixture(autouse=True)
def _close_answer_listener() -> Iterator[None]:
    """The webhook's per-process LISTEN connection holds the test database open; close it
    after each test so the database can be flushed and dropped."""
    yield
    from binder.runtime.answers import ANSWERS

    ANSWERS.stop()


class Clock:
    """``timezone.now()`` for passes, queries and views, moved by hand (see ``clock``)."""

    def __init__(self) -> None:
        self.now = NOW

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


@pytest.fixture
def clock() -> Iterator[Clock]:
    """Freeze ``django.utils.timezone.now`` at tests.shapes.NOW; ``clock.advance(hours=1)``."""
    c = Clock()
    with mock.patch("django.utils.timezone.now", side_effect=lambda: c.now):
        yield c


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("GPUPLANE_FORBID_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped:
        if reporter:
            reporter.write_line(f"GPUPLANE_FORBID_SKIPS=1: {skipped} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

"""The test clock: ``timezone.now()`` for passes, queries and views, moved by hand.

The ``clock`` fixture (tests/conftest.py) patches ``django.utils.timezone.now`` with one
and hands it to the test; this module holds the class so tests can name its type.
"""

from __future__ import annotations

from datetime import timedelta

from harness.shapes import NOW


class Clock:
    """``timezone.now()`` for passes, queries and views, moved by hand (see ``clock``)."""

    def __init__(self) -> None:
        self.now = NOW

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)

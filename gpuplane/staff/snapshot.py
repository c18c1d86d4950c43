"""One mirror snapshot, its ledger and holdings, reused by staff pages while the mirror is unchanged.

The mirror comes from this web process's read model (``binder.runtime.readmodel``): kept
in memory and brought current from the change feed before each use, so a page shows
every change committed before it was asked for, without reading the mirror's tables
(at 10,000 nodes that read and the ledger took about 1.3 s, more than the board may take
to show). The model's generation changes whenever a record in it changes (or it was read
again); same generation, same records: the cached snapshot, its ledger and what pages
derived from it (``memo``) are what a fresh read would give.

The cache holds one snapshot per process and also expires after :data:`MAX_AGE_SECONDS`,
so settings read at snapshot time (the grace period, the default budget) are never old
for long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core.signals import setting_changed

from binder.engine import Holding, Ledger
from binder.engine import types as e
from binder.runtime.readmodel import read_model

MAX_AGE_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    cluster: e.Cluster
    ids: dict[tuple[str, str], int]
    ledger: Ledger
    holdings: Mapping[str, list[Holding]]
    memo: dict[object, Any] = field(default_factory=dict)
    """What pages derive from this snapshot (the board's summed rows per filter and order)."""


_lock = threading.Lock()
_cached: tuple[tuple[object, ...], float, Snapshot] | None = None


def snapshot(now: datetime) -> Snapshot:
    """The mirror as one engine snapshot, from the cache when the read model did not change.

    Reused snapshots keep the moment they were read at as ``cluster.now``; the board
    reads no deadline from it (a NotReady node shows since when, not for how long)."""
    global _cached
    model = read_model()
    key = (id(model), model.generation)
    with _lock:
        if _cached is not None and _cached[0] == key and time.monotonic() - _cached[1] < MAX_AGE_SECONDS:
            return _cached[2]
    taken = model.snapshot(now)
    cluster, ids, ledger = taken.cluster, taken.ids, taken.ledger
    fresh = Snapshot(cluster, ids, ledger, ledger.holdings())
    with _lock:
        _cached = ((id(model), taken.generation), time.monotonic(), fresh)
    return fresh


def forget() -> None:
    """Drop the cached snapshot (tests that change what the feed does not see: settings)."""
    global _cached
    with _lock:
        _cached = None


def _on_setting_changed(**_: object) -> None:
    forget()


setting_changed.connect(_on_setting_changed)

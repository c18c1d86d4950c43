"""Verification: what differs between a kept state and one read from scratch.

A pass due for verification rebuilds the view from scratch, runs the engine again on it
and compares both the records and the decisions; every difference is logged and counted,
and the worker continues from the rebuilt state. The read model of the web processes
compares its records the same way.
"""

from __future__ import annotations

from collections import Counter

from binder.engine import PassResult
from binder.engine.accounting import Ledger
from binder.runtime.mirror_state import ENGINE_KINDS, MirrorState, record_key


def compare_records(mine: MirrorState, fresh: MirrorState) -> list[str]:
    """Every record that differs between two states, as ``kind ns/name: ours != fresh``."""
    out: list[str] = []
    for kind in ENGINE_KINDS:
        ours = {record_key(r): r for r in mine.records[kind].values()}
        theirs = {record_key(r): r for r in fresh.records[kind].values()}
        out.extend(
            f"{kind} {key[0]}/{key[1]}: state {ours.get(key)!r} != database {theirs.get(key)!r}"
            for key in sorted(set(ours) | set(theirs))
            if ours.get(key) != theirs.get(key)
        )
    return out


def compare_results(mine: PassResult, fresh: PassResult) -> list[str]:
    """Every difference between two pass results (devices, changes, answers, counts; class
    and budget status when both computed them)."""
    ours = {d.key: d for d in mine.devices}
    theirs = {d.key: d for d in fresh.devices}
    out = [
        f"device {key[0]}/{key[1]}: incremental {ours.get(key)!r} != from scratch {theirs.get(key)!r}"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]
    if Counter(mine.changes) != Counter(fresh.changes):
        out.append(f"decisions: incremental {mine.changes!r} != from scratch {fresh.changes!r}")
    if sorted(mine.answered) != sorted(fresh.answered):
        out.append(f"answers: incremental {mine.answered!r} != from scratch {fresh.answered!r}")
    if dict(mine.counts) != dict(fresh.counts):
        out.append(f"counts: incremental {dict(mine.counts)!r} != from scratch {dict(fresh.counts)!r}")
    for name in ("class_status", "budget_used", "budget_borrowed"):
        a, b = getattr(mine, name), getattr(fresh, name)
        if a and b and dict(a) != dict(b):
            out.append(f"{name}: incremental {dict(a)!r} != from scratch {dict(b)!r}")
    return out


def compare_lending(mine: Ledger, fresh: Ledger) -> list[str]:
    """Every difference in what two ledgers keep of lending (borrowed units per tenant and
    set, marked sets, the borrowed sets by tenant and by resource and node): the kept
    indexes repay and reclaim read against a ledger built from scratch."""
    ours, theirs = mine.lending_index(), fresh.lending_index()
    return [
        f"ledger {name}: incremental {ours[name]!r} != from scratch {theirs[name]!r}"
        for name in ours
        if ours[name] != theirs[name]
    ]

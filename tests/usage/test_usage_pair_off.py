"""A full usage reconciliation pairs records and holdings as plain tuples first.

``pair_off`` drops every open record that a current holding still stands for (and that
holding), so ``reconcile_usage`` only sees the few left. The plan must be exactly the
plan ``reconcile_usage`` makes from everything: same records closed at the same ends,
same holdings opened at the same starts. Duplicated open records of one holding (which
storage should never hold) keep the lowest id open, as ``reconcile_usage`` does.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from binder.engine.usage import (
    OpenRecord,
    RecordPhase,
    SubjectKind,
    UsageHolding,
    UsagePlan,
    holding_of,
    identity,
    identity_text,
    pair_off,
    reconcile_usage,
)
from binder.runtime.usage_records import open_record_rows, write_plan
from usage.models import UsageRecord

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def gpu(
    name: str, node: str, *, since_s: int = 0, phase: RecordPhase = RecordPhase.BOUND, units: int = 1
) -> UsageHolding:
    return UsageHolding(
        "team-a", SubjectKind.GPU, name, "", "h100", "nvidia.com/H100", units, node, phase, "vm-1",
        since=T0 + timedelta(seconds=since_s),
    )  # fmt: skip


def raw(pod: str, units: int) -> UsageHolding:
    return UsageHolding("team-a", SubjectKind.POD, pod, "uid-" + pod, "nvidia.com/A10", "nvidia.com/A10", units, "n1",
                   RecordPhase.RAW)  # fmt: skip


def test_identity_is_the_row_a_record_stores_and_reads_back_as_the_same_holding() -> None:
    holding = raw("trainer", 2)
    row = identity(holding)
    assert row == ("team-a", "Pod", "trainer", "uid-trainer", "nvidia.com/A10", "nvidia.com/A10", 2, "n1", "Raw", "",
                   False)  # fmt: skip
    assert holding_of(row) == holding
    # What the database builds from the row (a boolean as PostgreSQL writes it as text).
    assert identity_text(holding) == "\x1f".join(map(str, row[:-1])) + "\x1ffalse"
    assert identity_text(dataclasses.replace(holding, borrowed=True)).endswith("\x1ftrue")
    assert all(type(value) in (str, int, bool) for value in row)  # hashes as the database's strings do


def test_records_still_held_pair_off_and_only_the_changes_are_left() -> None:
    kept, moved, gone = gpu("g0", "n1"), gpu("g1", "n1"), gpu("g2", "n2")
    rows = [(3, identity(gone)), (1, identity(kept)), (2, identity(moved))]
    now_moved, new = gpu("g1", "n2", since_s=5), raw("trainer", 1)
    left_ids, left = pair_off(rows, [new, kept, now_moved])
    assert left_ids == [2, 3]
    assert left == [new, now_moved]


def test_of_two_open_records_of_one_holding_the_lower_id_stays_open() -> None:
    held = gpu("g0", "n1")
    left_ids, left = pair_off([(9, identity(held)), (4, identity(held))], [held])
    assert (left_ids, left) == ([9], [])


SUBJECTS = st.sampled_from(["g0", "g1", "g2", "g3"])
HOLDINGS = st.builds(
    gpu,
    SUBJECTS,
    st.sampled_from(["n1", "n2"]),
    since_s=st.integers(min_value=0, max_value=20),
    phase=st.sampled_from([RecordPhase.BOUND, RecordPhase.LOST]),
    units=st.integers(min_value=1, max_value=2),
) | st.builds(raw, st.sampled_from(["p0", "p1"]), st.integers(min_value=1, max_value=3))


@given(
    records=st.lists(st.tuples(HOLDINGS, st.integers(min_value=0, max_value=15)), max_size=12),
    current=st.lists(HOLDINGS, max_size=12),
    recorded_until_s=st.none() | st.integers(min_value=0, max_value=20),
)
def test_the_plan_from_what_is_left_is_the_plan_from_everything(
    records: list[tuple[UsageHolding, int]], current: list[UsageHolding], recorded_until_s: int | None
) -> None:
    open_records = [
        OpenRecord(i + 1, holding, T0 + timedelta(seconds=start)) for i, (holding, start) in enumerate(records)
    ]
    open_records.reverse()  # storage gives no order
    now = T0 + timedelta(seconds=30)
    until = None if recorded_until_s is None else T0 + timedelta(seconds=recorded_until_s)
    since = {("team-a", h.subject): h.since for h in current if h.subject_kind is SubjectKind.GPU}
    everything = reconcile_usage(open_records, current, now, recorded_until=until, device_since=since)

    left_ids, left = pair_off(((r.id, identity(r.holding)) for r in open_records), current)
    by_id = {r.id: r for r in open_records}
    from_left = reconcile_usage([by_id[i] for i in left_ids], left, now, recorded_until=until, device_since=since)
    assert from_left == everything


@given(current=st.lists(HOLDINGS, max_size=8, unique_by=lambda h: (h.subject, h.resource_name)))
def test_pairing_by_identity_text_leaves_what_pairing_by_identity_leaves(current: list[UsageHolding]) -> None:
    rows = [(i, identity(h)) for i, h in enumerate(current[::2])]
    by_digest = [(i, identity_text(h)) for i, h in enumerate(current[::2])]
    assert pair_off(by_digest, current, identity_text) == pair_off(rows, current)


@pytest.mark.django_db
def test_storage_keys_each_open_record_as_the_engine_keys_its_holding() -> None:
    """On PostgreSQL the database builds the identity text: it must be the engine's, byte
    for byte, or a full reconciliation would close and reopen every record."""
    held = [gpu("g0", "n1"), gpu("g-1", "", phase=RecordPhase.LOST, units=12), raw("trainer", 3)]
    write_plan(UsagePlan(open=tuple(held)), 1, T0)
    UsageRecord.objects.filter(subject="g0").update(end=T0 + timedelta(seconds=1))  # closed: not read
    rows, key = open_record_rows()
    assert sorted(digest for _, digest in rows) == sorted(key(h) for h in held[1:])
    assert {i for i, _ in rows} == set(UsageRecord.objects.open().values_list("id", flat=True))

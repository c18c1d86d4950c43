"""Following the change feed: the one reader every in-memory copy of the mirror uses.

Every insert, update and delete of a mirrored row leaves an entry in ``binder_change``
(written by triggers in the writer's own transaction, whatever the write path), with a
position in one ordered sequence. A process that keeps the mirror in memory (the binder's
:class:`~binder.runtime.state.ClusterState`, a web process's read model) reads the feed
through a :class:`FeedCursor`: it either gets the entries it has not seen, or a
:class:`FeedGap` saying why it cannot prove it saw everything (and must read everything
again). One module for both, so the rules below exist once.

**Which entries a reader must (re-)read.** Positions come from a sequence when the writer
inserts, not when it commits, so a reader that saw position P may later see a smaller
position commit. The rule (PostgreSQL): a read takes, in the same statement (one
snapshot), the highest position ``P`` and the snapshot's **horizon**: the transaction ids
it lists as in progress (``pg_snapshot_xip``) and, last, its ``xmax``. Any transaction
that can still commit a position below ``P`` held its transaction id before ``P`` was
taken (it wrote its mirrored row, then the trigger took the position) and had not
committed when the reader's snapshot was taken (else its entry would have been visible).
PostgreSQL lists such a transaction in ``xip`` only when its id is below ``xmax`` (one past
the newest transaction *completed* at the snapshot); one with a newer id is just as much
in progress but not listed, and it can hold a position below ``P``: it took its position,
an older transaction took a higher one and committed, and nothing newer had completed yet.
So the next read asks for ``position > P OR xid IN xip OR xid >= xmax``
(:func:`read_feed`): it catches every late commit; nothing older can appear. The
``xid >= xmax`` entries are those the snapshot could not see, so nothing is read twice,
but for the reader's own transaction, whose entries it saw (in a test, everything may be
one transaction): those are left to the position rule, as the ``xip`` list leaves them.
(A transaction that had no id yet at the read takes positions above ``P``.) Pruning keeps
the same entries for every live reader (:func:`prune_feed`). SQLite runs one writer at a
time, so positions commit in order and ``position > P`` suffices.
``tests/runtime/test_feed.py`` proves the late commit with two connections,
``tests/runtime/test_freshness_late_commit.py`` the one above ``xmax``.

**Gaps** (the reader must rebuild): the feed went backwards (its highest position is
below ours), the entry at our mark is gone or another (the feed was reset, or pruned past
us), or a ``T`` entry records a TRUNCATE.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from django.db import connection
from django.db.models import Q

from binder import models

#: One feed entry: (position, kind, object id or None, op).
Entry = tuple[int, str, int | None, str]


class FeedGap(Exception):
    """The reader cannot prove it saw every change: read everything again (the message says why)."""


@dataclass(frozen=True, slots=True)
class OwnWrites:
    """The feed entries a pass's own status writes produced: the writer's state already
    holds what they would re-read, so the next catch-up skips them instead of re-reading
    every row the pass wrote (26k after 10k new orders)."""

    xid: int | None
    """The pass's transaction id (PostgreSQL); None on SQLite, which runs one writer at a time."""
    after: int
    upto: int
    """The entries are those of ``xid`` at positions in (after, upto]: nothing else of the
    pass's transaction is written between the two reads (:func:`own_feed_position`)."""

    def covers(self, position: int, xid: int | None) -> bool:
        return self.after < position <= self.upto and xid == self.xid


def own_feed_position() -> tuple[int | None, int]:
    """(This transaction's id on PostgreSQL, the highest feed position it has written.)

    On SQLite the writer holds the database's write lock from its first write (the pass
    has written its PassRun by then), so every position taken meanwhile is its own.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT x.id, coalesce((SELECT max(position) FROM binder_change WHERE xid = x.id), 0)"
                " FROM (SELECT pg_current_xact_id()::text::bigint AS id) AS x"
            )
            xid, top = cursor.fetchone()
            return int(xid), int(top)
        cursor.execute("SELECT coalesce(max(position), 0) FROM binder_change")
        return None, int(cursor.fetchone()[0])


@dataclass(frozen=True, slots=True)
class FeedRead:
    """One read of the change feed."""

    top: int
    top_mark: str
    mark: str
    """The token of the entry at the reader's mark ("" when there is none)."""
    horizon: tuple[int, ...]
    """PostgreSQL: the snapshot's in-progress transaction ids, then its xmax (see the module doc)."""
    entries: list[Entry]

    def ids_by_kind(self) -> dict[str, set[int]]:
        """The object ids the entries name, by kind (an entry applied twice reads one row)."""
        by_kind: dict[str, set[int]] = defaultdict(set)
        for _, kind, object_id, _ in self.entries:
            if object_id is not None:
                by_kind[kind].add(object_id)
        return by_kind


def frontier(horizon: Sequence[int]) -> int | None:
    """The lowest transaction id a horizon holds whole: its last element, the snapshot's
    xmax (the in-progress ids before it are all below it); None for an empty horizon."""
    return max(horizon) if horizon else None


def listed(horizon: Sequence[int]) -> list[int]:
    """The transaction ids a horizon lists below its frontier (the frontier itself is
    held by the ``xid >= xmax`` rule, which leaves the reader's own transaction out)."""
    top = frontier(horizon)
    return sorted({int(x) for x in horizon if int(x) != top})


def read_feed(position: int | None, horizon: Sequence[int], mark_at: int, skip: OwnWrites | None = None) -> FeedRead:
    """The feed's top, the entries after ``position`` (and of ``horizon``'s transactions),
    less ``skip``, and, on PostgreSQL, the snapshot's horizon: one statement, so one
    snapshot. ``position=None``: the top only (a reader about to read every row)."""
    at = position if position is not None else -1
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The pass's own entries are left out in the statement, not after it: after 10k
            # new orders they are 26k rows that would cross the wire only to be dropped.
            # Without them, (NULL, 0, 0) keeps every row.
            own = (skip.xid, skip.after, skip.upto) if skip is not None and skip.xid is not None else (None, 0, 0)
            cursor.execute(
                "SELECT s.top, s.top_mark, s.mark, s.horizon, c.position, c.kind, c.object_id, c.op, c.xid FROM"
                " (SELECT coalesce((SELECT max(position) FROM binder_change), 0) AS top,"
                " (SELECT token FROM binder_change ORDER BY position DESC LIMIT 1) AS top_mark,"
                " (SELECT token FROM binder_change WHERE position = %s) AS mark,"
                " ARRAY(SELECT x::text::bigint FROM pg_snapshot_xip(pg_current_snapshot()) AS x)"
                " || pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS horizon) AS s"
                " LEFT JOIN binder_change AS c ON (c.position > %s OR c.xid = ANY(%s::bigint[])"
                " OR c.xid >= %s AND c.xid IS DISTINCT FROM pg_current_xact_id_if_assigned()::text::bigint)"
                " AND %s AND (c.xid IS DISTINCT FROM %s OR c.position <= %s OR c.position > %s)"
                " ORDER BY c.position",
                [mark_at, at, listed(horizon), frontier(horizon), position is not None, *own],
            )
            rows = cursor.fetchall()
            first = rows[0]
            return FeedRead(
                top=int(first[0]),
                top_mark=first[1] or "",
                mark=first[2] or "",
                horizon=tuple(int(x) for x in first[3]),
                entries=[
                    (r[4], r[5], r[6], r[7])
                    for r in rows
                    if r[4] is not None and not (skip is not None and skip.covers(r[4], r[8]))
                ],
            )
        cursor.execute(
            "SELECT coalesce((SELECT max(position) FROM binder_change), 0),"
            " (SELECT token FROM binder_change ORDER BY position DESC LIMIT 1),"
            " (SELECT token FROM binder_change WHERE position = %s)",
            [mark_at],
        )
        top, top_mark, found = cursor.fetchone()
        entries: list[Entry] = []
        if position is not None:
            cursor.execute(
                "SELECT position, kind, object_id, op FROM binder_change WHERE position > %s ORDER BY position",
                [position],
            )
            entries = [tuple(r) for r in cursor.fetchall() if not (skip is not None and skip.covers(r[0], None))]
        return FeedRead(top=int(top), top_mark=top_mark or "", mark=found or "", horizon=(), entries=entries)


@dataclass(slots=True)
class FeedCursor:
    """Where a reader stands in the feed, and the proof that nothing before it was missed."""

    position: int = 0
    horizon: tuple[int, ...] = ()
    """PostgreSQL: the transactions in progress at the last read, then its xmax (see the module doc)."""
    mark: str = ""
    """The random token of the entry at ``mark_at``: a reset feed has another there (or none)."""
    mark_at: int = 0
    """The position of that entry: ``position``, or an anchor above it (see :meth:`advance`)."""
    pruned: int = 0
    """Entries below this position were deleted by this reader's own pruning."""
    anchor_name: str = field(default="", repr=False)
    """Written on an anchor entry (the reader's name), for whoever reads the feed table."""

    def start(self) -> FeedRead:
        """The feed's top before a full read of the rows (read first: a change committed
        between the two reads is then applied again by the next :meth:`follow`, never lost)."""
        return read_feed(None, (), 0)

    def follow(self, skip: OwnWrites | None = None) -> FeedRead:
        """The entries not seen yet (less ``skip``); :class:`FeedGap` when that cannot be proven.

        The cursor does not move: the caller applies the entries, then calls :meth:`advance`.
        """
        feed = read_feed(self.position, self.horizon, self.mark_at, skip)
        if feed.top < self.position:
            raise FeedGap(f"the change feed went backwards (position {feed.top} < {self.position})")
        if feed.mark != self.mark:
            # The entry at our mark is gone or another: the feed was reset (its sequence
            # restarted) or pruned past us, so entries we never saw may be missing.
            raise FeedGap(f"the change feed's entry at position {self.mark_at} is gone or changed")
        if any(op == models.ChangeOp.TRUNCATE for _, _, _, op in feed.entries):
            raise FeedGap("a mirrored table or the change feed was truncated")
        return feed

    def advance(self, feed: FeedRead) -> None:
        """Stand at ``feed``'s top, keeping the token of the newest entry as the mark.

        On an empty feed an anchor entry is written to keep: without an entry to check, a
        feed emptied and refilled below our position (or emptied of entries we never read)
        would look unchanged. The anchor's position may be above entries not read yet, so
        it is only the mark: reading goes on from ``position``.
        """
        self.position, self.horizon = feed.top, feed.horizon
        if feed.top:
            self.mark, self.mark_at = feed.top_mark, feed.top
            return
        anchor = models.Change.objects.create(
            kind="*", op=models.ChangeOp.ANCHOR, name=self.anchor_name[:253], token=uuid.uuid4().hex
        )
        self.mark, self.mark_at = anchor.token, anchor.position


def prune_feed(floor: int, horizons: Iterable[Sequence[int]]) -> int:
    """Delete the entries below ``floor`` (the lowest position of every live reader) but
    those of transactions in any of their ``horizons`` (listed, or at or above its xmax):
    a reader may still have to read them. Returns how many were deleted."""
    kept: set[int] = set()
    lowest: int | None = None
    for horizon in horizons:
        ids = [int(x) for x in horizon]
        kept.update(listed(ids))
        top = frontier(ids)
        if top is not None:
            lowest = top if lowest is None else min(lowest, top)
    doomed = models.Change.objects.filter(position__lt=floor).exclude(xid__in=sorted(kept))
    if lowest is not None:
        # The pruner's own entries below the floor are not a reader's late commit (the
        # position rule covers them, as ``read_feed`` leaves them).
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_xact_id_if_assigned()::text::bigint")
            own = cursor.fetchone()[0]
        doomed = doomed.exclude(Q(xid__gte=lowest) & ~Q(xid=own))
    deleted, _ = doomed.delete()
    return deleted

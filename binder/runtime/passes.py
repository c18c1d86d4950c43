"""Run a binder pass against the database: catch up, decide, write what changed.

A pass is one transaction under the cluster-wide pass lock (``binder.runtime.locking``):
inside it, after taking the lock, the worker's in-memory state is brought current from
the change feed (``binder.runtime.state``; everything is read again when that cannot be
proven), so units booked by the previous pass, whichever worker ran it, are always
seen. The engine visits only the sets that can change; the pass writes only the devices
whose fields changed (never ``bind_request``, which belongs to the webhook), one
decision row per placement change, the class and budget status that changed, and the
usage records of the subjects that changed. In cluster mode the status goes to the API
server first (``binder.runtime.cluster``). If anything fails the whole pass rolls back,
the state is dropped, and the next pass reads everything again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from psycopg.types.json import Jsonb

from binder import apiserver, models
from binder.engine import PassResult, answer_pass, full_pass
from binder.engine import types as e
from binder.engine.making_room import MADE_ROOM, ROOM_REFUSED
from binder.engine.usage import Subjects
from binder.mirror.read import engine_settings
from binder.runtime import admissions, checkpoint, cluster
from binder.runtime.answers import notify_answers
from binder.runtime.bind_requests import ANSWER_COLUMNS, record_answers
from binder.runtime.feed import OwnWrites, own_feed_position
from binder.runtime.locking import pass_lock
from binder.runtime.mirror_state import Catchup
from binder.runtime.state import STATE, ClusterState, StatusWritten
from binder.runtime.usage_records import record_usage
from binder.runtime.verify import compare_lending, compare_records, compare_results

log = logging.getLogger(__name__)

#: From this many devices a state read whole is frozen out of the cyclic collector.
FREEZE_AT_DEVICES = 50_000
#: The binder_decision columns a pass COPYs, as PostgreSQL types (binary COPY).
DECISION_TYPES = ("int8", "varchar", "varchar", "varchar", "varchar", "varchar", "varchar", "varchar", "text",
                  "varchar", "timestamptz")  # fmt: skip
#: The columns of the device writes a pass COPYs (see ``_write_postgresql``).
DEVICE_WRITE_TYPES = ("int8", "varchar", "varchar", "timestamptz", "text", "varchar", "text", "varchar", "bool",
                      "varchar", "varchar")  # fmt: skip
#: A phase's value without the enum's descriptor (26k lookups for 10k new orders).
PHASE_VALUES = {phase: phase.value for phase in e.Phase}
#: From this many changed devices a pass writes them through COPY (``_copy_device_writes``).
COPY_DEVICES_FROM = 2000
#: A large pass's work_mem per changed device (KiB), within these bounds (MiB): see ``large_update_settings``.
WORK_MEM_PER_DEVICE_KIB = 1
WORK_MEM_MIB = (16, 128)
#: Back to the configured values after a large pass's device UPDATE (see ``large_update_settings``).
LARGE_UPDATE_SETTINGS_RESET = (
    "SET LOCAL work_mem TO DEFAULT; SET LOCAL jit TO DEFAULT; SET LOCAL random_page_cost TO DEFAULT"
)
#: The device UPDATE of a pass, from a source ``v`` of the written fields (``FROM`` follows).
DEVICE_UPDATE = (
    "UPDATE binder_gpudevice AS d SET phase = v.phase, node = v.node, since = v.since, reason = v.reason,"
    " answered_request = v.answered_request, answer = v.answer, status_class_name = v.held_as,"
    " borrowed = v.borrowed, reclaim_for = v.reclaim_for, reason_code = v.reason_code FROM "
)
#: A large pass's device UPDATE, from the rows it COPYed (``_copy_device_writes``).
DEVICE_UPDATE_FROM_COPY = DEVICE_UPDATE + "gpuplane_device_writes AS v WHERE d.id = v.id"
#: The table of the transaction a large pass COPYs its device writes into.
DEVICE_WRITES_TABLE = (
    "CREATE TEMP TABLE gpuplane_device_writes (id bigint, phase varchar, node varchar, since timestamptz,"
    " reason text, answered_request varchar, answer text, held_as varchar, borrowed boolean, reclaim_for varchar,"
    " reason_code varchar) ON COMMIT DROP"
)
#: The fields a pass may write on a device: its placement and its answer to a bind request
#: (``bind_requests.ANSWER_COLUMNS``), never a column of the request itself (``REQUEST_COLUMNS``).
PLACEMENT_FIELDS = (
    "phase",
    "node",
    "since",
    "reason",
    *ANSWER_COLUMNS,
    "status_class_name",
    "borrowed",
    "reclaim_for",
    "reason_code",
)

ENGINES: dict[str, Callable[..., PassResult]] = {
    models.PassKind.FULL: full_pass,
    models.PassKind.ANSWER: answer_pass,
}


def run_pass(
    kind: str = models.PassKind.FULL, state: ClusterState | None = None, triggered_by: str = "direct"
) -> models.PassRun:
    """Run one pass of ``kind`` (``full`` or ``answer``) and return its record.

    ``state`` is the worker's in-memory view (default: this process's); any failure drops
    it, so the next pass reads everything again. ``triggered_by`` is
    kept on the record for the audit trail ("direct": called in-process, not queued).
    """
    state = state if state is not None else STATE
    with state.lock:
        try:
            return _run_pass(kind, state, triggered_by)
        except BaseException:
            state.invalidate("the previous pass failed or rolled back")
            raise


def _run_pass(kind: str, state: ClusterState, triggered_by: str) -> models.PassRun:
    clock = time.perf_counter()
    with transaction.atomic(), pass_lock(), _no_cyclic_gc():
        now = timezone.now()
        run = models.PassRun(kind=kind, started=now, worker=state.worker, triggered_by=triggered_by[:160])
        options = engine_settings()
        ledger_used = False
        # Cluster mode, before the catch-up: a note is committed with its row's deletion
        # (binder.runtime.cluster), so the catch-up applies every deletion noted here.
        releasing = cluster.releases_due() if apiserver.cluster_mode() and kind == models.PassKind.FULL else []
        # Cluster mode too: the sync keeps the mirror current and the feed brings this
        # state current; the pass's own writes are mirrored by write_status.
        catch = state.catch_up(kind, load=checkpoint.load)
        run.view, run.rows_read, run.feed_position = catch.view, catch.rows_read, state.position
        run.dirty_sets = len(catch.dirty_sets)
        # What the pass saw: the whole state for a full pass (the usage step reads its
        # classes and pods), only the requested sets for an answer pass.
        snapshot, ids = _view(kind, state, now, options), state.device_ids
        result, ledger_used, unchanged = _decide(kind, state, catch, snapshot)
        if unchanged:
            run.view = "unchanged"
        if catch.view != "rebuilt" and _verification_due(state):
            result, ledger_used, run.verify_mismatches = _verify(kind, state, now, options, result)
            snapshot, ids = _view(kind, state, now, options), state.device_ids
            run.feed_position = state.position
            # A mismatch means the feed's list of changed subjects cannot be trusted either.
            catch.since_rebuild = catch.since_rebuild or bool(run.verify_mismatches)
        if settings.GPUPLANE_FAULT_PASS_DELAY_SECONDS:
            time.sleep(settings.GPUPLANE_FAULT_PASS_DELAY_SECONDS)
        run.devices_seen = len(state.records["GPU"]) if kind == models.PassKind.FULL else len(snapshot.devices)
        run.save()
        if not snapshot.settings.enabled:
            run.skipped = "GPUPLANE_ENABLED is false: nothing placed, moved or answered"
        if apiserver.cluster_mode():
            result, run.writes_failed = cluster.write_status(result, state)
        else:
            # Standalone the rows are the objects: a set whose first member the webhook admitted
            # a VMI to since the catch-up stays where it is (binder.runtime.admissions).
            result, run.writes_failed = admissions.hold_first_members(result, state)
        keeping = _Bookkeeping(kind, state, catch, result, ledger_used, snapshot, now, options)
        own_writes = _write_own(run, result, ids, state, keeping)
        if kind == models.PassKind.FULL:
            # Full passes only, and with the feature off too: deleted
            # devices and classes always get their usage records closed.
            written = record_usage(run.pk, now, keeping.snapshot, result.devices, keeping.subjects)
            run.records_opened, run.records_closed = written.opened, written.closed
            state.prune()
        run.finished = timezone.now()
        run.duration_ms = (time.perf_counter() - clock) * 1000
        run.save()
        if result.answered:
            notify_answers(run.pk)
    state.passed(kind, now, options, result, own_writes, pass_id=run.pk)
    _after_a_whole_read(state, run, catch.view)
    if run.writes_failed:
        state.refused_writes()
    if releasing:
        # After commit: the released devices' usage records are closed for good.
        run.finalizers_released = cluster.release_finalizers(releasing)
        run.save(update_fields=["finalizers_released"])
    log.info(
        "%s pass %s (%s view, %d rows read, %d dirty sets): %d devices, %d written, bound=%d moved=%d lost=%d"
        " refused=%d restored=%d, usage records +%d -%d, in %.1f ms",
        kind,
        run.pk,
        run.view,
        run.rows_read,
        run.dirty_sets,
        run.devices_seen,
        run.devices_written,
        run.bound,
        run.moved,
        run.lost,
        run.refused,
        run.restored,
        run.records_opened,
        run.records_closed,
        run.duration_ms,
    )
    return run


@dataclasses.dataclass(slots=True)
class _Bookkeeping:
    """What the state keeps of a pass, worked out while the database writes it
    (``write_result``): the usage subjects and, for a full reconciliation, the snapshot
    of every device, both of the devices as they were; then the result into the state."""

    kind: str
    state: ClusterState
    catch: Catchup
    result: PassResult
    ledger_used: bool
    snapshot: e.Cluster
    now: datetime
    options: e.Settings
    subjects: Subjects = dataclasses.field(default_factory=Subjects)

    def __call__(self) -> None:
        if self.kind == models.PassKind.FULL:
            self.subjects = self.state.usage_subjects(self.catch, self.result)
            if self.subjects.everything:
                self.snapshot = self.state.cluster(self.now, self.options)  # every device: a full reconciliation
        self.state.apply_result(self.result, self.ledger_used)


def _after_a_whole_read(state: ClusterState, run: models.PassRun, view: str) -> None:
    """After a pass whose state was read whole (rebuilt, verified or loaded).

    A large state's long-lived objects leave the cyclic collector's reach (they hold no
    cycles): else a full collection between two passes scans them all, seconds at a
    million devices, landing in some pass. (Small states are left alone: freezing also
    keeps any cyclic garbage of the moment for good.) A state read from scratch is saved as the
    checkpoint (after the pass committed: the pass's own writes are re-read by whoever
    replays the feed from it); a failure costs only the checkpoint.
    """
    verified = run.verify_mismatches is not None
    if (verified or view in ("rebuilt", "checkpoint")) and len(state.device_ids) >= FREEZE_AT_DEVICES:
        gc.freeze()
    if verified or view == "rebuilt":
        try:
            checkpoint.save(state, "after a verification" if verified else "after a rebuild")
        except Exception:
            log.exception("saving a checkpoint failed; the previous one stays")


def _write_own(
    run: models.PassRun,
    result: PassResult,
    ids: dict[tuple[str, str], int],
    state: ClusterState,
    meanwhile: Callable[[], None],
) -> OwnWrites:
    """``write_result``, noting which feed entries the writes made: the worker's state
    holds them after the pass (see :class:`~binder.runtime.feed.OwnWrites`)."""
    _, after = own_feed_position()
    if state.borrowed_written is not None:
        written = state.borrowed_written
        result = dataclasses.replace(
            result, budget_borrowed={k: v for k, v in result.budget_borrowed.items() if written.get(k) != v}
        )
    write_result(run, result, ids, state.status_written, meanwhile)
    xid, upto = own_feed_position()
    return OwnWrites(xid=xid, after=after, upto=upto)


def _view(kind: str, state: ClusterState, now: datetime, options: e.Settings) -> e.Cluster:
    """What the engine is given. A full pass gets the state's ledger and the scope of
    sets to visit, so it reads no device from the snapshot: the tuple of every device
    (a million at the largest scale) is built only when the usage step reconciles all."""
    if kind == models.PassKind.ANSWER:
        return state.requested(now, options)
    return state.cluster(now, options, with_devices=False)


def _decide(kind: str, state: ClusterState, catch: Catchup, snapshot: e.Cluster) -> tuple[PassResult, bool, bool]:
    """The engine's result on ``snapshot`` (the pass's :func:`_view` of the state), whether
    it moved the state's ledger and whether the engine was skipped.

    A full pass with nothing changed since a full pass that changed nothing is proven to
    change nothing again (``unchanged_since_last_full_pass``) and skips the engine. An
    answer pass gives the engine only the requested sets and the ledger of everything.
    """
    if kind == models.PassKind.ANSWER:
        return ENGINES[kind](snapshot, state.ledger(), state.node_cache), True, False
    same = state.unchanged_since_last_full_pass(catch, snapshot.now, snapshot.settings)
    if same is not None:
        return same, False, True
    scope = state.scope(catch)
    return ENGINES[kind](snapshot, state.ledger(), state.node_cache, scope=scope), True, False


def _verification_due(state: ClusterState) -> bool:
    every = settings.GPUPLANE_VERIFY_SECONDS
    return time.monotonic() - state.verified_at >= every


def _verify(
    kind: str, state: ClusterState, now: datetime, options: e.Settings, mine: PassResult
) -> tuple[PassResult, bool, int]:
    """Rebuild the view from scratch, run the pass again on it and compare.

    Differences are logged with the objects and counted on the PassRun (the metric
    ``gpuplane_verify_mismatches_total`` sums them); the pass goes on with the rebuilt
    state and its result either way.
    """
    scratch = ClusterState()
    scratch.rebuild("verification")
    fresh_engine = ENGINES[kind]
    if kind == models.PassKind.ANSWER:
        theirs = fresh_engine(scratch.requested(now, options), scratch.ledger())
    else:
        theirs = fresh_engine(scratch.cluster(now, options), scratch.ledger())
    problems = compare_records(state, scratch) + compare_results(mine, theirs)
    problems += compare_lending(state.ledger(), scratch.ledger())
    for problem in problems:
        log.error("verification: %s", problem)
    if problems:
        log.error("verification found %d differences; continuing from the rebuilt state", len(problems))
    state.adopt(scratch)
    state.verified_at = time.monotonic()
    return theirs, True, len(problems)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a pass.

    A pass allocates a few hundred thousand small records that live until it ends and
    form no cycles; the collector would rescan them again and again (~15% of the engine's
    time at 100k devices). Reference counting still frees everything at once afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def write_result(
    run: models.PassRun,
    result: PassResult,
    ids: dict[tuple[str, str], int],
    status_written: StatusWritten | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Write the changed devices, the decisions and the status of classes and budgets.

    ``meanwhile`` (work without the database) runs while PostgreSQL executes a large
    pass's device and decision writes: see :func:`_beside`.

    ``status_written``, the class and budget status this worker's last committed full pass
    wrote, leaves out what is the same again: a pass that moved one set writes the one
    budget it changed, not all of them (a rebuilt state has none, and writes everything
    that differs from the rows).

    On PostgreSQL each table takes one set-based statement (``UPDATE ... FROM unnest``,
    ``COPY``): a pass that binds 10k sets writes ~26k devices, and Django's
    ``bulk_update`` (one CASE per row and field) took 20 s for that against 0.8 s here.
    """
    changed = [(ids[d.key], d) for d in result.devices if d.key in ids]
    if status_written is not None:
        classes, budgets = status_written
        result = dataclasses.replace(
            result,
            class_status={k: v for k, v in result.class_status.items() if classes.get(k) != v},
            budget_used={k: v for k, v in result.budget_used.items() if budgets.get(k) != v},
        )
    if connection.vendor == "postgresql":
        _write_postgresql(run, result, changed, meanwhile or _nothing)
    else:
        _write_portable(run, result, changed)
        if meanwhile is not None:
            meanwhile()
    for name, status in result.class_status.items():
        models.GpuClass.objects.filter(name=name).exclude(
            status_allocatable=status.allocatable, status_bound=status.bound, status_lost=status.lost
        ).update(status_allocatable=status.allocatable, status_bound=status.bound, status_lost=status.lost)
    record_answers(run, result, ids)
    run.devices_written = len(changed)
    for outcome in e.Outcome:
        setattr(run, outcome.value, result.counts.get(outcome.value, 0))
    run.made_room = result.counts.get(MADE_ROOM, 0)
    run.room_refused = result.counts.get(ROOM_REFUSED, 0)


def held_as(device: e.Device) -> str:
    """``status.className``: the class a Bound or Lost device is held as; empty while Pending."""
    return device.class_name if device.held else ""


def _write_postgresql(
    run: models.PassRun, result: PassResult, changed: list[tuple[int, e.Device]], meanwhile: Callable[[], None]
) -> None:
    """One statement per table. The arrays go as binary parameters of a server-side
    binding cursor (``%b``) on the pass's connection: Django's client-side binding
    quotes every element as text in Python, 2.5 times slower for the 26k devices of
    10k new orders."""
    with connection.cursor() as cursor:
        raw = cursor.cursor  # psycopg's own cursor: COPY
        copied = len(changed) >= COPY_DEVICES_FROM and _copy_device_writes(raw, changed)
        statements = functools.partial(_write_statements, raw.connection, run, result, changed, copied)
        if copied:
            _beside(statements, meanwhile)
        else:
            meanwhile()
            statements()


def _write_statements(
    pg: psycopg.Connection[Any],
    run: models.PassRun,
    result: PassResult,
    changed: list[tuple[int, e.Device]],
    copied: bool,
) -> None:
    """The device UPDATE (from the COPYed table when ``copied``), the decisions and the
    budgets, through psycopg only (they may run in a thread of their own: Django's
    connection handle belongs to the pass's thread)."""
    with pg.cursor() as raw, psycopg.Cursor(pg) as binary:
        large = len(changed) >= COPY_DEVICES_FROM
        if large:
            raw.execute(large_update_settings(len(changed)))
        if copied:
            raw.execute(DEVICE_UPDATE_FROM_COPY)
            raw.execute("DROP TABLE gpuplane_device_writes")
        else:
            _update_devices_by_unnest(binary, changed)
        if large:
            raw.execute(LARGE_UPDATE_SETTINGS_RESET)
        if result.changes:
            with raw.copy(
                "COPY binder_decision (pass_run_id, namespace, vm_name, device_name, from_phase, from_node,"
                " to_phase, to_node, reason, reason_code, created) FROM STDIN (FORMAT BINARY)"
            ) as copy:
                # Binary rows: psycopg's C dumpers write them, a third of the text format's time.
                copy.set_types(DECISION_TYPES)
                for c in result.changes:
                    copy.write_row(
                        (
                            run.pk,
                            c.namespace,
                            c.vm_name,
                            c.name,
                            PHASE_VALUES[c.from_phase],
                            c.from_node,
                            PHASE_VALUES[c.to_phase],
                            c.to_node,
                            c.reason,
                            c.reason_code,
                            run.started,
                        )
                    )
        # Each budget's used and borrowed units, by (namespace, name): one statement a column.
        for column, per_budget in (("used", result.budget_used), ("borrowed", result.budget_borrowed)):
            if per_budget:
                items = list(per_budget.items())
                binary.execute(
                    f"UPDATE binder_gpubudget AS b SET {column} = v.units FROM binder_namespace AS n,"  # noqa: S608 - a fixed column name
                    " unnest(%b::text[], %b::text[], %b::jsonb[]) AS v(ns, name, units)"
                    " WHERE n.id = b.namespace_id AND n.name = v.ns AND b.name = v.name"
                    f" AND b.{column} IS DISTINCT FROM v.units",
                    [[k[0] for k, _ in items], [k[1] for k, _ in items], [Jsonb(dict(u)) for _, u in items]],
                )


def _beside(database: Callable[[], None], meanwhile: Callable[[], None]) -> None:
    """Run ``database`` in a thread while ``meanwhile`` runs in this one.

    A large pass's writes are PostgreSQL's work (26k devices: 0.6 s of the server's time
    against 0.05 s of this process's), and the state's bookkeeping is this process's
    alone; on two cores they overlap. The thread waits on the socket without the GIL.
    Nothing else uses the connection meanwhile (``meanwhile`` reads no database), and
    psycopg serialises a connection's statements anyway. A failure on either side fails
    the pass, after both ended (never a rollback under a running statement).
    """
    failed: list[BaseException] = []

    def run() -> None:
        try:
            database()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the pass's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="gpuplane-pass-writes", daemon=True)
    thread.start()
    try:
        meanwhile()
    finally:
        thread.join()
    if failed:
        raise failed[0]


def _nothing() -> None:
    """No work beside the writes."""


def large_update_settings(devices: int) -> str:
    """The planner and executor settings of a large pass's device UPDATE (``SET LOCAL``,
    undone right after it by :data:`LARGE_UPDATE_SETTINGS_RESET`: the usage records'
    statements after it keep their own plans).

    ``work_mem``: the feed trigger gets every old and new row as transition tables and
    joins them; at the default 4 MB both spilled to temporary files and the join sorted on
    disk (26k devices: the UPDATE 480-570 ms, 375-440 ms with the room). ``jit`` off: the
    trigger's row estimates are guesses (3M rows for 26k) and compiling its plan cost more
    than it saved. ``random_page_cost``: each written row looked up by its key instead of
    the whole table hashed; priced for disks (4), 260k key lookups looked dearer than
    reading all 1M devices, which took 0.8-1.3 s of the UPDATE's 6.4-7 s against 0.35 s
    for the lookups (the catch-up has just read those rows and their index). The
    trigger's own join has no index to choose, so it is not affected.
    """
    low, high = WORK_MEM_MIB
    mib = min(high, max(low, devices * WORK_MEM_PER_DEVICE_KIB // 1024))
    return f"SET LOCAL work_mem = '{int(mib)}MB'; SET LOCAL jit = off; SET LOCAL random_page_cost = 1.1"


def _update_devices_by_unnest(binary: psycopg.Cursor[Any], changed: list[tuple[int, e.Device]]) -> None:
    """The device UPDATE in one statement, the fields bound as arrays."""
    if not changed:
        return
    binary.execute(
        DEVICE_UPDATE + "unnest(%b::bigint[], %b::varchar[], %b::varchar[], %b::timestamptz[], %b::text[],"
        " %b::varchar[], %b::text[], %b::varchar[], %b::boolean[], %b::varchar[], %b::varchar[])"
        " AS v(id, phase, node, since, reason, answered_request, answer, held_as, borrowed, reclaim_for, reason_code)"
        " WHERE d.id = v.id",
        [
            [i for i, _ in changed],
            [d.phase.value for _, d in changed],
            [d.node for _, d in changed],
            [d.since for _, d in changed],
            [d.reason for _, d in changed],
            [d.answered_request for _, d in changed],
            [d.answer for _, d in changed],
            [held_as(d) for _, d in changed],
            [d.borrowed for _, d in changed],
            [d.reclaim_for for _, d in changed],
            [d.reason_code for _, d in changed],
        ],
    )


def _copy_device_writes(raw: psycopg.Cursor[Any], changed: list[tuple[int, e.Device]]) -> bool:
    """A large pass's device writes go in by binary COPY (psycopg's C dumpers) into a
    table of the transaction, which one UPDATE then joins (``_write_statements``).
    Binding them as eight array parameters took 2.5 times as long for the 26k devices of
    10k new orders (psycopg's array dumper is Python, a value at a time); a small pass
    keeps the single statement (creating the table costs a few catalog writes).

    False when the database user may not create temporary tables (``TEMP`` revoked): the
    caller writes through the single statement instead, and the pass goes on.
    """
    try:
        with transaction.atomic():  # a savepoint: the refusal must not abort the pass's transaction
            raw.execute(DEVICE_WRITES_TABLE)
    except psycopg.errors.InsufficientPrivilege as exc:
        log.warning("no temporary table for the device writes (%s); writing them in one statement", exc)
        return False
    with raw.copy("COPY gpuplane_device_writes FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(DEVICE_WRITE_TYPES)
        for row_id, d in changed:
            phase = PHASE_VALUES[d.phase]
            copy.write_row(
                (row_id, phase, d.node, d.since, d.reason, d.answered_request, d.answer, held_as(d), d.borrowed,
                 d.reclaim_for, d.reason_code)
            )  # fmt: skip
    return True


def _write_portable(run: models.PassRun, result: PassResult, changed: list[tuple[int, e.Device]]) -> None:
    """The same writes through the ORM (SQLite, the embedded default)."""
    rows = [
        models.GpuDevice(
            id=row_id,
            phase=d.phase.value,
            node=d.node,
            since=d.since,
            reason=d.reason,
            answered_request=d.answered_request,
            answer=d.answer,
            status_class_name=held_as(d),
            borrowed=d.borrowed,
            reclaim_for=d.reclaim_for,
            reason_code=d.reason_code,
        )
        for row_id, d in changed
    ]
    models.GpuDevice.objects.bulk_update(rows, PLACEMENT_FIELDS, batch_size=1000)
    models.Decision.objects.bulk_create(
        [
            models.Decision(
                pass_run=run,
                namespace=c.namespace,
                vm_name=c.vm_name,
                device_name=c.name,
                from_phase=c.from_phase.value,
                from_node=c.from_node,
                to_phase=c.to_phase.value,
                to_node=c.to_node,
                reason=c.reason,
                reason_code=c.reason_code,
                created=run.started,
            )
            for c in result.changes
        ],
        batch_size=1000,
    )
    if result.budget_used or result.budget_borrowed:
        for budget in models.GpuBudget.objects.select_related("namespace"):
            used = result.budget_used.get((budget.namespace.name, budget.name))
            if used is not None and budget.used != dict(used):
                models.GpuBudget.objects.filter(pk=budget.pk).update(used=dict(used))
            borrowed = result.budget_borrowed.get((budget.namespace.name, budget.name))
            if borrowed is not None and budget.borrowed != dict(borrowed):
                models.GpuBudget.objects.filter(pk=budget.pk).update(borrowed=dict(borrowed))

"""Checkpoints of the pass worker's state, so a start does not read every mirrored row.

A worker that cannot prove its in-memory state current (a new process; its place in the
change feed no longer recorded; its last pass rolled back) used to read the whole mirror
again: minutes at the largest scale, with every answer waiting. Instead it loads the
newest checkpoint (the records, the ledger and the node cache, saved with the feed
position they are current to) and replays the feed after it, like any catch-up.

**Sound because** the feed cannot miss a change: every row changed after the saved
position has an entry after it (or in a transaction of the saved horizon), and applying
an entry re-reads the current row. Records saved *ahead* of the position (the saving
pass's own writes) are re-read too, so they end current either way. The checkpoint's
entries are kept from pruning by a ``FeedReader`` row of its own (``READER``), written
with it; that row is forgotten after ``GPUPLANE_FEED_RETENTION_SECONDS`` like any
reader's, and then the checkpoint is refused: its entries may be gone.

**Refused** (a log line, then the usual rebuild): none saved; another schema version or
record layout (a field added to an engine record); a checksum that does not match or
data that does not unpickle (corrupt); its reader row gone or belonging to another
checkpoint (older than the feed's retention). A replay that meets a gap in the feed
rebuilds as any catch-up does.

**Written** after each verification or rebuild (the state was just read from scratch)
and on a clean worker shutdown, in one transaction that also replaces the reader row
and deletes the older checkpoints: a writer killed half way leaves the previous one
whole and usable. A pass on a large state saves it in the background, from a forked
child holding the state of that instant with its feed position (see
:func:`_save_in_child`): the passes after it do not wait for the save. The data is a
zlib-compressed pickle with a sha256 checksum: it is written and read only by this
program, from its own database table.
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import logging
import operator
import os
import pickle
import queue
import signal
import threading
import time
import uuid
import warnings
import zlib
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from binder import models
from binder.engine import types as e
from binder.engine.accounting import Ledger
from binder.engine.placement import NodeCache
from binder.runtime.mirror_state import Catchup
from binder.runtime.state import STATE, ClusterState

log = logging.getLogger(__name__)

#: Bump when the payload's shape changes (its keys, or what a key holds). 3: the ledger keeps
#: its borrowed and marked sets (lending), instance attributes the layout below does not see.
#: 4: it also keeps them by tenant and by resource and node, and repay's memo.
SCHEMA_VERSION = 4
#: The ``FeedReader`` row that keeps the newest checkpoint's feed entries from pruning.
READER = "checkpoint"


#: The record classes a payload holds by the thousand (pickled by :func:`_reducer`).
_RECORDS = (e.Device, e.Node, e.GpuClass, e.Budget, e.Vmi, e.Pod, e.Taint, e.Toleration)


def _layout() -> str:
    """The engine records' field names: a pickle of another layout would unpickle into
    records missing fields, so a change refuses older checkpoints by itself."""
    kinds = (*_RECORDS, Ledger, NodeCache)
    names = ";".join(
        f"{k.__name__}:{','.join(f.name for f in dataclasses.fields(k))}"
        if dataclasses.is_dataclass(k)
        else f"{k.__name__}:{','.join(sorted(vars(k)))}"
        for k in kinds
    )
    return hashlib.sha256(names.encode()).hexdigest()[:16]


SCHEMA = f"{SCHEMA_VERSION}:{_layout()}"


def _reducer(cls: type) -> Any:
    """Pickle a record as its class and its fields in order (a constructor call): the
    default for slotted dataclasses calls a Python ``__getstate__``/``__setstate__`` per
    object, four times slower both ways for a million devices."""
    get = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))
    if len(dataclasses.fields(cls)) == 1:
        return lambda record: (cls, (get(record),))
    return lambda record: (cls, get(record))


_DISPATCH: dict[type, Any] = {**copyreg.dispatch_table, **{cls: _reducer(cls) for cls in _RECORDS}}


class _Deflate:
    """A file the pickler writes into, compressing as it goes: the uncompressed pickle of
    a million devices (hundreds of MiB) never exists whole in memory."""

    def __init__(self) -> None:
        self._zlib = zlib.compressobj(1)
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(self._zlib.compress(data))
        return len(data)

    def close(self) -> bytes:
        self.chunks.append(self._zlib.flush())
        return b"".join(self.chunks)


class _Inflate:
    """The file the unpickler reads from, decompressing as it goes (see :class:`_Deflate`).

    A thread decompresses ahead (zlib lets go of the GIL while it inflates), so a start
    spends the decompression (about a second at 1M devices) beside the unpickling, not
    before it; at most :data:`_AHEAD` chunks wait, so the whole pickle never exists at once.
    """

    _AHEAD = 8
    _CHUNK = 1 << 22

    def __init__(self, data: bytes | memoryview) -> None:
        self._chunks: queue.Queue[bytes | BaseException | None] = queue.Queue(self._AHEAD)
        self._stopped = threading.Event()
        self._done = False
        self._buffer = bytearray()
        self._pos = 0
        self._thread = threading.Thread(target=self._inflate, args=(data,), name="gpuplane-inflate", daemon=True)
        self._thread.start()

    def _inflate(self, data: bytes | memoryview) -> None:
        try:
            inflater = zlib.decompressobj()
            view = memoryview(data)
            at = 0
            while (at < len(view) or inflater.unconsumed_tail) and not self._stopped.is_set():
                chunk = inflater.unconsumed_tail or view[at : at + (1 << 20)]
                if not inflater.unconsumed_tail:
                    at += len(chunk)
                self._put(inflater.decompress(chunk, self._CHUNK))
            self._put(inflater.flush())
            self._put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._put(exc)

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self._stopped.is_set():
            try:
                self._chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _fill(self, wanted: int) -> None:
        while len(self._buffer) - self._pos < wanted and not self._done:
            item = self._chunks.get()
            if item is None:
                self._done = True
            elif isinstance(item, BaseException):
                self._done = True
                raise item
            else:
                del self._buffer[: self._pos]
                self._pos = 0
                self._buffer += item

    def read(self, size: int = -1) -> bytes:
        self._fill(size if size >= 0 else 1 << 62)
        end = len(self._buffer) if size < 0 else self._pos + size
        out = bytes(self._buffer[self._pos : end])
        self._pos += len(out)
        return out

    def readinto(self, target: Any) -> int:
        view = memoryview(target).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        while True:
            newline = self._buffer.find(b"\n", self._pos)
            if newline >= 0:
                return self.read(newline + 1 - self._pos)
            before = len(self._buffer) - self._pos
            self._fill(before + 1)
            if len(self._buffer) - self._pos == before:
                return self.read()


#: Records a payload holds by the hundred thousand, saved as a table ahead of the rest
#: (see :func:`_dumps`).
_TABLED = (e.Device, e.Pod, e.Vmi, e.Node)


class _Pickler(pickle.Pickler):
    """Pickles each record of ``table`` (id -> row number, once it is set) as its row number."""

    table: dict[int, int] | None = None

    def persistent_id(self, obj: Any) -> int | None:
        table = self.table
        return None if table is None else table.get(id(obj))


class _Unpickler(pickle.Unpickler):
    """Reads a row number as the record in ``rows`` (filled after the table is read)."""

    def __init__(self, file: Any, rows: list[Any]) -> None:
        # A C method, bound before __init__ (the unpickler looks it up there): no Python
        # call for each of the millions of references to a record.
        setattr(self, "persistent_load", rows.__getitem__)  # noqa: B010 - mypy: a method
        super().__init__(file)


def _loads(data: bytes | memoryview) -> Any:
    # Our own table, written by save() above; the checksum was checked first.
    source = _Inflate(data)
    try:
        rows: list[Any] = []
        unpickler = _Unpickler(source, rows)
        for cls, columns in unpickler.load():
            rows.extend(map(cls, *columns))
            for column in columns:
                column.clear()  # the unpickler's memo holds the lists until the end
        return unpickler.load()
    finally:
        source.close()


def _dumps(payload: dict[str, Any]) -> bytes:
    """The payload pickled and compressed: first a table of its records of the
    :data:`_TABLED` kinds, one list per field (a start builds them with ``map``), then
    the payload, where each of those records is its row number in the table.

    Pickled one by one, as a constructor and a tuple of its fields, each record left that
    tuple in the unpickler's memo until the whole load ended (1.5M tuples at 1M devices,
    some 250 MB), and the freed tuples left the heap fragmented: a worker started from a
    checkpoint held 400 MB more than one that read the mirror. One pickler writes both
    parts, so the payload refers to the strings and times the table already holds.
    """
    out = _Deflate()
    pickler = _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    of_kind: dict[type, list[Any]] = {cls: [] for cls in _TABLED}
    for records in (payload.get("records") or {}).values():
        for record in records.values():
            listed = of_kind.get(type(record))
            if listed is not None:
                listed.append(record)
    table: dict[int, int] = {}
    head: list[tuple[type, list[list[Any]]]] = []
    for cls, records in of_kind.items():
        rows = []
        for record in records:
            if id(record) not in table:
                table[id(record)] = len(table)
                rows.append(record)
        head.append((cls, [list(map(operator.attrgetter(f.name), rows)) for f in dataclasses.fields(cls)]))
    pickler.dump(head)
    del head
    pickler.table = table
    pickler.dump(payload)
    return out.close()


def save(state: ClusterState, why: str, *, background: bool | None = None) -> models.Checkpoint | None:
    """Save ``state`` (if it is valid) as the newest checkpoint; returns it, or None.

    Call with no pass running on ``state`` (after a pass, or at shutdown). Its own
    transaction: the data, the reader row and the deletion of older checkpoints commit
    together or not at all.

    ``background`` (default: when the caller holds the state's lock, as a pass does
    after it committed, and the state has :data:`BACKGROUND_AT_DEVICES` devices or more)
    saves from a forked child process instead and returns None at once (see
    :func:`_save_in_child`); :func:`wait` waits for it. It needs PostgreSQL and no
    transaction open on the connection (the child writes with a connection of its own);
    otherwise, and in any other call, the save is done here and now (after any save
    still running in the background, which it would otherwise race).
    """
    if not settings.GPUPLANE_CHECKPOINTS:
        return None
    if background is None:
        background = _lock_held(state) and len(state.device_ids) >= BACKGROUND_AT_DEVICES
    if background and _can_fork():
        _save_in_child(state, why)
        return None
    wait()
    clock = time.perf_counter()
    with state.lock:
        if not state.valid:
            return None
        meta = _meta(state)
        data = _dumps({**state.checkpoint_payload(), "schema": SCHEMA})
    return _write(state.worker, why, meta, data, clock)


#: From this many devices a pass's checkpoint is saved in the background (smaller ones
#: take milliseconds: a child process would cost more than it saves).
BACKGROUND_AT_DEVICES = 50_000


@dataclasses.dataclass(slots=True)
class _Meta:
    """What a checkpoint row records beside its data, taken with the data (one moment)."""

    position: int
    horizon: list[int]
    mark: str
    mark_at: int
    reconciled: bool


def _meta(state: ClusterState) -> _Meta:
    cursor = state.cursor
    return _Meta(cursor.position, list(cursor.horizon), cursor.mark, cursor.mark_at, state.nothing_pending())


def _write(worker: str, why: str, meta: _Meta, data: bytes, clock: float, hold: str = "") -> models.Checkpoint:
    """The checkpoint row, the reader row that keeps its entries and the deletion of the
    older checkpoints, in one transaction (which also drops ``hold``, the reader row
    that kept them while a background save ran)."""
    token = uuid.uuid4().hex
    with transaction.atomic():
        row = models.Checkpoint.objects.create(
            worker=worker,
            schema=SCHEMA,
            position=meta.position,
            horizon=meta.horizon,
            mark=meta.mark,
            mark_at=meta.mark_at,
            token=token,
            reconciled=meta.reconciled,
            checksum=hashlib.sha256(data).hexdigest(),
            size=len(data),
            data=data,
        )
        values = {"position": meta.position, "horizon": meta.horizon, "token": token}
        if not models.FeedReader.objects.filter(worker=READER).update(**values, updated=Now()):
            models.FeedReader.objects.create(worker=READER, **values)
        models.Checkpoint.objects.filter(id__lt=row.id).delete()
        if hold:
            models.FeedReader.objects.filter(worker=hold).delete()
    log.info(
        "checkpoint %s saved (%s): feed position %d, %d bytes, in %.0f ms",
        row.pk,
        why,
        meta.position,
        len(data),
        (time.perf_counter() - clock) * 1000,
    )
    return row


# -- saving in the background ---------------------------------------------------------------
#
# Pickling a million devices takes half a minute and, with the pickler's memo, a gigabyte:
# done by the pass, the next pass (and every answer) waited for it, and the worker's
# memory held the state and the memo at once. A forked child instead holds the state as
# it was at the fork, frozen (copy-on-write: the pages the worker changes afterwards are
# copied, the child never sees the change), together with the feed position it is
# current to, taken under the state's lock in the same instant: a checkpoint's content
# always matches its position. The child pickles and writes with a database connection
# of its own and exits; it never touches the worker's connections (closing an inherited
# one would end the worker's session), and leaves by ``os._exit`` (no atexit, no
# finalizers). A child killed half way leaves the previous checkpoint, as any writer.
#
# Until the child commits, the newest checkpoint's reader row still stands at the previous
# checkpoint's position (or there is none): the passes going on meanwhile could prune the
# entries after the position being saved. So before the fork a reader row of its own
# (``hold``, committed at once) keeps them; the child's transaction deletes it, and so
# does the worker when the child failed (else it is forgotten after the retention).


@dataclasses.dataclass(slots=True)
class _Saving:
    """The save running in a child process."""

    pid: int
    why: str
    position: int
    hold: str
    """The reader row keeping the feed entries after ``position`` until the child commits."""
    reaper: threading.Thread
    status: int | None = None


_saving: _Saving | None = None
_saving_lock = threading.Lock()
#: A child still saving after this long is ended (by an alarm of its own): the previous
#: checkpoint stays, and the next save can start.
CHILD_SECONDS = 900
#: In a child: the worker's database connections, kept referenced (never closed) until it exits.
_inherited: list[Any] = []


def _lock_held(state: ClusterState) -> bool:
    owned = getattr(state.lock, "_is_owned", None)
    return bool(owned()) if owned is not None else False


def _can_fork() -> bool:
    from django.db import connection

    return hasattr(os, "fork") and connection.vendor == "postgresql" and not connection.in_atomic_block


def saving() -> bool:
    """A checkpoint is being saved in the background."""
    with _saving_lock:
        return _saving is not None and _saving.status is None


def wait(timeout: float | None = None) -> bool:
    """Wait for the save running in the background (if any); True when none runs any more."""
    with _saving_lock:
        current = _saving
    if current is None:
        return True
    current.reaper.join(timeout)
    return not current.reaper.is_alive()


def _save_in_child(state: ClusterState, why: str) -> None:
    global _saving
    with _saving_lock:
        if _saving is not None and _saving.status is None:
            log.info(
                "checkpoint not saved (%s): the save of feed position %d is still running in process %d",
                why,
                _saving.position,
                _saving.pid,
            )
            return
        with state.lock:
            if not state.valid:
                return
            meta = _meta(state)
            hold = _hold_name(state)
            values = {"position": meta.position, "horizon": meta.horizon, "token": "saving"}
            if not models.FeedReader.objects.filter(worker=hold).update(**values, updated=Now()):
                models.FeedReader.objects.create(worker=hold, **values)
            for handler in logging.getLogger().handlers:
                handler.flush()
            with warnings.catch_warnings():
                # "This process is multi-threaded, use of fork() may lead to deadlocks in the
                # child": the child takes no lock another thread may hold (it pickles, logs,
                # whose locks are reset at a fork, and opens a connection of its own), and an
                # alarm ends it if it ever hangs (see _child).
                warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # pragma: no cover - the child process (its effects are tested)
                _child(state, why, meta, hold)
        _saving = _Saving(pid=pid, why=why, position=meta.position, hold=hold, reaper=threading.Thread())
        _saving.reaper = threading.Thread(target=_reap, args=(_saving,), name=f"gpuplane-checkpoint-{pid}", daemon=True)
        _saving.reaper.start()
    log.info("checkpoint of feed position %d being saved (%s) by process %d", meta.position, why, pid)


def _reap(current: _Saving) -> None:
    _, status = os.waitpid(current.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    with _saving_lock:
        current.status = code
    if code != 0:
        try:
            models.FeedReader.objects.filter(worker=current.hold).delete()
        except Exception:
            log.exception("could not drop the reader row %s (it is forgotten after the retention)", current.hold)
        finally:
            from django.db import connection

            connection.close()  # this thread's
        log.warning(
            "checkpoint of feed position %d (%s) not saved: process %d exited with %d; the previous one stays",
            current.position,
            current.why,
            current.pid,
            code,
        )


def _hold_name(state: ClusterState) -> str:
    return f"{READER}:saving:{state.worker}"[:200]


def _child(state: ClusterState, why: str, meta: _Meta, hold: str) -> None:  # pragma: no cover - runs in the child
    """The forked child: pickle the frozen state, write it, exit. Never returns."""
    code = 1
    try:
        import gc

        from django.db import connections

        gc.disable()  # the state holds no cycles; the parent froze it for the same reason
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
            signal.signal(signum, signal.SIG_DFL)  # not the worker's handlers: a signal ends the child
        signal.alarm(CHILD_SECONDS)
        for conn in connections.all(initialized_only=True):
            if conn.connection is not None:
                _inherited.append(conn.connection)  # the worker's session: never closed from here
                conn.connection = None
        clock = time.perf_counter()
        _before_pickle()
        data = _dumps({**state.checkpoint_payload(), "schema": SCHEMA})
        _before_write()
        _write(state.worker, f"{why}, in the background", meta, data, clock, hold)
        for conn in connections.all(initialized_only=True):
            conn.close()  # the child's own connection
        code = 0
    except BaseException:
        log.exception("saving a checkpoint in the background failed; the previous one stays")
    finally:
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)


def _before_pickle() -> None:
    """In the child, before it pickles (tests hold it here)."""


def _before_write() -> None:
    """In the child, before its transaction (tests hold it here)."""


def load(state: ClusterState, why: str) -> Catchup | None:
    """Bring ``state`` current from the newest checkpoint and the feed after it, or None
    (logged) when there is no usable checkpoint. Inside the pass's transaction and lock."""
    if not settings.GPUPLANE_CHECKPOINTS:
        return None
    clock = time.perf_counter()
    row = models.Checkpoint.objects.order_by("-id").first()
    if row is None:
        # A first start (or checkpoints cleared): nothing is wrong, so no warning.
        log.info("no checkpoint saved yet, reading everything (%s)", why)
        return None
    refusal, payload = _refusal(row)
    if refusal or row is None:
        log.warning("checkpoint refused, reading everything again (%s): %s", why, refusal)
        return None
    state.restore_checkpoint(payload, row.position, tuple(int(x) for x in row.horizon), row.mark, row.mark_at)
    catch = state.follow()
    if catch.view != "incremental":
        return catch  # the feed had a gap after the checkpoint: follow() rebuilt
    catch.view = "checkpoint"
    catch.reason = why
    # Saved with answer passes' findings not yet reconciled: the next full pass reconciles all.
    catch.since_rebuild = not row.reconciled
    log.info(
        "mirror state of %s loaded from checkpoint %s (%s): feed position %d, %d entries replayed, in %.0f ms",
        state.worker,
        row.pk,
        why,
        row.position,
        catch.entries,
        (time.perf_counter() - clock) * 1000,
    )
    return catch


def _refusal(row: models.Checkpoint | None) -> tuple[str, Any]:
    """Why ``row`` cannot be used ("" when it can), and its payload."""
    if row is None:
        return "no checkpoint saved", None
    if row.schema != SCHEMA:
        return f"checkpoint {row.pk} has schema {row.schema!r}, this program reads {SCHEMA!r}", None
    reader = models.FeedReader.objects.filter(worker=READER).values_list("position", "token").first()
    if reader != (row.position, row.token):
        return (
            f"checkpoint {row.pk} is older than the change feed's retention "
            "(GPUPLANE_FEED_RETENTION_SECONDS): entries after it may have been pruned",
            None,
        )
    data = row.data  # bytes or a view of them: hashed and inflated in place, never copied
    if hashlib.sha256(data).hexdigest() != row.checksum:
        return f"checkpoint {row.pk} is corrupt (checksum mismatch)", None
    try:
        payload = _loads(data)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is "corrupt"
        return f"checkpoint {row.pk} is corrupt ({type(exc).__name__}: {exc})", None
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA:
        return f"checkpoint {row.pk} is corrupt (not a payload of schema {SCHEMA!r})", None
    return "", payload


def save_on_shutdown(**_: Any) -> None:
    """Celery ``worker_shutdown``: save this process's state for the next start (after
    the save running in the background, if any)."""
    try:
        save(STATE, "worker shutdown", background=False)
    except Exception:
        log.exception("checkpoint at shutdown failed; the next start reads everything again")

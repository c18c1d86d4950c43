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

import dataclasses
import hashlib
import logging
import os
import signal
import threading
import time
import uuid
import warnings
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from binder import models
from binder.runtime.checkpoint_payload import SCHEMA, dumps, loads
from binder.runtime.mirror_state import Catchup
from binder.runtime.state import STATE, ClusterState

log = logging.getLogger(__name__)

#: The ``FeedReader`` row that keeps the newest checkpoint's feed entries from pruning.
READER = "checkpoint"


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
        data = dumps({**state.checkpoint_payload(), "schema": SCHEMA})
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
        data = dumps({**state.checkpoint_payload(), "schema": SCHEMA})
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
        payload = loads(data)
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

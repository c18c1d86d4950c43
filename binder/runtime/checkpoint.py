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
whole and usable. The data is a zlib-compressed pickle with a sha256 checksum: it is
written and read only by this program, from its own database table.
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import logging
import operator
import pickle
import time
import uuid
import zlib
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from binder import models
from binder.engine import types as e
from binder.engine.accounting import Contribution, Ledger
from binder.engine.placement import NodeCache
from binder.runtime.mirror_state import Catchup
from binder.runtime.state import STATE, ClusterState

log = logging.getLogger(__name__)

#: Bump when the payload's shape changes (its keys, or what a key holds).
SCHEMA_VERSION = 1
#: The ``FeedReader`` row that keeps the newest checkpoint's feed entries from pruning.
READER = "checkpoint"


#: The record classes a payload holds by the thousand (pickled by :func:`_reducer`).
_RECORDS = (e.Device, e.Node, e.GpuClass, e.Budget, e.Vmi, e.Pod, e.Taint, e.Toleration, Contribution)


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
    """The file the unpickler reads from, decompressing as it goes (see :class:`_Deflate`)."""

    def __init__(self, data: bytes) -> None:
        self._zlib = zlib.decompressobj()
        self._data = memoryview(data)
        self._at = 0
        self._buffer = bytearray()
        self._pos = 0

    def _fill(self, wanted: int) -> None:
        while len(self._buffer) - self._pos < wanted and (self._at < len(self._data) or self._zlib.unconsumed_tail):
            del self._buffer[: self._pos]
            self._pos = 0
            chunk = self._zlib.unconsumed_tail or self._data[self._at : self._at + (1 << 20)]
            if not self._zlib.unconsumed_tail:
                self._at += len(chunk)
            self._buffer += self._zlib.decompress(chunk, 1 << 22)
        if self._at >= len(self._data) and not self._zlib.unconsumed_tail and len(self._buffer) - self._pos < wanted:
            self._buffer += self._zlib.flush()

    def read(self, size: int = -1) -> bytes:
        self._fill(size if size >= 0 else 1 << 62)
        end = len(self._buffer) if size < 0 else self._pos + size
        out = bytes(self._buffer[self._pos : end])
        self._pos += len(out)
        return out

    def readline(self) -> bytes:
        while True:
            newline = self._buffer.find(b"\n", self._pos)
            if newline >= 0:
                return self.read(newline + 1 - self._pos)
            before = len(self._buffer) - self._pos
            self._fill(before + 1)
            if len(self._buffer) - self._pos == before:
                return self.read()


def _loads(data: bytes) -> Any:
    # Our own table, written by save() above; the checksum was checked first.
    return pickle.Unpickler(_Inflate(data)).load()  # noqa: S301


def _dumps(payload: dict[str, Any]) -> bytes:
    """The payload pickled (records as constructor calls) and compressed."""
    out = _Deflate()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(payload)
    return out.close()


def save(state: ClusterState, why: str) -> models.Checkpoint | None:
    """Save ``state`` (if it is valid) as the newest checkpoint; returns it, or None.

    Call with no pass running on ``state`` (after a pass, or at shutdown). Its own
    transaction: the data, the reader row and the deletion of older checkpoints commit
    together or not at all.
    """
    if not settings.GPUPLANE_CHECKPOINTS:
        return None
    clock = time.perf_counter()
    with state.lock:
        if not state.valid:
            return None
        payload = {**state.checkpoint_payload(), "schema": SCHEMA}
        cursor = state.cursor
        position, horizon, mark, mark_at = cursor.position, list(cursor.horizon), cursor.mark, cursor.mark_at
        reconciled = state.nothing_pending()
        data = _dumps(payload)
    token = uuid.uuid4().hex
    with transaction.atomic():
        row = models.Checkpoint.objects.create(
            worker=state.worker,
            schema=SCHEMA,
            position=position,
            horizon=horizon,
            mark=mark,
            mark_at=mark_at,
            token=token,
            reconciled=reconciled,
            checksum=hashlib.sha256(data).hexdigest(),
            size=len(data),
            data=data,
        )
        values = {"position": position, "horizon": horizon, "token": token}
        if not models.FeedReader.objects.filter(worker=READER).update(**values, updated=Now()):
            models.FeedReader.objects.create(worker=READER, **values)
        models.Checkpoint.objects.filter(id__lt=row.id).delete()
    log.info(
        "checkpoint %s saved (%s): feed position %d, %d bytes, in %.0f ms",
        row.pk,
        why,
        position,
        len(data),
        (time.perf_counter() - clock) * 1000,
    )
    return row


def load(state: ClusterState, why: str) -> Catchup | None:
    """Bring ``state`` current from the newest checkpoint and the feed after it, or None
    (logged) when there is no usable checkpoint. Inside the pass's transaction and lock."""
    if not settings.GPUPLANE_CHECKPOINTS:
        return None
    clock = time.perf_counter()
    row = models.Checkpoint.objects.order_by("-id").first()
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
    data = bytes(row.data)
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
    """Celery ``worker_shutdown``: save this process's state for the next start."""
    try:
        save(STATE, "worker shutdown")
    except Exception:
        log.exception("checkpoint at shutdown failed; the next start reads everything again")

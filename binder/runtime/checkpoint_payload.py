"""A checkpoint's payload: the pass worker's state as bytes, and back.

``binder.runtime.checkpoint`` decides when a checkpoint is saved and loaded, and refuses
one that does not fit; this module only encodes: a zlib-compressed pickle with a sha256
checksum, the records a payload holds by the hundred thousand saved as tables ahead of
the rest, and :data:`SCHEMA`, which changes with the payload's shape or any engine
record's layout (a checkpoint of another schema is refused).
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import operator
import pickle
import queue
import threading
import zlib
from typing import Any

from binder.engine import types as e
from binder.engine.accounting import Ledger
from binder.engine.fit import NodeCache

#: Bump when the payload's shape changes (its keys, or what a key holds). 3: the ledger keeps
#: its borrowed and marked sets (lending), instance attributes the layout below does not see.
#: 4: it also keeps them by tenant and by resource and node, and repay's memo.
SCHEMA_VERSION = 4


#: The record classes a payload holds by the thousand (pickled by :func:`_reducer`).
_RECORDS = (
    e.Device, e.Node, e.GpuClass, e.Budget, e.Vmi, e.Pod, e.Taint, e.Toleration, e.VirtualMachine, e.Requirement,
    e.Term,
)  # fmt: skip


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
#: (see :func:`dumps`).
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


def loads(data: bytes | memoryview) -> Any:
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


def dumps(payload: dict[str, Any]) -> bytes:
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

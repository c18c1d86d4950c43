"""Reading the read model while a follow holds its lock (``binder.runtime.readmodel``).

A follow holds the model's lock while it reads rows from the database. A namespace's slice
already made, and the nodes, are read without that lock, so a call that has its fresh
follow behind it does not wait for the next one's database round trips; a slice not made
yet still waits (it is built from the records a follow may be changing).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from binder.mirror.snapshot import load_objects
from binder.runtime.readmodel import ReadModel
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj

pytestmark = pytest.mark.django_db


def _in_thread(read: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(read()), daemon=True)
    thread.start()
    return thread, out


def test_a_kept_slice_and_the_nodes_are_read_while_a_follow_holds_the_lock() -> None:
    load_objects(
        [
            namespace_obj("t1"),
            namespace_obj("t2"),
            class_obj("h100", H100),
            node_obj("n1", {H100: 4}),
            gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node="n1"),
            gpu_obj("t2", "g1", "h100", "vm2"),
        ]
    )
    model = ReadModel("test")
    model.current()
    kept = model.slice("t1")
    with model.lock:  # as a follow holds it while it reads the database
        thread, out = _in_thread(lambda: (model.slice("t1"), model.nodes(["n1", "gone"])))
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert out == [(kept, model.nodes(["n1"]))]
        waiting, built = _in_thread(lambda: model.slice("t2"))  # not made yet: waits for the lock
        waiting.join(timeout=0.2)
        assert waiting.is_alive() and not built
    waiting.join(timeout=10)
    assert [d.name for d in built[0].devices] == ["g1"]

"""A small placed cluster for the staff-console tests (audit, search, node page, drain,
fleet health): three nodes, two tenants, sets that a drain of ``n1`` splits between a
move and a loss, a launcher pod and a raw pod (a helper module: test modules must not
import each other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from binder import models
from binder.mirror.snapshot import load_file
from binder.runtime.passes import run_pass
from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    vmi_obj,
    write_snapshot,
)

SEG_TRAIN_LAUNCHER = "virt-launcher-seg-train-x1y2z"
SEG_TRAIN_UID = "7a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"


def staff_objects() -> list[dict[str, Any]]:
    """n2 (H100 ×4) takes team-vision/seg-train (2, its launcher running there); n1 (H100 ×6)
    takes team-nlp/rag-serve (4) and team-vision/infer (1, ties with n2 by name); n3 (A10 ×4)
    holds team-vision/notebook (1) and team-nlp's raw pod trainer-0. team-nlp's budget of 4
    h100 is at its limit, so team-nlp/big-order (1 h100) stays Pending. Draining n1 would
    move infer to n2 and lose rag-serve (n2 has 2 free, it needs 4)."""
    seg_vmi = vmi_obj("team-vision", "seg-train", ["seg-train-gpu0", "seg-train-gpu1"], {SEG_TRAIN_UID: "n2"}, "n2")
    return [
        namespace_obj("team-vision"),
        namespace_obj("team-nlp"),
        node_obj("n1", {H100: 6}),
        node_obj("n2", {H100: 4}),
        node_obj("n3", {A10: 4}),
        class_obj("h100", H100),
        class_obj("a10", A10),
        gpu_obj("team-vision", "seg-train-gpu0", "h100", "seg-train", created="2026-11-01T00:00:00Z"),
        gpu_obj("team-vision", "seg-train-gpu1", "h100", "seg-train", created="2026-11-01T00:00:00Z"),
        *(
            gpu_obj("team-nlp", f"rag-serve-gpu{i}", "h100", "rag-serve", created="2026-11-02T00:00:00Z")
            for i in range(4)
        ),
        gpu_obj("team-vision", "infer-gpu0", "h100", "infer", created="2026-11-02T12:00:00Z"),
        gpu_obj("team-vision", "notebook-gpu0", "a10", "notebook", created="2026-11-03T00:00:00Z"),
        gpu_obj("team-nlp", "big-order-gpu0", "h100", "big-order", created="2026-11-04T00:00:00Z"),
        budget_obj("team-nlp", {"h100": 4}),
        seg_vmi,
        launcher_obj(seg_vmi, H100, 2, "n2", uid=SEG_TRAIN_UID, name=SEG_TRAIN_LAUNCHER),
        plain_pod_obj("team-nlp", "trainer-0", A10, 1, "n3"),
    ]


def load_staff_cluster(tmp_path: Path) -> models.PassRun:
    """Load :func:`staff_objects` and place them with one full pass."""
    load_file(write_snapshot(tmp_path / "staff-cluster.yaml", staff_objects()))
    run = run_pass()
    placed = dict(models.GpuDevice.objects.values_list("name", "node"))
    assert placed["seg-train-gpu0"] == "n2" and placed["rag-serve-gpu0"] == placed["infer-gpu0"] == "n1", placed
    assert placed["notebook-gpu0"] == "n3" and placed["big-order-gpu0"] == "", placed
    return run

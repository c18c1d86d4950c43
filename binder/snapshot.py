"""Load a cluster snapshot (a Kubernetes List or multi-document YAML) into the mirror.

Operators load dumps of live clusters (``kubectl get ... -o yaml``) to try gpuplane,
to reproduce a placement, or to seed standalone mode. A dump is all or nothing: every
object is parsed and checked first, every problem is reported naming the object and
the field, and only a clean file is written, in one transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from django.db import transaction

from . import models
from .kube import ObjectError, Parsed, parse_object

#: Refuse absurd files before parsing them (a snapshot of 100k devices is ~100 MB).
MAX_SNAPSHOT_BYTES = 512 * 1024 * 1024

NAMESPACED = {"GPU", "GPUBudget", "VirtualMachineInstance", "Pod"}


class SnapshotError(ValueError):
    """The snapshot cannot be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:20]
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__("snapshot rejected, nothing loaded:\n" + "\n".join(f"- {p}" for p in shown) + more)


@dataclass
class LoadReport:
    """What a load wrote (per kind) and what it skipped."""

    loaded: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    created_namespaces: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{n} {kind}" for kind, n in sorted(self.loaded.items())]
        text = "loaded " + (", ".join(parts) if parts else "nothing")
        if self.created_namespaces:
            text += f"; created namespaces not in the file: {', '.join(self.created_namespaces)}"
        if self.skipped:
            text += "; skipped kinds gpuplane does not mirror: " + ", ".join(
                f"{n} {kind}" for kind, n in sorted(self.skipped.items())
            )
        return text


def read_documents(path: Path) -> list[Any]:
    """The objects of a YAML or JSON file: List items flattened, empty documents dropped."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SnapshotError([f"{path}: cannot read: {exc.strerror}"]) from None
    if size > MAX_SNAPSHOT_BYTES:
        raise SnapshotError([f"{path}: {size} bytes is over the {MAX_SNAPSHOT_BYTES} byte limit"])
    try:
        with path.open("rb") as handle:
            documents = list(yaml.safe_load_all(handle))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SnapshotError([f"{path}: not valid YAML{where}: {problem}"]) from None
    except UnicodeDecodeError as exc:
        raise SnapshotError([f"{path}: not UTF-8 text: {exc.reason}"]) from None
    return list(flatten(documents))


def flatten(documents: Iterable[Any]) -> Iterator[Any]:
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        if isinstance(doc, Mapping) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List"):
            items = doc.get("items") or []
            if not isinstance(items, list):
                raise SnapshotError([f"document {index + 1}: {doc['kind']}.items must be a list"])
            yield from items
        else:
            yield doc


def parse_all(objects: Iterable[Any]) -> tuple[list[Parsed], Counter[str]]:
    """Parse every object, collecting all problems (duplicates included) before failing."""
    parsed: list[Parsed] = []
    skipped: Counter[str] = Counter()
    problems: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for index, obj in enumerate(objects):
        try:
            item = parse_object(obj, where=f"object {index + 1}")
        except ObjectError as exc:
            problems.append(str(exc))
            continue
        if item is None:
            skipped[str(obj.get("kind"))] += 1
            continue
        key = (item.kind, item.namespace, item.name)
        if key in seen:
            where = f"{item.namespace}/{item.name}" if item.namespace else item.name
            problems.append(f"{item.kind} {where}: appears more than once in the file")
            continue
        seen.add(key)
        parsed.append(item)
    if problems:
        raise SnapshotError(problems)
    return parsed, skipped


def clear_mirror() -> None:
    """Delete every mirrored object; pass history and decisions are kept."""
    for model in (models.GpuDevice, models.GpuBudget, models.Pod, models.VirtualMachineInstance):
        model.objects.all().delete()
    models.Namespace.objects.all().delete()
    models.Node.objects.all().delete()
    models.GpuClass.objects.all().delete()


def load_objects(objects: Iterable[Any], *, replace: bool = False) -> LoadReport:
    """Parse and then write ``objects`` in one transaction (upsert by name)."""
    parsed, skipped = parse_all(objects)
    report = LoadReport(skipped=skipped)
    with transaction.atomic():
        if replace:
            clear_mirror()
        by_kind: dict[str, list[Parsed]] = {}
        for item in parsed:
            by_kind.setdefault(item.kind, []).append(item)
        _upsert(models.Namespace, by_kind.get("Namespace", []), report)
        wanted = sorted({item.namespace for item in parsed if item.kind in NAMESPACED})
        existing = set(models.Namespace.objects.filter(name__in=wanted).values_list("name", flat=True))
        missing = [name for name in wanted if name not in existing]
        models.Namespace.objects.bulk_create([models.Namespace(name=name) for name in missing])
        report.created_namespaces = missing
        ns_ids = dict(models.Namespace.objects.filter(name__in=wanted).values_list("name", "id"))
        _upsert(models.Node, by_kind.get("Node", []), report)
        _upsert(models.GpuClass, by_kind.get("GPUClass", []), report)
        _upsert(models.GpuDevice, by_kind.get("GPU", []), report, ns_ids)
        _upsert(models.GpuBudget, by_kind.get("GPUBudget", []), report, ns_ids)
        _upsert(models.VirtualMachineInstance, by_kind.get("VirtualMachineInstance", []), report, ns_ids)
        _upsert(models.Pod, by_kind.get("Pod", []), report, ns_ids)
    return report


def _upsert(model: Any, items: list[Parsed], report: LoadReport, ns_ids: Mapping[str, int] | None = None) -> None:
    if not items:
        return
    rows = []
    for item in items:
        values = dict(item.values)
        if ns_ids is not None:
            values["namespace_id"] = ns_ids[item.namespace]
        rows.append(model(name=item.name, **values))
    update_fields = list(items[0].values)
    unique = ["namespace", "name"] if ns_ids is not None else ["name"]
    model.objects.bulk_create(
        rows, batch_size=1000, update_conflicts=True, unique_fields=unique, update_fields=update_fields
    )
    report.loaded[items[0].kind] += len(rows)


def load_file(path: Path, *, replace: bool = False) -> LoadReport:
    return load_objects(read_documents(path), replace=replace)

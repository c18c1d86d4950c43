"""Load a cluster snapshot (a Kubernetes List or multi-document YAML) into the mirror.

Operators load dumps of live clusters (``kubectl get ... -o yaml``) to try gpuplane,
to reproduce a placement, or to seed standalone mode. A dump is all or nothing: every
object is parsed and checked first, every problem is reported naming the object and
the field, and only a clean file is written, in one transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from django.db import transaction

from binder.kube.objects import ObjectError, Parsed, parse_object
from binder.mirror.write import LoadReport, clear_mirror, write_parsed

#: Refuse absurd files before parsing them (a snapshot of 100k devices is ~100 MB).
MAX_SNAPSHOT_BYTES = 512 * 1024 * 1024

#: Bounds on what one file may make the loader build. Dumps from ``kubectl`` never use
#: YAML aliases, and Kubernetes objects nest about 20 levels deep (managedFields), so
#: these only stop hostile files: a 556-byte "billion laughs" file expands to 10^9 nodes,
#: and 500 levels of nesting overflowed the Python stack.
MAX_ALIAS_NODES = 10_000
MAX_DEPTH = 64


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting while it composes: the nodes every alias stands for
    (an alias of an alias counts in full, as anyone walking the result would see it) and
    the nesting depth. Past either bound it stops with a ComposerError at the line."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call] # PyYAML's stubs leave it untyped
            node = super().compose_node(parent, index)
            self._expanded += self._sizes.get(id(node), 1)  # 1: an alias of a node still being composed
            if self._expanded > MAX_ALIAS_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"aliases expand to more than {MAX_ALIAS_NODES} nodes (refused)", event.start_mark
                )
            return node
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        # Children are composed already (an alias child is its anchored node): the size as
        # expanded is known bottom-up, once per node.
        self._sizes[id(node)] = 1 + sum(self._sizes.get(id(child), 1) for child in self._children(node))
        return node

    @staticmethod
    def _children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return []


class SnapshotError(ValueError):
    """The snapshot cannot be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:20]
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__("snapshot rejected, nothing loaded:\n" + "\n".join(f"- {p}" for p in shown) + more)


def read_documents(path: Path) -> list[Any]:
    """The objects of a YAML or JSON file: List items flattened, empty documents dropped."""
    return [obj for _, obj in read_located(path)]


def read_located(path: Path) -> list[tuple[str, Any]]:
    """Like :func:`read_documents`, each object paired with where it starts in the file
    (``document at line 12``, ``List item 3 at line 40``), so a problem with an object that
    has no kind or no name can still be found in a dump of thousands."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SnapshotError([f"{path}: cannot read: {exc.strerror}"]) from None
    if size > MAX_SNAPSHOT_BYTES:
        raise SnapshotError([f"{path}: {size} bytes is over the {MAX_SNAPSHOT_BYTES} byte limit"])
    documents: list[tuple[Any, Any]] = []
    try:
        with path.open("rb") as handle:
            loader = BoundedLoader(handle)
            try:
                # safe_load_all, keeping each document's node for its line numbers
                while loader.check_node():
                    node = loader.get_node()
                    documents.append((node, loader.construct_document(node)))
            finally:
                loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SnapshotError([f"{path}: not valid YAML{where}: {problem}"]) from None
    except UnicodeDecodeError as exc:
        raise SnapshotError([f"{path}: not UTF-8 text: {exc.reason}"]) from None
    located: list[tuple[str, Any]] = []
    for node, doc in documents:
        line = node.start_mark.line + 1
        if _is_list(doc):
            items = doc.get("items") or []
            if not isinstance(items, list):
                raise SnapshotError([f"{path}: document at line {line}: {doc['kind']}.items must be a list"])
            lines = _item_lines(node)
            for index, item in enumerate(items):
                item_line = lines[index] if index < len(lines) else line
                located.append((f"{doc['kind']} item {index + 1} at line {item_line}", item))
        elif doc is not None:
            located.append((f"document at line {line}", doc))
    return located


def _is_list(doc: Any) -> bool:
    return isinstance(doc, Mapping) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List")


def _item_lines(node: Any) -> list[int]:
    """Start lines of the ``items`` of a List document's node."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == "items" and isinstance(value, yaml.SequenceNode):
                return [item.start_mark.line + 1 for item in value.value]
    return []


def flatten(documents: Iterable[Any]) -> Iterator[Any]:
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        if _is_list(doc):
            items = doc.get("items") or []
            if not isinstance(items, list):
                raise SnapshotError([f"document {index + 1}: {doc['kind']}.items must be a list"])
            yield from items
        else:
            yield doc


def parse_all(objects: Iterable[Any], locations: Sequence[str] | None = None) -> tuple[list[Parsed], Counter[str]]:
    """Parse every object, collecting all problems (duplicates included) before failing.

    ``locations`` (one per object) says where each object is in its file; without it
    objects are numbered.
    """
    parsed: list[Parsed] = []
    skipped: Counter[str] = Counter()
    problems: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for index, obj in enumerate(objects):
        where = locations[index] if locations is not None else f"object {index + 1}"
        try:
            item = parse_object(obj, where=where)
        except ObjectError as exc:
            problems.append(str(exc))
            continue
        if item is None:
            skipped[str(obj.get("kind"))] += 1
            continue
        key = (item.kind, item.namespace, item.name)
        if key in seen:
            ref = f"{item.namespace}/{item.name}" if item.namespace else item.name
            problems.append(f"{item.kind} {ref}: appears more than once in the file")
            continue
        seen.add(key)
        parsed.append(item)
    if problems:
        raise SnapshotError(problems)
    return parsed, skipped


def load_objects(
    objects: Iterable[Any], *, replace: bool = False, locations: Sequence[str] | None = None
) -> LoadReport:
    """Parse and then write ``objects`` in one transaction (upsert by name)."""
    parsed, skipped = parse_all(objects, locations)
    report = LoadReport(skipped=skipped)
    with transaction.atomic():
        if replace:
            clear_mirror()
        write_parsed(parsed, report)
    return report


def load_file(path: Path, *, replace: bool = False) -> LoadReport:
    located = read_located(path)
    return load_objects([obj for _, obj in located], replace=replace, locations=[where for where, _ in located])

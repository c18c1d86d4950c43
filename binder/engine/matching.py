"""Node affinity matching: whether a node satisfies a node selector term, as the scheduler decides.

The webhook checks a VMI's own required node affinity against the node holding its GPUs
before pinning it there (a pin never silently overrides the user's constraints); the
binder may check a requested placement the same way. Pure: the standard library and the
engine's :class:`~binder.engine.types.Node` only (the requirement and term records live
with the engine's other records, re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping

from binder.engine.types import NAME_FIELD, Node, Requirement, Term

#: Node selector requirement operators (core/v1 NodeSelectorOperator) and the field ones.
LABEL_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"})
FIELD_OPERATORS = frozenset({"In", "NotIn"})


def label_requirement_holds(req: Requirement, labels: Mapping[str, str]) -> bool:
    value = labels.get(req.key)
    match req.operator:
        case "In":
            return value is not None and value in req.values
        case "NotIn":
            return value is None or value not in req.values
        case "Exists":
            return value is not None
        case "DoesNotExist":
            return value is None
        case _:  # Gt, Lt: integers, one value
            if value is None or len(req.values) != 1:
                return False
            try:
                have, want = int(value), int(req.values[0])
            except ValueError:
                return False
            return have > want if req.operator == "Gt" else have < want


def field_requirement_holds(req: Requirement, node_name: str) -> bool:
    if req.key != NAME_FIELD:
        return False  # the scheduler supports metadata.name only
    return (node_name in req.values) == (req.operator == "In")


def term_matches(term: Term, node: Node) -> bool:
    """Whether ``node`` satisfies one node selector term; an empty term matches no node."""
    if not term.expressions and not term.fields:
        return False
    return all(label_requirement_holds(r, node.labels) for r in term.expressions) and all(
        field_requirement_holds(r, node.name) for r in term.fields
    )


def describe(req: Requirement) -> str:
    values = f" [{', '.join(req.values)}]" if req.values else ""
    return f"{req.key} {req.operator}{values}"


def unmet(terms: tuple[Term, ...], node: Node) -> list[str]:
    """Every requirement of ``terms`` that ``node`` does not meet, described."""
    return [describe(r) for t in terms for r in t.expressions if not label_requirement_holds(r, node.labels)] + [
        describe(r) for t in terms for r in t.fields if not field_requirement_holds(r, node.name)
    ]


__all__ = [
    "FIELD_OPERATORS",
    "LABEL_OPERATORS",
    "NAME_FIELD",
    "Requirement",
    "Term",
    "describe",
    "field_requirement_holds",
    "label_requirement_holds",
    "term_matches",
    "unmet",
]

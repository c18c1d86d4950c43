"""Read Kubernetes and KubeVirt objects (as the API server or ``kubectl get -o yaml`` gives
them) into plain row values for the mirror: the entry point, which picks each kind's parser.

One parser serves ``load_snapshot`` and the cluster sync, so a snapshot of a live
cluster and the live cluster itself land in the mirror the same way. The kinds' parsers
live by concern: the core kinds in ``binder.kube.core``, gpuplane's custom resources in
``binder.kube.resources``, the shared field reading (quantities, times, limits, the
:class:`ObjectError` that names the object and the field) in ``binder.kube.fields``. The
names callers import from here are re-exported, so ``binder.kube.objects`` stays the one
import for the mirror, the webhook and the usage records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from binder.kube.core import (
    TAINT_EFFECTS,
    TOLERATION_OPERATORS,
    is_gpu_resource,
    parse_namespace,
    parse_node,
    parse_pod,
    parse_taints,
    parse_tolerations,
    parse_vmi,
    pod_requests,
)
from binder.kube.fields import (
    COUNT_MAX,
    NAME_MAX,
    NAMESPACE_MAX,
    QUOTE_MAX,
    ObjectError,
    Parsed,
    describe,
    quote,
    safe_text,
    text_problem,
)
from binder.kube.kinds import KINDS
from binder.kube.resources import (
    BIND_NODE_SELECTOR_ANNOTATION,
    BIND_REQUEST_ANNOTATION,
    GROUP,
    PHASES,
    parse_gpu,
    parse_gpu_budget,
    parse_gpu_class,
)

__all__ = [
    "BIND_NODE_SELECTOR_ANNOTATION",
    "BIND_REQUEST_ANNOTATION",
    "COUNT_MAX",
    "GROUP",
    "GROUPS",
    "NAMESPACE_MAX",
    "NAME_MAX",
    "PARSERS",
    "PHASES",
    "QUOTE_MAX",
    "TAINT_EFFECTS",
    "TOLERATION_OPERATORS",
    "ObjectError",
    "Parsed",
    "api_group",
    "describe",
    "is_gpu_resource",
    "parse_gpu",
    "parse_gpu_budget",
    "parse_gpu_class",
    "parse_namespace",
    "parse_node",
    "parse_object",
    "parse_pod",
    "parse_taints",
    "parse_tolerations",
    "parse_vmi",
    "pod_requests",
    "quote",
    "safe_text",
    "text_problem",
]

#: Each mirrored kind's parser (``binder.kube.kinds``: one row per kind).
PARSERS = {k.kind: k.parser for k in KINDS}

#: The API group each mirrored kind belongs to ("" is the core group).
GROUPS = {k.kind: k.group for k in KINDS}


def api_group(api_version: Any) -> str | None:
    """``kubevirt.io/v1`` -> ``kubevirt.io``; ``v1`` -> ``""``; None if not a string."""
    if not isinstance(api_version, str) or not api_version:
        return None
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def parse_object(obj: Any, where: str = "") -> Parsed | None:
    """Parse one object; None for kinds gpuplane does not mirror."""
    if not isinstance(obj, Mapping):
        raise ObjectError(where or "document", "", f"must be a Kubernetes object (a mapping), got {type(obj).__name__}")
    kind = obj.get("kind")
    if not kind or not isinstance(kind, str):
        raise ObjectError(describe(obj) + (f" ({where})" if where else ""), "kind", "is required")
    parser = PARSERS.get(kind)
    if parser is None:
        return None
    group = api_group(obj.get("apiVersion"))
    if group is not None and group != GROUPS[kind]:
        return None  # a same-named kind of another API group (e.g. a vendor's "GPU")
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise ObjectError(describe(obj), "metadata", "is required and must be a mapping")
    parsed = parser(obj)
    _check_stored(describe(obj), parsed.values)
    return parsed


def _check_stored(ref: str, values: Mapping[str, Any]) -> None:
    """The last guard before the database: no text the mirror would write holds a NUL or
    a lone surrogate, whichever field a parser forgot (the field named as the mirror's)."""

    def walk(path: str, value: Any) -> None:
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                raise ObjectError(ref, path, f"{problem}, got {quote(value)}")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{path} (a key)", key)
                walk(f"{path}[{safe_text(str(key))[:QUOTE_MAX]}]", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{path}[{index}]", item)

    for field, value in values.items():
        walk(field, value)

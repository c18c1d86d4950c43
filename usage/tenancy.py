"""Who may read which tenant: the one rule every API endpoint applies.

Staff read every namespace; any other user reads only the namespaces granted to them
(``NamespaceGrant``, made by ``manage.py issue_token``). Endpoints never test this
themselves: the base view (``usage.api.TenantScopedMixin``) passes
:func:`visible_namespaces` to the querysets' ``for_tenant``, and a namespace the user
may not read answers 404 exactly like one that does not exist, so names do not leak.
"""

from __future__ import annotations

from typing import Any

from .models import NamespaceGrant

#: ``None``: every namespace (staff); else the names the user may read.
Visible = frozenset[str] | None


def visible_namespaces(user: Any) -> Visible:
    """The namespaces ``user`` may read: ``None`` for staff (all), else their grants."""
    if not getattr(user, "is_authenticated", False):
        return frozenset()
    if user.is_staff:
        return None
    cached = getattr(user, "_gpuplane_namespaces", None)
    if cached is None:
        cached = frozenset(NamespaceGrant.objects.filter(user=user).values_list("namespace", flat=True))
        user._gpuplane_namespaces = cached
    return cached  # type: ignore[no-any-return]


def may_read(user: Any, namespace: str) -> bool:
    """True if ``user`` may read ``namespace`` (staff: every namespace)."""
    visible = visible_namespaces(user)
    return visible is None or namespace in visible

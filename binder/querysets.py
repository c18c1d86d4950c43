"""Tenant scoping for querysets of namespaced rows: the one place a view's queryset is narrowed
to a tenant's namespaces (the mirror's models and the usage records share it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Self, TypeVar

from django.db import models

_M = TypeVar("_M", bound=models.Model)


class TenantQuerySet(models.QuerySet[_M]):
    """Querysets of namespaced objects carry tenant scoping, so no view can forget it."""

    def for_tenant(self, namespaces: Iterable[str] | None) -> Self:
        """Rows of the given namespaces only (``None`` means all: staff)."""
        if namespaces is None:
            return self
        lookup: str = getattr(self.model, "NAMESPACE_LOOKUP")  # noqa: B009 - set on every tenant-scoped model
        return self.filter(**{lookup + "__in": list(namespaces)})

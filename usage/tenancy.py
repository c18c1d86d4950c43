"""Who may read which tenant: the one rule every API endpoint applies.

Staff with the admin's view permission of what an endpoint reads (usage records,
devices, decisions: the same permission the admin pages require) read every namespace;
a staff user without it is a user like any other. Any other user reads only the
namespaces granted to them (``NamespaceGrant``, made by ``manage.py issue_token``). Endpoints never test this
themselves: the base view (``usage.api.base.TenantScopedView``) passes
:func:`visible_namespaces` to the querysets' ``for_tenant``, and a namespace the user
may not read answers 404 exactly like one that does not exist, so names do not leak.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from knox.models import AuthToken

from usage.models import NamespaceGrant

#: ``None``: every namespace (staff); else the names the user may read.
Visible = frozenset[str] | None


#: What staff need to read every tenant through the API when an endpoint names nothing
#: else: the usage records admin's view permission.
STAFF_READ_PERMISSION = "usage.view_usagerecord"


def reads_every_namespace(user: Any, permission: str = STAFF_READ_PERMISSION) -> bool:
    """Staff read every namespace only with the admin's view ``permission`` (superusers
    have every permission): ``is_staff`` alone opens the admin's door, not its pages, and
    the API used to give such a user every tenant's records."""
    return bool(user.is_active and user.is_staff and user.has_perm(permission))


def visible_namespaces(user: Any, permission: str = STAFF_READ_PERMISSION) -> Visible:
    """The namespaces ``user`` may read: ``None`` for staff with ``permission`` (all),
    else their grants."""
    if not getattr(user, "is_authenticated", False):
        return frozenset()
    if reads_every_namespace(user, permission):
        return None
    cached = getattr(user, "_gpuplane_namespaces", None)
    if cached is None:
        cached = frozenset(NamespaceGrant.objects.filter(user=user).values_list("namespace", flat=True))
        user._gpuplane_namespaces = cached
    return cached


def may_read(user: Any, namespace: str, permission: str = STAFF_READ_PERMISSION) -> bool:
    """True if ``user`` may read ``namespace`` (staff with ``permission``: every namespace)."""
    visible = visible_namespaces(user, permission)
    return visible is None or namespace in visible


#: A Kubernetes namespace name (RFC 1123 label).
NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class GrantError(ValueError):
    """Bad input for a grant or token: the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """What ``issue_token`` did: the user, its grants now, the token and when it expires."""

    username: str
    created_user: bool
    staff: bool
    namespaces: tuple[str, ...]
    token: str
    expires: datetime | None


def parse_namespaces(text: str) -> tuple[str, ...]:
    """``ns1,ns2`` as sorted unique names; a malformed name is an error naming it."""
    names = sorted({part.strip() for part in text.split(",") if part.strip()})
    for name in names:
        if len(name) > 63 or not NAMESPACE_NAME.match(name):
            raise GrantError(
                f"{name!r} is not a namespace name (lower-case letters, digits and '-', at most 63 characters)"
            )
    return tuple(names)


def issue_token(username: str, namespaces: Iterable[str], *, days: int, replace: bool = False) -> IssuedToken:
    """Create the user if needed, grant ``namespaces`` (or exactly those, with ``replace``),
    and create a new API token for it, valid ``days`` days (0: no expiry). One transaction:
    on any error nothing is written."""
    username = username.strip()
    if not username or len(username) > 150:
        raise GrantError("the username must be 1 to 150 characters")
    if days < 0:
        raise GrantError("--days must be 0 (never expires) or more")
    wanted = tuple(sorted(set(namespaces)))
    users = get_user_model()
    with transaction.atomic():
        user, created = users.objects.get_or_create(username=username)
        if created:
            user.set_unusable_password()  # API only: no admin login with this account
            user.save(update_fields=["password"])
        if replace:
            NamespaceGrant.objects.filter(user=user).exclude(namespace__in=wanted).delete()
        NamespaceGrant.objects.bulk_create(
            [NamespaceGrant(user=user, namespace=ns) for ns in wanted], ignore_conflicts=True
        )
        instance, token = AuthToken.objects.create(user=user, expiry=timedelta(days=days) if days else None)
        granted = tuple(
            NamespaceGrant.objects.filter(user=user).values_list("namespace", flat=True).order_by("namespace")
        )
    return IssuedToken(username, created, bool(user.is_staff), granted, token, instance.expiry)

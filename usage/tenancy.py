"""Who may read which tenant: the one rule every API endpoint applies.

Staff with the admin's view permission of what an endpoint reads (usage records,
devices, decisions: the same permission the admin pages require) read every namespace;
a staff user without it is a user like any other. Any other user reads only the
namespaces granted to the API token the request came with (``NamespaceGrant``, made by
``manage.py issue_token``, removed with its token by ``manage.py revoke_token``). Endpoints never test this
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
from knox.settings import CONSTANTS as knox_constants

from binder.models import Namespace
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


def visible_namespaces(user: Any, permission: str = STAFF_READ_PERMISSION, auth: Any = None) -> Visible:
    """The namespaces a request may read: ``None`` for staff with ``permission`` (all),
    else the grants of the API token it came with (``auth``: DRF's ``request.auth``).

    Grants belong to tokens: a session, or a token of someone else's, reads nothing. A
    grant bound to a namespace UID reads the namespace only while the mirror has no other
    UID for that name (a namespace deleted and created again is a new tenant).
    """
    if not getattr(user, "is_authenticated", False):
        return frozenset()
    if reads_every_namespace(user, permission):
        return None
    if not isinstance(auth, AuthToken) or auth.user_id != user.pk:
        return frozenset()
    cached: frozenset[str] | None = getattr(auth, "_gpuplane_namespaces", None)
    if cached is None:
        grants = list(NamespaceGrant.objects.filter(token=auth).values_list("namespace", "namespace_uid"))
        current = dict(
            Namespace.objects.filter(name__in=[ns for ns, _ in grants]).exclude(uid="").values_list("name", "uid")
        )
        cached = frozenset(ns for ns, uid in grants if not uid or current.get(ns, uid) == uid)
        auth._gpuplane_namespaces = cached
    return cached


def may_read(user: Any, namespace: str, permission: str = STAFF_READ_PERMISSION, auth: Any = None) -> bool:
    """True if the request may read ``namespace`` (staff with ``permission``: every namespace)."""
    visible = visible_namespaces(user, permission, auth)
    return visible is None or namespace in visible


#: A Kubernetes namespace name (RFC 1123 label).
NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class GrantError(ValueError):
    """Bad input for a grant or token: the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """What ``issue_token`` did: the user, the new token's namespaces, the token, when it
    expires and its key (what the admin shows and ``revoke_token`` takes)."""

    username: str
    created_user: bool
    staff: bool
    namespaces: tuple[str, ...]
    token: str
    expires: datetime | None
    key: str = ""
    #: The token's namespaces the mirror does not have (a typo, or a tenant not created yet).
    unknown: tuple[str, ...] = ()


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
    """Create the user if needed and a new API token for it that reads exactly
    ``namespaces``, valid ``days`` days (0: no expiry). Other tokens of the user are never
    widened; with ``replace`` they are narrowed to ``namespaces`` (grants of other
    namespaces revoked). One transaction: on any error nothing is written.

    Each grant records the namespace's UID if the mirror has one, so it does not read a
    namespace created later under the same name."""
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
        if not wanted and not user.is_staff:
            # Grants are all a tenant's token reads by: with none it would read nothing.
            raise GrantError(
                f"no namespaces given: a token for {username} would read nothing; "
                "name the namespaces it may read with --namespaces ns1,ns2"
            )
        if replace:
            NamespaceGrant.objects.filter(user=user).exclude(namespace__in=wanted).delete()
        instance, token = AuthToken.objects.create(user=user, expiry=timedelta(days=days) if days else None)
        uids = dict(Namespace.objects.filter(name__in=wanted).values_list("name", "uid"))
        NamespaceGrant.objects.bulk_create(
            [NamespaceGrant(token=instance, user=user, namespace=ns, namespace_uid=uids.get(ns, "")) for ns in wanted]
        )
    unknown = tuple(ns for ns in wanted if ns not in uids)
    return IssuedToken(
        username, created, bool(user.is_staff), wanted, token, instance.expiry, instance.token_key, unknown
    )


@dataclass(frozen=True, slots=True)
class Revoked:
    """What ``revoke_token`` removed: (username, token key, namespaces) per token."""

    tokens: tuple[tuple[str, str, tuple[str, ...]], ...]


def revoke_tokens(*, token: str = "", username: str = "") -> Revoked:
    """Delete one token (given whole, as ``issue_token`` printed it, or by its key, as the
    admin shows it) or every token of ``username``, with their grants. One transaction."""
    if bool(token) == bool(username):
        raise GrantError("name exactly one of: a token (or its key), or --user USERNAME")
    if token:
        key = token.strip()[: knox_constants.TOKEN_KEY_LENGTH]
        tokens = AuthToken.objects.filter(token_key=key)
        if not tokens.exists():
            raise GrantError(f"no token with the key {key!r} (the admin's API tokens list shows each key)")
    else:
        if not get_user_model().objects.filter(username=username).exists():
            raise GrantError(f"no user {username!r}")
        tokens = AuthToken.objects.filter(user__username=username)
    with transaction.atomic():
        removed = tuple(
            (
                t.user.get_username(),
                t.token_key,
                tuple(NamespaceGrant.objects.filter(token=t).values_list("namespace", flat=True).order_by("namespace")),
            )
            for t in tokens.select_related("user").order_by("created")
        )
        tokens.delete()  # grants go with their token (on_delete CASCADE)
    return Revoked(removed)

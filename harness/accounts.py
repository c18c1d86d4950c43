"""Test users and API clients: tenants with namespace grants and knox tokens, and staff.

Grants belong to tokens: ``account`` remembers the namespaces a tenant is
meant to read, and every token ``token_client`` makes for that user is granted them.
"""

from __future__ import annotations

from django.contrib.auth.models import User
from django.test import Client
from knox.models import AuthToken

from usage.models import NamespaceGrant

_NAMESPACES: dict[str, tuple[str, ...]] = {}


def account(name: str, *namespaces: str, staff: bool = False, superuser: bool = False) -> User:
    """A user meant to read ``namespaces`` (a tenant), or a staff user (with every permission
    if ``superuser``; a staff user without permissions reads no tenant through the API)."""
    user = User.objects.create_user(name, password="x", is_staff=staff or superuser, is_superuser=superuser)
    _NAMESPACES[name] = namespaces
    return user


def token_client(user: User, *namespaces: str) -> Client:
    """A client that sends ``Authorization: Token <token>`` for ``user``, its token granted
    ``namespaces`` (default: those given to ``account``)."""
    instance, token = AuthToken.objects.create(user=user, expiry=None)
    granted = namespaces or _NAMESPACES.get(user.username, ())
    NamespaceGrant.objects.bulk_create([NamespaceGrant(token=instance, user=user, namespace=ns) for ns in granted])
    return Client(HTTP_AUTHORIZATION=f"Token {token}")

"""Test users and API clients: tenants with namespace grants and knox tokens, and staff."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.test import Client
from knox.models import AuthToken

from usage.models import NamespaceGrant


def account(name: str, *namespaces: str, staff: bool = False, superuser: bool = False) -> User:
    """A user granted ``namespaces`` (a tenant), or a staff user (with every permission if
    ``superuser``; a staff user without permissions reads no tenant through the API)."""
    user = User.objects.create_user(name, password="x", is_staff=staff or superuser, is_superuser=superuser)
    NamespaceGrant.objects.bulk_create([NamespaceGrant(user=user, namespace=ns) for ns in namespaces])
    return user


def token_client(user: User) -> Client:
    """A client that sends ``Authorization: Token <token>`` for ``user``."""
    _, token = AuthToken.objects.create(user=user, expiry=None)
    return Client(HTTP_AUTHORIZATION=f"Token {token}")

"""Tenant API authentication: knox tokens, and a plain answer for the scheme most clients guess."""

from __future__ import annotations

from typing import Any

from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from rest_framework.authentication import get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request


class TokenAuthentication(KnoxTokenAuthentication):  # type: ignore[misc] # knox ships no types
    """``Authorization: Token <token>``. A token sent as ``Bearer <token>`` (what most HTTP
    clients and OAuth habits send) is answered with the scheme to use, not with "credentials
    were not provided", which reads as if the header never arrived."""

    def authenticate(self, request: Request) -> Any:
        scheme = get_authorization_header(request).split(b" ", 1)[0]
        if scheme.lower() == b"bearer":
            raise AuthenticationFailed(
                "the Authorization scheme is Token, not Bearer: send 'Authorization: Token <token>'"
            )
        return super().authenticate(request)

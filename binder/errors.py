"""Which failures are worth retrying: the one map from exceptions to transient or permanent.

A control plane meets two kinds of failure. Transient ones (a 409 from a concurrent
writer, a 429 or 5xx from a busy API server, a dropped connection, a database that
went away for a moment) heal by themselves: the work is left for the next pass or the
next watch, which start from fresh reads. Permanent ones (403 from missing RBAC, 404
for a kind the cluster does not serve, 422 for an object the server refuses) will
fail the same way again: they are logged loudly and counted, never retried in a loop.
Every caller (sync, the binder's status writes, finalizers) asks :func:`is_transient`.
"""

from __future__ import annotations

import socket

import urllib3.exceptions
from django.db import InterfaceError, OperationalError
from kubernetes.client import ApiException

#: HTTP statuses that heal by themselves: conflict, timeout, throttling, server trouble.
TRANSIENT_STATUSES = frozenset({408, 409, 410, 425, 429, 500, 502, 503, 504})


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` may succeed when tried again later."""
    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUSES or exc.status == 0 or exc.status is None
    return isinstance(
        exc,
        (
            urllib3.exceptions.HTTPError,
            ConnectionError,
            TimeoutError,
            socket.timeout,
            OperationalError,
            InterfaceError,
        ),
    )


def describe(exc: BaseException) -> str:
    """One line for logs: the HTTP status and reason of an API error, else the exception."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"

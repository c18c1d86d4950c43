"""Who may call the VMI webhook: the kube-apiserver, and nobody else.

A review names devices, and the answer or the denial says which VM a device belongs to,
the set's missing members, the tenant's budget and a Bound set's node; a call for a
Pending set writes bind requests and runs passes. So an unauthenticated caller gets 401
and learns nothing, before the body is read.

``GPUPLANE_WEBHOOK_AUTH`` picks how the apiserver proves itself:

- ``token``: ``Authorization: Bearer <token>``, compared in constant time with the token
  the apiserver's AdmissionConfiguration kubeconfig sends (``GPUPLANE_WEBHOOK_TOKEN_FILE``);
- ``client-cert``: the webhook server (``deploy/webhook_server.py``) verifies the TLS
  client certificate against ``GPUPLANE_WEBHOOK_CLIENT_CA`` during the handshake, so a
  request reaching Django on that server is the apiserver's; any other server (the API
  port) cannot tell and refuses;
- ``none``: no check (standalone trials, or a cluster whose apiserver cannot be configured,
  behind the NetworkPolicy that admits only the apiserver).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CallerPolicy:
    """The settings that decide who may call (read once per call from Django's settings)."""

    enabled: bool
    auth: str
    token: str
    serving: str
    cluster_mode: bool


def refusal(policy: CallerPolicy, headers: Mapping[str, str]) -> tuple[int, str] | None:
    """``(status, message)`` when this caller must be refused, else None.

    ``headers`` are the request's HTTP headers (case-insensitive mapping, e.g. Django's
    ``request.headers``). Messages say what to configure, never anything about the cluster.
    """
    if not policy.enabled:
        return 404, "the VMI webhook is off (GPUPLANE_WEBHOOK_ENABLED=false)"
    if policy.cluster_mode and policy.serving != "webhook":
        return 404, "in cluster mode the VMI webhook is served by the webhook server only, on its own port"
    if policy.auth == "none":
        return None
    if policy.auth == "client-cert":
        # Verified by the webhook server during the TLS handshake; nowhere else can it be.
        return None if policy.serving == "webhook" else (401, "authentication required")
    presented = headers.get("Authorization", "")
    scheme, _, credential = presented.partition(" ")
    if scheme.lower() != "bearer" or not credential.strip() or not policy.token:
        return 401, "authentication required"
    if not hmac.compare_digest(credential.strip().encode(), policy.token.encode()):
        return 401, "authentication required"
    return None

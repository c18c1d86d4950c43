"""``POST /webhooks/vmi``: the VMI admission webhook's HTTP side.

HTTP only, and lean: the webhook is on the path of every VMI the cluster creates, so a
call is a plain Django view (no DRF content negotiation, parsing or rendering: that was
a large part of a Bound call's CPU), decoded and encoded with orjson. In order: the
caller check (before the body is read: an unauthenticated caller learns nothing and
writes nothing), the size limit (before reading: 413), the JSON decode and the strict
review parser (400 naming the field), the decision from the process's read model
(``webhooks.binding.mirror_view``), and, when the set is not placed yet, the
bind-and-wait. Every answer is JSON, whatever the Accept header says: the caller is the
kube-apiserver, and a 406 would count as a failed call.

The kube-apiserver authenticates the webhook by TLS (added with the serving
certificate) or a bearer token (``webhooks.callers``); CSRF does not apply.

The OpenAPI schema still describes the endpoint: drf-spectacular documents DRF views
only, so the URL's view carries :class:`VmiAdmissionSchema` (a DRF view that is never
routed to, holding the schema) as its ``cls``.

The webhook server (``deploy/webhook_server.py``) may serve the application through
``webhooks.front.Front``: it admits a bounded number of calls per process and answers the
rest "try again" from granian's event loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import orjson
from django.conf import settings
from django.db import DatabaseError, InterfaceError
from django.http import HttpRequest, HttpResponse
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from webhooks import metrics
from webhooks.admission import (
    Action,
    MirrorView,
    Review,
    ReviewError,
    decide,
    error_body,
    parse_review,
    response,
)
from webhooks.binding import bind_and_wait, database_lost, mirror_view, pin, reconnecting, wait_budget
from webhooks.callers import CallerPolicy, refusal

#: The one media type a review may come as (the kube-apiserver sends it).
JSON_MEDIA_TYPE = "application/json"
#: The environ key holding a call's arrival (``time.monotonic()``) in the webhook server's
#: event loop (``webhooks.front.Front``).
ARRIVED = "gpuplane.arrived"


#: The outcome a final verdict is counted under (webhooks/metrics.py).
_OUTCOMES = {Action.ALLOW: "allowed", Action.PATCH: "patched", Action.DENY: "denied", Action.BIND: "denied"}


def caller_policy() -> CallerPolicy:
    return CallerPolicy(
        enabled=settings.GPUPLANE_WEBHOOK_ENABLED,
        auth=settings.GPUPLANE_WEBHOOK_AUTH,
        token=settings.GPUPLANE_WEBHOOK_TOKEN,
        serving=settings.GPUPLANE_SERVE,
        cluster_mode=settings.GPUPLANE_CLUSTER == "kubernetes",
    )


def _json(body: Mapping[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> HttpResponse:
    return HttpResponse(orjson.dumps(body), status=status, content_type=JSON_MEDIA_TYPE, headers=headers)


def _error(message: str, field: str, status: int) -> HttpResponse:
    return _json({"error": message, "field": field}, status)


class BodyError(ValueError):
    """The body is not a JSON document this endpoint reads (HTTP 400 naming ``(body)``)."""


def _reject_constant(value: str) -> Any:
    raise BodyError(f"JSON parse error - {value} is not valid JSON")


def decode_body(raw: bytes, content_type: str) -> Any:
    """The JSON document of a review body; :class:`BodyError` saying why not.

    orjson decodes the common case. What it refuses is decoded again by the standard
    library, strictly (no NaN or Infinity), so what was accepted before is still: a lone
    surrogate escape such as ``"\\ud800"`` decodes there and the review parser then names
    the field it is in.
    """
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise BodyError(f'Unsupported media type "{content_type[:100]}" in request.')
    if not raw:
        raise BodyError("JSON parse error - the body is empty")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as fast:
        try:
            text = raw.decode("utf-8")
            return json.loads(text, parse_constant=_reject_constant)
        except BodyError:
            raise
        except (ValueError, RecursionError):
            raise BodyError(f"JSON parse error - {fast}") from None


#: The OpenAPI shape of an AdmissionReview (only what the schema needs to say; the
#: strict checks are in ``webhooks.review.parse_review``).
ADMISSION_REVIEW = {
    "type": "object",
    "required": ["apiVersion", "kind"],
    "properties": {
        "apiVersion": {"type": "string", "example": "admission.k8s.io/v1"},
        "kind": {"type": "string", "example": "AdmissionReview"},
        "request": {"type": "object", "additionalProperties": True},
        "response": {"type": "object", "additionalProperties": True},
    },
}
WEBHOOK_ERROR = {
    "type": "object",
    "required": ["error", "field"],
    "properties": {"error": {"type": "string"}, "field": {"type": "string"}},
}


class Refused(NamedTuple):
    """An answer given without a decision: the status, the JSON body and any extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] | None = None


def _refused_error(message: str, field: str, status: int) -> Refused:
    return Refused(status, {"error": message, "field": field})


def gate(authorization: str, content_length: str) -> Refused | None:
    """The checks made before the body is read: who calls, and how much they send.

    Shared by the view and the webhook server's admission step (``webhooks.front.Front``), which
    makes them before it reads a body it is about to shed.
    """
    refused = refusal(caller_policy(), {"Authorization": authorization})
    if refused is not None:
        # Before the body is read: an unauthenticated caller learns nothing and writes nothing.
        status, message = refused
        headers = {"WWW-Authenticate": 'Bearer realm="gpuplane-webhook"'} if status == 401 else None
        return Refused(status, {"error": message, "field": "(caller)"}, headers)
    length = content_length or "0"
    limit = settings.GPUPLANE_WEBHOOK_MAX_BYTES
    if not length.isdigit() or int(length) > limit:
        # Refused before reading: nothing of an oversized body is held in memory.
        return _refused_error(f"the body is {length} bytes; at most {limit} are accepted", "(body)", 413)
    return None


def review_of(raw: bytes, content_type: str) -> Review | Refused:
    """The parsed review of a body that passed :func:`gate`, or the 400 naming what is wrong."""
    try:
        body = decode_body(raw, content_type)
    except BodyError as exc:
        return _refused_error(str(exc), "(body)", 400)
    try:
        return parse_review(body)
    except ReviewError as exc:
        return Refused(400, error_body(exc))


def admit(request: HttpRequest) -> HttpResponse:
    """One AdmissionReview v1 in, one out (HTTP 400 with a JSON error if malformed)."""
    # Its arrival in the webhook server's event loop (``webhooks.front.Front``), so time spent
    # queued for a thread counts against the caller's deadline; now, served any other way.
    started = request.META.get(ARRIVED) or time.monotonic()
    # The one header the check reads, without building ``request.headers`` from every header.
    refused = gate(request.META.get("HTTP_AUTHORIZATION", ""), request.META.get("CONTENT_LENGTH") or "")
    if refused is not None:
        metrics.observe(metrics.outcome_of_status(refused.status), started)
        return _json(refused.body, refused.status, refused.headers)
    try:
        raw = request.read()
    except OSError:
        metrics.observe("bad_request", started)
        return _error("the body could not be read", "(body)", 400)
    review = review_of(raw, request.META.get("CONTENT_TYPE") or "")
    if isinstance(review, Refused):
        metrics.observe(metrics.outcome_of_status(review.status), started)
        return _json(review.body, review.status, review.headers)
    outcome = ""
    try:
        if review.needs_mirror:
            view = reconnecting(mirror_view, review.namespace)
        else:
            view = MirrorView(namespace=review.namespace)
        verdict = pin(review, view, decide(review, view))
        if verdict.action is Action.BIND:
            budget = wait_budget(request.GET.get("timeout"))
            verdict = bind_and_wait(review, view, verdict, started, budget)
    except (DatabaseError, InterfaceError) as exc:
        # The database went away (dropped connection, restart, failover): a clear denial
        # the caller can retry, never a 500 (which failurePolicy would turn into a
        # less obvious refusal, or an admission without the node pin).
        verdict = database_lost(review, exc)
        outcome = "error"
    metrics.observe(outcome or _OUTCOMES[verdict.action], started)
    return _json(response(verdict))


class VmiAdmissionSchema(APIView):
    """The endpoint as the OpenAPI schema describes it (never routed to: :func:`admit` serves it)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="webhook_vmi",
        summary="VMI admission webhook (called by the kube-apiserver)",
        description=(
            "AdmissionReview v1 for a VirtualMachineInstance CREATE. Allows a VMI naming no gpuplane.io "
            "devices untouched; otherwise pins it to the node holding its GPU set (JSONPatch) or denies "
            "with the binder's reason. Malformed reviews get 400 naming the field; bodies over "
            "GPUPLANE_WEBHOOK_MAX_BYTES get 413. Only the kube-apiserver may call it (a verified TLS "
            "client certificate or the configured bearer token); others get 401."
        ),
        auth=[],
        request={"application/json": ADMISSION_REVIEW},
        responses={
            200: OpenApiResponse(ADMISSION_REVIEW, description="the AdmissionReview with its response"),
            400: OpenApiResponse(WEBHOOK_ERROR, description="malformed review: the field and why"),
            401: OpenApiResponse(WEBHOOK_ERROR, description="the caller is not the kube-apiserver"),
            404: OpenApiResponse(WEBHOOK_ERROR, description="the webhook is off, or not served on this port"),
            413: OpenApiResponse(WEBHOOK_ERROR, description="body too large"),
        },
    )
    def post(self, request: Request) -> Response:  # pragma: no cover - documentation only
        raise NotImplementedError("served by webhooks.views.admit")


class VmiAdmissionView(View):
    """``POST /webhooks/vmi`` (any other method: 405)."""

    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> HttpResponse:
        return admit(request)

    def http_method_not_allowed(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return _json({"error": f'method "{request.method}" not allowed', "field": "(method)"}, 405, {"Allow": "POST"})

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Callable[..., HttpResponse]:
        """The view, CSRF-exempt, carrying the schema's DRF view for drf-spectacular."""
        view: Any = csrf_exempt(super().as_view(**initkwargs))
        view.cls = VmiAdmissionSchema
        view.initkwargs = {}
        return view  # type: ignore[no-any-return]

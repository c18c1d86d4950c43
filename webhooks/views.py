"""``POST /webhooks/vmi``: the VMI admission webhook's HTTP side (SPEC §5).

HTTP only: parse the body, read the mirror slice the decision needs, call the pure
decision (``webhooks.admission.decide``), and, when the set is not placed yet, the
bind-and-wait (``webhooks.binding``); then answer the AdmissionReview.

The kube-apiserver authenticates the webhook by TLS (added with the serving
certificate), so there is no DRF authentication here, and CSRF does not apply.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import APIException
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from webhooks.admission import Action, MirrorView, ReviewError, decide, error_body, parse_review, response
from webhooks.binding import bind_and_wait, database_unavailable, mirror_view, reconnecting, wait_budget
from webhooks.callers import CallerPolicy, refusal


def caller_policy() -> CallerPolicy:
    return CallerPolicy(
        enabled=settings.GPUPLANE_WEBHOOK_ENABLED,
        auth=settings.GPUPLANE_WEBHOOK_AUTH,
        token=settings.GPUPLANE_WEBHOOK_TOKEN,
        serving=settings.GPUPLANE_SERVE,
        cluster_mode=settings.GPUPLANE_CLUSTER == "kubernetes",
    )


class _AlwaysJson(DefaultContentNegotiation):
    """Answer JSON whatever the Accept header says: the caller is the kube-apiserver, and a
    406 would count as a failed call (and fall under failurePolicy)."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        first = next(iter(renderers))
        return first, first.media_type


#: The OpenAPI shape of an AdmissionReview (only what the schema needs to say; the
#: strict checks are in ``webhooks.admission.parse_review``).
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


class VmiAdmissionView(APIView):
    """AdmissionReview v1 in, AdmissionReview v1 out (HTTP 400 with a JSON error if malformed)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    parser_classes = [JSONParser]
    #: JSON whatever the Accept header says (no browsable-API HTML for a machine caller).
    renderer_classes = [JSONRenderer]
    content_negotiation_class = _AlwaysJson

    @extend_schema(
        operation_id="webhook_vmi",
        summary="VMI admission webhook (called by the kube-apiserver)",
        description=(
            "AdmissionReview v1 for a VirtualMachineInstance CREATE. Allows a VMI naming no gpuplane.io "
            "devices untouched; otherwise pins it to the node holding its GPU set (JSONPatch) or denies "
            "with the binder's reason. Malformed reviews get 400 naming the field; bodies over "
            "GPUPLANE_WEBHOOK_MAX_BYTES get 413. No authentication: serve it over TLS to the apiserver only."
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
    def post(self, request: Request) -> Response:
        started = time.monotonic()
        refused = refusal(caller_policy(), request.headers)
        if refused is not None:
            # Before the body is read: an unauthenticated caller learns nothing and writes nothing.
            status, message = refused
            headers = {"WWW-Authenticate": 'Bearer realm="gpuplane-webhook"'} if status == 401 else None
            return Response({"error": message, "field": "(caller)"}, status=status, headers=headers)
        length = request.META.get("CONTENT_LENGTH") or "0"
        limit = settings.GPUPLANE_WEBHOOK_MAX_BYTES
        if not length.isdigit() or int(length) > limit:
            # Refused before reading: DRF's parser would read any size into memory.
            message = f"the body is {length} bytes; at most {limit} are accepted"
            return Response({"error": message, "field": "(body)"}, status=413)
        try:
            body = request.data
        except (APIException, RecursionError, ValueError) as exc:
            # A parse error, an unsupported media type or a body nested too deep for the
            # JSON decoder: the caller's fault, always a 400 with a JSON body.
            detail = getattr(exc, "detail", None) or "the body is not valid JSON"
            return Response({"error": str(detail), "field": "(body)"}, status=400)
        try:
            review = parse_review(body)
        except ReviewError as exc:
            return Response(error_body(exc), status=400)
        try:
            if review.needs_mirror:
                view = reconnecting(mirror_view, review.namespace)
            else:
                view = MirrorView(namespace=review.namespace)
            verdict = decide(review, view)
            if verdict.action is Action.BIND:
                budget = wait_budget(request.query_params.get("timeout"))
                verdict = bind_and_wait(review, view, verdict, started, budget)
        except (DatabaseError, InterfaceError) as exc:
            # The database went away (dropped connection, restart, failover): a clear denial
            # the caller can retry, never a 500 (which failurePolicy would turn into a
            # less obvious refusal, or an admission without the node pin).
            verdict = database_unavailable(review, exc)
        return Response(response(verdict))

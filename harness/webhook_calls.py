"""Calling the VMI webhook through Django's test client, and reading its AdmissionReview
answer the way the kube-apiserver does (envelope, uid, patch or denial shaped like the
captured responses in tests/fixtures/kubernetes)."""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any

import jsonpatch

from harness.shapes import real

if TYPE_CHECKING:
    from django.test import Client

URL = "/webhooks/vmi"
RESPONSE_ALLOWED = real("admissionreview-v1-response-allowed-patch.json")
RESPONSE_DENIED = real("admissionreview-v1-response-denied.json")


def post(client: Client, body: Any, *, raw: bytes | str | None = None, content_type: str = "application/json") -> Any:
    data = raw if raw is not None else json.dumps(body)
    return client.post(URL, data=data, content_type=content_type)


def answer_of(resp: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Check the envelope like the apiserver does and return ``response``."""
    assert resp.status_code == 200, resp.content
    out = resp.json()
    assert out["apiVersion"] == "admission.k8s.io/v1"
    assert out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == body["request"]["uid"]
    assert set(out) == {"apiVersion", "kind", "response"}
    return out["response"]  # type: ignore[no-any-return]


def allowed_patch(resp: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The patched VMI of an allow-with-patch response (shape as the captured one)."""
    answer = answer_of(resp, body)
    assert answer["allowed"] is True, answer
    assert set(answer) <= set(RESPONSE_ALLOWED["response"])
    assert answer["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(answer["patch"], validate=True))
    assert isinstance(ops, list) and ops
    return jsonpatch.apply_patch(body["request"]["object"], ops)  # type: ignore[no-any-return]


def denied(resp: Any, body: dict[str, Any]) -> str:
    """The message of a denial (shape as the captured one, code 403, no patch)."""
    answer = answer_of(resp, body)
    assert answer["allowed"] is False, answer
    assert set(answer) == set(RESPONSE_DENIED["response"])
    assert "patch" not in answer and "patchType" not in answer
    assert answer["status"]["code"] == 403
    return answer["status"]["message"]  # type: ignore[no-any-return]

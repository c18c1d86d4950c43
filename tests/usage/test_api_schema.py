"""Every operation of ``/api/schema/`` fuzzed by schemathesis: no 5xx, answers match the schema.

Schemathesis reads the OpenAPI document the project serves, generates requests from it
(path and query parameters, valid and not), sends them to the WSGI app and checks each
response: not a server error, a documented status code, a documented content type, a
body that matches the documented schema. Generated namespaces are random, so each case
also runs with its namespace (and device name) replaced by real ones: once for the
tenant's own namespace (the 200 paths) and once for another tenant's (the 404 paths).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from harness.accounts import account
from harness.factories import two_tenants

pytestmark = pytest.mark.django_db


@contextlib.contextmanager
def connections_kept() -> Iterator[None]:
    """Like Django's test client, keep the request signals from closing the database
    connection after each request schemathesis sends to the WSGI app: it holds the
    test's transaction."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


#: A valid request may still be a 404: another tenant's or an unknown namespace or device
#: (the fuzzer's random names), or a page past the last one. Each is documented.
CONFIG = SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", "401", "404"]}}}
)


def load_schema() -> Any:
    """The schema as served (no database needed: schema generation reads no rows)."""
    from gpuplane.wsgi import application

    with connections_kept():
        return schemathesis.openapi.from_wsgi("/api/schema/?format=json", application, config=CONFIG)


# Loaded at collection: schemathesis's lazy fixture loader does not work with pytest 9.
schema = load_schema()


@pytest.fixture
def api_schema() -> Any:
    return schema


@pytest.fixture
def tenant_token(db: Any) -> str:
    from knox.models import AuthToken

    load_objects(two_tenants())
    run_pass("full")
    _, token = AuthToken.objects.create(user=account("alice", "t1"), expiry=None)
    return token


REAL_NAMES = {"t1": "vm1-gpu0", "t2": "vm9-gpu0"}


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_conforms_and_never_fails(case: Any, tenant_token: str) -> None:
    headers = {"Authorization": f"Token {tenant_token}"}
    with connections_kept():
        _call_all(case, headers)


#: Rules between parameters that OpenAPI cannot state, so schemathesis may send "valid"
#: requests the API rightly refuses with a 400 naming the parameter: the usage window
#: needs ``from`` before ``to``; the catalog's ``devices`` and ``classes`` come together (an
#: order), and ``classes`` lists each class once. Every other check still runs on these operations.
#: The webhook's schema says "an AdmissionReview object"; what a VMI review must hold
#: (kubevirt.io kind, CREATE, deviceNames, ...) is checked by ``parse_review`` and
#: answered 400 naming the field, so schema-valid bodies are rightly refused too.
CROSS_PARAMETER_RULES = {"tenant_usage", "webhook_vmi", "catalog_gpu_options"}


def _call_all(case: Any, headers: dict[str, str]) -> None:
    excluded = (
        [positive_data_acceptance] if case.operation.definition.raw.get("operationId") in CROSS_PARAMETER_RULES else []
    )
    case.call_and_validate(headers=headers, excluded_checks=excluded)
    for namespace, device in REAL_NAMES.items():
        if "namespace" in (case.path_parameters or {}):
            case.path_parameters["namespace"] = namespace
            if "name" in case.path_parameters:
                case.path_parameters["name"] = device
        elif case.query is not None and "namespace" in case.query:
            case.query["namespace"] = namespace
        else:
            break
        case.call_and_validate(headers=headers, excluded_checks=excluded)


def test_schema_lists_every_api_endpoint(api_schema: Any) -> None:
    paths = set(api_schema.raw_schema["paths"])
    assert paths == {
        "/api/v1/catalog/gpu-options",
        "/api/v1/tenants/{namespace}/usage",
        "/api/v1/tenants/{namespace}/usage-records",
        "/api/v1/devices",
        "/api/v1/devices/{namespace}/{name}",
        "/api/v1/devices/{namespace}/{name}/decisions",
        "/webhooks/vmi",
    }


def test_docs_ui_is_served_without_a_cdn(client: Any) -> None:
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "swagger-ui" in html
    # Every script and stylesheet comes from this server: no host in any src or href. (The
    # page also carries a random CSRF token, which may spell "cdn": look at URLs, not letters.)
    urls = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']+)["\']', html)
    assert urls, html
    assert [u for u in urls if not u.startswith("/") or u.startswith("//")] == []
    assert "cdn." not in html.lower() and "//unpkg" not in html and "jsdelivr" not in html

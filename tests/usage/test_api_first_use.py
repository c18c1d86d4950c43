"""The tenant API as a newcomer first calls it: the scheme a token is sent with, dates,
errors in CSV mode, phases in any case, and the URLs people type first (``/``,
``/api/v1/``, a trailing slash)."""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from binder import models

pytestmark = pytest.mark.django_db

API = "/api/v1"


@pytest.fixture
def token() -> str:
    models.Namespace.objects.create(name="t1", uid="uid-t1")
    out = io.StringIO()
    call_command("issue_token", "alice", "--namespaces", "t1", stdout=out)
    return out.getvalue().strip().splitlines()[-1]


def get(client: Client, path: str, auth: str) -> Any:
    return client.get(f"{API}{path}", HTTP_AUTHORIZATION=auth)


def csv_error(response: Any) -> str:
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0] == ["error"], rows
    return rows[1][0]


def test_a_bearer_token_is_told_the_scheme_is_token(client: Client, token: str) -> None:
    response = get(client, "/tenants/t1/usage", f"Bearer {token}")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Token")
    assert "scheme is Token, not Bearer" in response.json()["detail"]
    assert get(client, "/tenants/t1/usage", f"Token {token}").status_code == 200


@pytest.mark.parametrize("path", ["/tenants/t1/usage?from=nope", "/tenants/t1/usage-records?from=nope"])
def test_a_bad_date_lists_both_accepted_forms(client: Client, token: str, path: str) -> None:
    response = get(client, path, f"Token {token}")
    assert response.status_code == 400
    (message,) = response.json()["from"]
    assert "YYYY-MM-DD" in message and "RFC 3339" in message
    assert get(client, path.replace("nope", "2026-11-01"), f"Token {token}").status_code == 200


@pytest.mark.parametrize(
    ("path", "auth"),
    [
        ("/tenants/t1/usage-records?from=nope", "Token {token}"),
        ("/tenants/t1/usage-records?phase=nope", "Token {token}"),
        ("/tenants/nope/usage-records", "Token {token}"),
        ("/tenants/t1/usage-records", "Token not-a-token"),
        ("/tenants/t1/usage-records", "Bearer {token}"),
    ],
)
def test_csv_mode_errors_say_what_json_mode_says(client: Client, token: str, path: str, auth: str) -> None:
    auth = auth.format(token=token)
    as_json = get(client, path, auth)
    as_csv = get(client, path + ("&" if "?" in path else "?") + "format=csv", auth)
    assert as_csv.status_code == as_json.status_code >= 400
    body = as_json.json()
    words = body["detail"] if list(body) == ["detail"] else "; ".join(f"{k}: {', '.join(v)}" for k, v in body.items())
    assert csv_error(as_csv) == words


def test_a_format_an_endpoint_does_not_offer_says_which_it_does(client: Client, token: str) -> None:
    response = get(client, "/tenants/t1/usage?format=csv", f"Token {token}")
    assert response.status_code == 404
    assert response.json()["detail"] == "format=csv is not offered here; this endpoint answers json"


@pytest.mark.parametrize("path", ["/tenants/t1/usage-records?phase={phase}", "/devices?phase={phase}"])
def test_phase_in_any_case_and_a_wrong_one_lists_the_choices(client: Client, token: str, path: str) -> None:
    auth = f"Token {token}"
    assert get(client, path.format(phase="bound"), auth).status_code == 200
    assert get(client, path.format(phase="BOUND"), auth).status_code == 200
    response = get(client, path.format(phase="gone"), auth)
    assert response.status_code == 400
    (message,) = response.json()["phase"]
    assert "'gone' is not one of" in message and "Bound" in message and "Lost" in message


def test_the_root_redirects_to_the_admin(client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/admin/"


def test_api_v1_lists_its_endpoints(client: Client) -> None:
    response = client.get(f"{API}/")
    assert response.status_code == 200
    listed = [e["url"] for e in response.json()["endpoints"]]
    assert "http://testserver/api/v1/tenants/{namespace}/usage?from=&to=" in listed
    assert "http://testserver/api/v1/devices" in listed
    assert "Token" in response.json()["authentication"]


@pytest.mark.parametrize("path", ["/tenants/t1/usage", "/tenants/t1/usage-records"])
def test_a_trailing_slash_gives_the_same_answer(client: Client, token: str, path: str) -> None:
    bare = get(client, path, f"Token {token}")
    slashed = get(client, path + "/", f"Token {token}")
    assert slashed.status_code == bare.status_code == 200
    assert slashed["Content-Type"] == "application/json"
    assert slashed.json().keys() == bare.json().keys()

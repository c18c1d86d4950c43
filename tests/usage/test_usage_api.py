"""The tenant API: usage, usage records (filters, pages, CSV), devices and their
decisions, tokens from ``issue_token``, and isolation: another tenant's namespace is 404
on every endpoint, no credentials 401.

The cluster (the ``cluster`` fixture of tests/conftest.py: ``harness.factories.two_tenants``)
is built from the real captures and placed by real full passes at times the ``clock``
fixture sets, so records and decisions come from the binder, not from fixtures.
"""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from knox.models import AuthToken

from binder import models
from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from harness.accounts import account, token_client
from harness.clock import Clock
from harness.factories import A100, FORGED_UNITS, TENANT_B_URLS, second_choice
from harness.shapes import H100, NOW
from usage.models import NamespaceGrant, UsageRecord


def get(client: Client, url: str, **params: Any) -> Any:
    answer = client.get(url, params)
    assert answer.status_code == 200, (url, answer.status_code, answer.content[:500])
    return answer.json()


# -- usage ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_usage_current_limits_open_records_and_gpu_hours(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    body = get(client, "/api/v1/tenants/t1/usage", **{"from": (NOW - timedelta(days=1)).isoformat()})
    assert body["namespace"] == "t1"
    assert body["window"]["to"] == cluster.now.isoformat().replace("+00:00", "Z")
    keys = {k["key"]: k for k in body["keys"]}
    # Class key: the 2 devices. Raw key: the devices plus the forged pod's 3 GPUs in full;
    # the real launcher adds nothing (its GPUs are the devices).
    nothing_lent = {"borrowing": None, "borrowed": 0, "borrowedGpuHours": 0.0}
    assert keys["h100"] == {"key": "h100", "kind": "class", "used": 2, "limit": 4, "remaining": 2, "gpuHours": 6.0,
                            **nothing_lent}  # fmt: skip
    assert keys[H100] == {"key": H100, "kind": "raw", "used": 5, "limit": 8, "remaining": 3, "gpuHours": 15.0,
                          **nothing_lent}  # fmt: skip
    # 3 hours: 2 devices (2 h on n1, then 1 h on n3) + the forged pod's 3 GPUs: each GPU once.
    assert body["gpuHours"] == {"total": 15.0, "devices": 6.0, "pods": 9.0, "borrowed": 0.0}
    assert sorted((r["subject"], r["node"], r["units"]) for r in body["openRecords"]) == [
        ("virt-launcher-vm1-fake1", "n1", FORGED_UNITS),
        ("vm1-gpu0", "n3", 1),
        ("vm1-gpu1", "n3", 1),
    ]
    assert all(r["open"] and r["end"] is None for r in body["openRecords"])


@pytest.mark.django_db
def test_usage_window_is_clipped_and_defaults_to_30_days(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    body = get(client, "/api/v1/tenants/t1/usage")
    assert body["window"]["from"] == (cluster.now - timedelta(days=30)).isoformat().replace("+00:00", "Z")
    assert body["gpuHours"]["total"] == 15.0
    one_hour = get(
        client, "/api/v1/tenants/t1/usage", **{"from": NOW.isoformat(), "to": (NOW + timedelta(hours=1)).isoformat()}
    )
    assert one_hour["gpuHours"] == {"total": 5.0, "devices": 2.0, "pods": 3.0, "borrowed": 0.0}
    as_date = get(client, "/api/v1/tenants/t1/usage", **{"from": "2026-11-30", "to": "2026-12-01"})
    assert as_date["gpuHours"]["total"] == 15.0  # the whole history lies inside that day


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"from": "yesterday"}, "from", "format"),
        ({"to": "2026-13-01"}, "to", "format"),
        ({"from": "2026-12-01T00:00:00Z", "to": "2026-11-01T00:00:00Z"}, "from", "before"),
    ],
)
def test_bad_window_is_400_naming_the_parameter(cluster: Clock, params: dict[str, str], field: str, words: str) -> None:
    client = token_client(account("alice", "t1"))
    answer = client.get("/api/v1/tenants/t1/usage", params)
    assert answer.status_code == 400
    assert words in answer.json()[field][0].lower()


# -- records ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_records_filters_and_pagination(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    url = "/api/v1/tenants/t1/usage-records"
    everything = get(client, url)
    assert everything["count"] == 5  # 2 closed on n1, 2 open on n3, the forged pod
    first = everything["results"][0]
    assert set(first) == {
        "id", "namespace", "subjectKind", "subject", "subjectUid", "vmName", "key", "resourceName", "units", "node",
        "phase", "start", "end", "open", "gpuHours", "openedByPass", "closedByPass", "borrowed",
    }  # fmt: skip
    closed = get(client, url, open="false")
    assert {(r["node"], r["gpuHours"]) for r in closed["results"]} == {("n1", 2.0)}
    assert get(client, url, subject_kind="Pod")["results"][0]["subject"] == "virt-launcher-vm1-fake1"
    assert get(client, url, key="h100", node="n3")["count"] == 2
    assert get(client, url, phase="Raw")["count"] == 1
    assert get(client, url, subject="vm1-gpu0")["count"] == 2
    assert get(client, url, vm="vm1")["count"] == 4
    # Time range: records held at some time in [from, to).
    late = (NOW + timedelta(hours=2, minutes=30)).isoformat()
    assert get(client, url, **{"from": late})["count"] == 3  # the open ones
    assert get(client, url, to=(NOW + timedelta(minutes=1)).isoformat())["count"] == 3  # opened by the first pass
    page = get(client, url, page_size=2, page=2)
    assert (page["count"], len(page["results"]), page["next"] is not None) == (5, 2, True)
    bad = client.get(url, {"phase": "Running"})
    assert bad.status_code == 400 and "phase" in bad.json()


@pytest.mark.django_db
def test_records_csv_export_has_every_match(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    answer = client.get("/api/v1/tenants/t1/usage-records", {"format": "csv", "key": "h100"})
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/csv")
    assert "attachment" in answer["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(answer.streaming_content).decode())))
    assert len(rows) == 4
    assert {r["namespace"] for r in rows} == {"t1"}
    assert sum(float(r["gpuHours"]) for r in rows) == pytest.approx(6.0)
    assert sorted(r["end"] == "" for r in rows) == [False, False, True, True]


@pytest.mark.django_db
def test_csv_errors_are_csv_too(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    answer = client.get("/api/v1/tenants/t2/usage-records", {"format": "csv"})
    assert answer.status_code == 404
    assert answer.content.decode().splitlines()[0] == "error"


@pytest.mark.django_db
def test_a_device_held_as_its_second_choice_is_listed_under_that_class(clock: Clock) -> None:
    """The set orders h100 or a100 and is held as a100: the tenant's usage, its records and
    their CSV all say a100 (with a100's resource), never h100."""
    load_objects(second_choice())
    run_pass("full")
    clock.advance(hours=2)
    client = token_client(account("alice", "t1"))
    body = get(client, "/api/v1/tenants/t1/usage")
    keys = {k["key"]: k for k in body["keys"]}
    assert (keys["a100"]["kind"], keys["a100"]["used"], keys["a100"]["gpuHours"]) == ("class", 2, 4.0)
    assert keys[A100]["used"] == 2
    assert keys.get("h100", {}).get("used", 0) == 0 and keys.get("h100", {}).get("gpuHours", 0) == 0
    assert sorted((r["subject"], r["key"], r["resourceName"]) for r in body["openRecords"]) == [
        ("vm1-gpu0", "a100", A100),
        ("vm1-gpu1", "a100", A100),
    ]
    url = "/api/v1/tenants/t1/usage-records"
    assert get(client, url, key="a100")["count"] == 2
    assert get(client, url, key="h100")["count"] == 0
    answer = client.get(url, {"format": "csv"})
    assert answer.status_code == 200
    rows = list(csv.DictReader(io.StringIO(b"".join(answer.streaming_content).decode())))
    assert sorted((r["subject"], r["key"], r["resourceName"], float(r["gpuHours"])) for r in rows) == [
        ("vm1-gpu0", "a100", A100, 2.0),
        ("vm1-gpu1", "a100", A100, 2.0),
    ]


@pytest.mark.django_db
def test_a_device_lists_its_choices_and_the_class_it_is_held_as(clock: Clock) -> None:
    """The devices API says what the order accepts and what it holds: h100 or a100, held as
    a100 once bound; while still Pending it is booked as its first choice."""
    load_objects(second_choice())
    models.GpuDevice.objects.update(phase=models.Phase.PENDING)  # as loaded: not placed yet
    client = token_client(account("alice", "t1"))
    pending = get(client, "/api/v1/devices/t1/vm1-gpu0")
    assert (pending["className"], pending["alternativeClassNames"], pending["heldClassName"]) == (
        "h100",
        ["a100"],
        "h100",
    )
    run_pass("full")
    listed = get(client, "/api/v1/devices")["results"]
    assert [(d["name"], d["phase"], d["className"], d["heldClassName"]) for d in listed] == [
        ("vm1-gpu0", "Bound", "h100", "a100"),
        ("vm1-gpu1", "Bound", "h100", "a100"),
    ]


# -- devices and decisions --------------------------------------------------------------------


@pytest.mark.django_db
def test_devices_and_their_decision_history(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    devices = get(client, "/api/v1/devices")["results"]
    assert [(d["namespace"], d["name"], d["phase"], d["node"]) for d in devices] == [
        ("t1", "vm1-gpu0", "Bound", "n3"),
        ("t1", "vm1-gpu1", "Bound", "n3"),
    ]
    assert "drain" in devices[0]["reason"]
    assert get(client, "/api/v1/devices", phase="Lost")["count"] == 0
    one = get(client, "/api/v1/devices/t1/vm1-gpu0")
    assert one["className"] == "h100" and one["vmName"] == "vm1"
    assert (one["alternativeClassNames"], one["heldClassName"]) == ([], "h100")
    history = get(client, "/api/v1/devices/t1/vm1-gpu0/decisions")["results"]
    assert len(history) == 1  # loaded Bound on n1 (no change), then moved
    move = history[0]
    assert (move["fromPhase"], move["fromNode"], move["toPhase"], move["toNode"]) == ("Bound", "n1", "Bound", "n3")
    assert move["passKind"] == "full" and isinstance(move["passId"], int)
    assert "gpuplane.io/drain=true" in move["reason"]
    # The history outlives the device.
    models.GpuDevice.objects.filter(name="vm1-gpu0").delete()
    assert len(get(client, "/api/v1/devices/t1/vm1-gpu0/decisions")["results"]) == 1
    assert client.get("/api/v1/devices/t1/vm1-gpu0").status_code == 404
    assert client.get("/api/v1/devices/t1/never-existed/decisions").status_code == 404


# -- isolation --------------------------------------------------------------------------------

UNKNOWN_URLS = [u.replace("t2", "nosuch") for u in TENANT_B_URLS]


@pytest.mark.django_db
def test_tenant_a_gets_404_for_tenant_b_on_every_endpoint(cluster: Clock) -> None:
    alice = token_client(account("alice", "t1"))
    for url in TENANT_B_URLS:
        answer = alice.get(url)
        assert answer.status_code == 404, url
    # The same answer as for a namespace that does not exist: names do not leak.
    for theirs, nobody in zip(TENANT_B_URLS, UNKNOWN_URLS, strict=True):
        assert alice.get(theirs).content.replace(b"t2", b"X") == alice.get(nobody).content.replace(b"nosuch", b"X")
    # Lists never show tenant B's rows either.
    assert {d["namespace"] for d in get(alice, "/api/v1/devices")["results"]} == {"t1"}
    # Tenant B itself reads them; staff read both.
    bob = token_client(account("bob", "t2"))
    for url in TENANT_B_URLS:
        assert bob.get(url).status_code == 200, url
    staff = token_client(account("root", staff=True, superuser=True))
    assert {d["namespace"] for d in get(staff, "/api/v1/devices")["results"]} == {"t1", "t2"}
    assert get(staff, "/api/v1/tenants/t2/usage")["gpuHours"]["total"] == pytest.approx(6.0)  # 1 a10 + 1 raw, 3 h


@pytest.mark.django_db
@pytest.mark.parametrize("url", [*TENANT_B_URLS, "/api/v1/devices"])
def test_no_credentials_or_a_bad_token_is_401(cluster: Clock, url: str) -> None:
    answer = Client().get(url)
    assert answer.status_code == 401, url
    assert answer["WWW-Authenticate"] == "Token"
    assert Client(HTTP_AUTHORIZATION="Token gpp_nope").get(url).status_code == 401


@pytest.mark.django_db
def test_expired_token_is_401(cluster: Clock) -> None:
    user = account("alice", "t1")
    instance, token = AuthToken.objects.create(user=user, expiry=timedelta(hours=1))
    NamespaceGrant.objects.create(token=instance, user=user, namespace="t1")
    client = Client(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/tenants/t1/usage").status_code == 200
    cluster.advance(hours=2)
    assert client.get("/api/v1/tenants/t1/usage").status_code == 401


@pytest.mark.django_db
def test_deleted_namespace_history_stays_readable(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    models.Namespace.objects.filter(name="t1").delete()
    run_pass("full")
    body = get(client, "/api/v1/tenants/t1/usage")
    assert body["openRecords"] == [] and body["gpuHours"]["total"] == pytest.approx(15.0)
    assert UsageRecord.objects.filter(namespace="t1", end__isnull=True).count() == 0


# -- issue_token ------------------------------------------------------------------------------


def issue(*args: str) -> list[str]:
    out = io.StringIO()
    call_command("issue_token", *args, stdout=out)
    return out.getvalue().splitlines()


@pytest.mark.django_db
def test_issue_token_creates_user_grants_and_prints_the_token_last(cluster: Clock) -> None:
    lines = issue("carol", "--namespaces", "t1, t2,t1")
    token = lines[-1]
    assert token.startswith("gpp_") and " " not in token
    assert "this token may read: t1, t2" in "\n".join(lines)
    client = Client(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/tenants/t2/usage").status_code == 200
    assert client.get("/admin/").status_code == 302  # a token does not open the admin
    # Again with --only: a second token, and t2 revoked.
    second = issue("carol", "--namespaces", "t1", "--only", "--days", "0")
    assert "expires: never" in "\n".join(second)
    assert client.get("/api/v1/tenants/t2/usage").status_code == 404
    assert Client(HTTP_AUTHORIZATION=f"Token {second[-1]}").get("/api/v1/tenants/t1/usage").status_code == 200
    assert set(NamespaceGrant.objects.filter(user__username="carol").values_list("namespace", flat=True)) == {"t1"}
    assert AuthToken.objects.filter(user__username="carol").count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dave", "--namespaces", "Bad_Name"], "'Bad_Name' is not a namespace name"),
        (["dave", "--namespaces", "t1", "--days", "-1"], "--days"),
    ],
)
def test_issue_token_bad_input_is_a_clear_error_and_writes_nothing(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("issue_token", *args, stdout=io.StringIO())
    assert not NamespaceGrant.objects.exists()
    assert not AuthToken.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("url", "params", "field"),
    [
        ("/api/v1/tenants/t1/usage-records", {"phase": ""}, "phase"),
        ("/api/v1/tenants/t1/usage-records", {"to": ""}, "to"),
        ("/api/v1/tenants/t1/usage-records", {"open": "maybe"}, "open"),
        ("/api/v1/tenants/t1/usage-records", {"page": "0"}, "page"),
        ("/api/v1/tenants/t1/usage-records", {"page_size": "5000"}, "page_size"),
        ("/api/v1/tenants/t1/usage-records", {"format": "csv", "page": "-3"}, "page"),
        ("/api/v1/tenants/t1/usage-records", {"format": ""}, "format"),
        ("/api/v1/tenants/t1/usage", {"from": ""}, "from"),
        ("/api/v1/devices", {"phase": ""}, "phase"),
    ],
)
def test_bad_or_empty_typed_parameter_is_400_naming_it(
    cluster: Clock, url: str, params: dict[str, str], field: str
) -> None:
    client = token_client(account("alice", "t1"))
    answer = client.get(url, params)
    assert answer.status_code == 400, answer.content[:300]
    if params.get("format") == "csv":
        assert field in answer.content.decode()
    else:
        assert field in answer.json(), answer.json()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("url", "params"),
    [
        ("/api/v1/tenants/t1/usage-records", {"from": "5430-11-14T14:35:54+19:10"}),
        ("/api/v1/tenants/t1/usage-records", {"to": "2026-11-30T12:00:00+23:59"}),
        ("/api/v1/tenants/t1/usage", {"to": "2026-12-01T00:00:00-20:00"}),
    ],
)
def test_offsets_beyond_postgresqls_range_are_read_in_utc(cluster: Clock, url: str, params: dict[str, str]) -> None:
    """Python takes offsets up to ±23:59, PostgreSQL ±15:59: times are turned into UTC first
    (schemathesis found +19:10 answering a 500 on PostgreSQL)."""
    answer = token_client(account("alice", "t1")).get(url, params)
    assert answer.status_code == 200, answer.content[:300]


@pytest.mark.django_db
def test_a_time_outside_the_years_1_to_9999_in_utc_is_400(cluster: Clock) -> None:
    client = token_client(account("alice", "t1"))
    answer = client.get("/api/v1/tenants/t1/usage-records", {"to": "0001-01-01T00:00:00+05:00"})
    assert answer.status_code == 400 and "to" in answer.json()
    answer = client.get("/api/v1/tenants/t1/usage", {"from": "0001-01-01T00:00:00+05:00"})
    assert answer.status_code == 400 and "from" in answer.json()

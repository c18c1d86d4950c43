"""The first staff pages (placement board, budgets, usage chart, decision log, actions),
through Django's test client: who may open them, what they show, that bad parameters are
a clear 400 and never a 500, and that the board costs the same number of queries for
three nodes as for sixty."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from binder import models
from binder.actions import PassOutcome, full_pass_now
from binder.mirror.snapshot import load_file
from binder.reports.state import cluster_state
from binder.runtime import readmodel
from binder.runtime.passes import run_pass
from harness.accounts import account, token_client
from harness.shapes import (
    A10,
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    write_snapshot,
)
from usage.daily import daily_gpu_hours
from usage.models import UsageRecord
from usage.queries import gpu_hours

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

BOARD = "admin:placement-board"
PAGES = ("admin:placement-board", "admin:budgets", "admin:usage-chart", "admin:binder_lostset_changelist")


@pytest.fixture
def cluster(tmp_path: Path) -> dict[str, Any]:
    """After one pass: n1 (A10 ×4) holds team-a's vm-a (2 devices) and team-b's raw pod (1
    unit); n2 (H100 ×4) holds team-b's vm-big (2 devices × 2 units); team-a's vm-lost (3 × 2
    units) was on n3, NotReady for days, and went Lost (n2 has 4 units, n4 is cordoned).
    Then, without a pass, n2 shrinks to 2 units (over-booked) and n4 is labelled to drain."""
    objects = [
        namespace_obj("team-a"),
        namespace_obj("team-b"),
        node_obj("n1", {A10: 4}),
        node_obj("n2", {H100: 4}),
        node_obj("n3", {H100: 4}, ready=False, transition="2026-11-28T08:00:00Z"),
        node_obj("n4", {H100: 4}, unschedulable=True),
        class_obj("a10", A10),
        class_obj("h100x2", H100, units=2),
        gpu_obj("team-a", "a0", "a10", "vm-a", created="2026-11-01T00:00:00Z"),
        gpu_obj("team-a", "a1", "a10", "vm-a", created="2026-11-01T00:00:00Z"),
        gpu_obj("team-b", "b0", "h100x2", "vm-big", created="2026-11-02T00:00:00Z"),
        gpu_obj("team-b", "b1", "h100x2", "vm-big", created="2026-11-02T00:00:00Z"),
        *(gpu_obj("team-a", f"l{i}", "h100x2", "vm-lost", phase="Bound", node="n3") for i in range(3)),
        plain_pod_obj("team-b", "trainer-0", A10, 1, "n1"),
        budget_obj("team-a", {"h100x2": 6, A10: 2}),
    ]
    load_file(write_snapshot(tmp_path / "cluster.yaml", objects))
    run = run_pass()
    assert (run.bound, run.lost) == (2, 1), run.__dict__
    models.Node.objects.filter(name="n2").update(allocatable={H100: 2})
    node = models.Node.objects.get(name="n4")
    node.labels = {**node.labels, "gpuplane.io/drain": "true"}
    node.save()
    return {"run": run}


class Cells(HTMLParser):
    """Collects the board's rows: per node, its badges and its unit cells (tag, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, Any]] = {}
        self.lost: dict[str, list[dict[str, str]]] = {}
        self._row: dict[str, Any] | None = None
        self._lost: list[dict[str, str]] | None = None
        self._badge = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-node" in a:
            self._row = self.rows[a["data-node"]] = {"css": a["class"], "badges": [], "cells": []}
            self._lost = None
        elif tag == "tr" and "lost-set" in a.get("class", "") and "data-set" in a:
            self._lost = self.lost[a["data-set"]] = []
            self._row = None
        elif tag in ("a", "i") and "u" in a.get("class", "").split():
            if self._row is not None:
                self._row["cells"].append(a)
            elif self._lost is not None:
                self._lost.append(a)
        elif tag == "span" and "badge" in a.get("class", "") and self._row is not None:
            self._badge = True

    def handle_data(self, data: str) -> None:
        if self._badge and self._row is not None:
            self._row["badges"].append(data)
            self._badge = False

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._row = self._lost = None


def board(client: Client, **params: str) -> Cells:
    response = client.get(reverse(BOARD), params)
    assert response.status_code == 200, response.content[:500]
    parser = Cells()
    parser.feed(response.content.decode())
    return parser


def classes(cell: dict[str, str]) -> set[str]:
    return set(cell["class"].split())


# -- placement board ----------------------------------------------------------------------


def test_board_has_one_cell_per_unit_coloured_by_tenant(admin_client: Client, cluster: dict[str, Any]) -> None:
    parsed = board(admin_client)
    assert set(parsed.rows) == {"n1", "n2", "n3", "n4"}
    n1 = parsed.rows["n1"]["cells"]
    assert len(n1) == 4  # A10 allocatable 4: two devices, one raw pod unit, one free
    devices = [c for c in n1 if c.get("data-set") == "team-a/vm-a"]
    pods = [c for c in n1 if "p" in classes(c)]
    free = [c for c in n1 if classes(c) == {"u"}]
    assert (len(devices), len(pods), len(free)) == (2, 1, 1)
    # tenant colours: both team-a cells share one colour class, team-b's pod another
    colour = {c for c in classes(devices[0]) if c.startswith("t")}
    assert colour == {c for c in classes(devices[1]) if c.startswith("t")}
    assert colour.isdisjoint(classes(pods[0]))
    # free units are blank: no link, no title
    assert "href" not in free[0] and "title" not in free[0]
    # hover text names device, VM, tenant and reason; click goes to the device page
    a0 = models.GpuDevice.objects.get(name="a0")
    title = next(c["title"] for c in devices if "device team-a/a0" in c["title"])
    for text in ("device team-a/a0", "VM vm-a", "tenant team-a", "class a10", "Bound on n1", f"reason: {a0.reason}"):
        assert text in title, text
    assert any(c["href"] == reverse("admin:binder_gpudevice_change", args=[a0.pk]) for c in devices)
    assert "pod team-b/trainer-0" in pods[0]["title"] and "not a VMI's launcher" in pods[0]["title"]
    # the 2-unit class: two cells per device
    n2 = parsed.rows["n2"]["cells"]
    assert len([c for c in n2 if c.get("data-set") == "team-b/vm-big"]) == 4


def test_board_marks_over_booked_units_and_node_states(admin_client: Client, cluster: dict[str, Any]) -> None:
    parsed = board(admin_client)
    n2 = parsed.rows["n2"]
    assert len(n2["cells"]) == 4  # booked 4 > allocatable 2: a cell per booked unit
    assert [("ob" in classes(c)) for c in n2["cells"]] == [False, False, True, True]
    assert "over-booked" in n2["badges"] and "overbooked" in n2["css"]
    assert not any("ob" in classes(c) for c in parsed.rows["n1"]["cells"])
    assert parsed.rows["n3"]["badges"][0].startswith("NotReady since 2026-11-28 08:00")
    assert "notready" in parsed.rows["n3"]["css"]
    assert set(parsed.rows["n4"]["badges"]) == {"cordoned", "draining"}
    assert parsed.rows["n1"]["badges"] == []
    assert len(parsed.rows["n3"]["cells"]) == 4 and all(classes(c) == {"u"} for c in parsed.rows["n3"]["cells"])


def test_board_agrees_with_the_engine_ledger(admin_client: Client, cluster: dict[str, Any]) -> None:
    """Every node's cells match dump_state's booked/allocatable (the one ledger)."""
    parsed = board(admin_client)
    for node in cluster_state()["nodes"]:
        cells = parsed.rows[node["name"]]["cells"]
        for numbers in node["resources"].values():
            taken = [c for c in cells if "href" in c]
            assert len(taken) == numbers["booked"], node["name"]
            assert len(cells) == max(numbers["allocatable"], numbers["booked"]), node["name"]


def test_board_shows_the_lost_set_with_its_decisions(admin_client: Client, cluster: dict[str, Any]) -> None:
    parsed = board(admin_client)
    assert set(parsed.lost) == {"team-a/vm-lost"}
    assert len(parsed.lost["team-a/vm-lost"]) == 6  # 3 devices × 2 units
    assert all("lost" in classes(c) for c in parsed.lost["team-a/vm-lost"])
    html = admin_client.get(reverse(BOARD)).content.decode()
    assert f"{reverse('admin:decisions')}?namespace=team-a&amp;vm=vm-lost" in html
    assert "1 Lost set" in html and "0 Pending devices" in html


def test_board_filters_by_class_and_tenant(admin_client: Client, cluster: dict[str, Any]) -> None:
    by_class = board(admin_client, **{"class": "a10"})
    assert set(by_class.rows) == {"n1"} and by_class.lost == {}
    by_class = board(admin_client, **{"class": "h100x2"})
    assert set(by_class.rows) == {"n2", "n3", "n4"} and set(by_class.lost) == {"team-a/vm-lost"}

    by_tenant = board(admin_client, tenant="team-b")
    assert set(by_tenant.rows) == {"n1", "n2"}  # only nodes where team-b books units
    n1 = by_tenant.rows["n1"]["cells"]
    others = [c for c in n1 if "o" in classes(c)]
    assert len(others) == 2 and all(c.get("data-set") == "team-a/vm-a" for c in others)  # team-a greyed
    assert by_tenant.lost == {}
    both = board(admin_client, tenant="team-a", **{"class": "a10"})
    assert set(both.rows) == {"n1"}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"class": "v100"}, "unknown class &#x27;v100&#x27;; the classes are: a10, h100x2"),
        ({"tenant": "nobody"}, "unknown tenant &#x27;nobody&#x27;"),
    ],
)
def test_board_unknown_filter_is_a_clear_400(
    admin_client: Client, cluster: dict[str, Any], params: dict[str, str], message: str
) -> None:
    response = admin_client.get(reverse(BOARD), params)
    assert response.status_code == 400
    assert message in response.content.decode()


def _synthetic(nodes: int) -> None:
    """``nodes`` H100 nodes, each with a 2-device set of its own tenant and a raw pod."""
    ns = models.Namespace.objects.bulk_create([models.Namespace(name=f"t{i}") for i in range(nodes)])
    models.GpuClass.objects.create(name="h100", resource_name=H100)
    models.Node.objects.bulk_create(
        [models.Node(name=f"node-{i:04d}", allocatable={H100: 8}, ready=i % 7 != 0) for i in range(nodes)]
    )
    models.GpuDevice.objects.bulk_create(
        [
            models.GpuDevice(
                namespace=ns[i], name=f"g{j}", class_name="h100", vm_name="vm", phase="Bound", node=f"node-{i:04d}"
            )
            for i in range(nodes)
            for j in range(2)
        ]
    )
    models.Pod.objects.bulk_create(
        [
            models.Pod(namespace=ns[i], name="raw", uid=f"uid-{i}", node=f"node-{i:04d}", gpu_requests={H100: 1})
            for i in range(nodes)
        ]
    )


def _board_queries(client: Client) -> tuple[int, int]:
    readmodel.MODEL.invalidate("a page read from scratch")  # count a full read of the mirror
    with CaptureQueriesContext(connection) as queries:
        response = client.get(reverse(BOARD))
    assert response.status_code == 200
    board = response.content.decode().split('id="gp-board"', 1)[1].split("</table>", 1)[0]
    return len(queries), board.count(' data-set="')  # the device cells


def test_board_queries_do_not_grow_with_nodes(admin_client: Client, django_assert_max_num_queries: Any) -> None:
    _synthetic(3)
    small, cells = _board_queries(admin_client)
    assert cells == 3 * 2
    models.Namespace.objects.all().delete()
    models.Node.objects.all().delete()
    models.GpuClass.objects.all().delete()
    _synthetic(60)
    with django_assert_max_num_queries(small):
        large, cells = _board_queries(admin_client)
    assert cells == 60 * 2
    assert large <= small <= 20  # the first read also records this process as a feed reader


# -- decision log -------------------------------------------------------------------------


def test_decision_log_of_a_set_and_of_a_device(admin_client: Client, cluster: dict[str, Any]) -> None:
    url = reverse("admin:decisions")
    response = admin_client.get(url, {"namespace": "team-a", "vm": "vm-lost"})
    assert response.status_code == 200
    log = response.context["log"]
    assert [d.device_name for d in log.decisions] == ["l2", "l1", "l0"] or sorted(
        d.device_name for d in log.decisions
    ) == ["l0", "l1", "l2"]
    html = response.content.decode()
    run = cluster["run"]
    assert f'href="{reverse("admin:binder_passrun_change", args=[run.pk])}">#{run.pk}</a> full' in html
    decision = models.Decision.objects.filter(namespace="team-a", device_name="l0").get()
    assert (decision.from_phase, decision.from_node, decision.to_phase) == ("Bound", "n3", "Lost")
    assert "Bound n3" in html and decision.reason in html
    assert [d.name for d in log.devices] == ["l0", "l1", "l2"]

    one = admin_client.get(url, {"namespace": "team-a", "device": "l0"})
    assert one.status_code == 200
    assert [d.device_name for d in one.context["log"].decisions] == ["l0"]
    assert one.context["log"].vm == "vm-lost"
    assert "the whole set team-a/vm-lost" in one.content.decode()


def test_device_page_links_to_its_decision_log(admin_client: Client, cluster: dict[str, Any]) -> None:
    device = models.GpuDevice.objects.get(name="l0")
    html = admin_client.get(reverse("admin:binder_gpudevice_change", args=[device.pk])).content.decode()
    log = reverse("admin:decisions")
    assert f"{log}?namespace=team-a&amp;device=l0" in html
    assert f"{log}?namespace=team-a&amp;vm=vm-lost" in html


@pytest.mark.parametrize(
    ("params", "message"),
    [({}, "the namespace parameter is missing"), ({"namespace": "team-a"}, "give vm=")],
)
def test_decision_log_without_a_subject_is_a_clear_400(
    admin_client: Client, params: dict[str, str], message: str
) -> None:
    response = admin_client.get(reverse("admin:decisions"), params)
    assert response.status_code == 400
    assert message in response.content.decode()


def test_decision_log_outlives_the_devices(admin_client: Client, cluster: dict[str, Any]) -> None:
    models.GpuDevice.objects.filter(vm_name="vm-lost").delete()
    response = admin_client.get(reverse("admin:decisions"), {"namespace": "team-a", "vm": "vm-lost"})
    assert response.status_code == 200
    assert len(response.context["log"].decisions) == 3
    assert "No such device exists now" in response.content.decode()


# -- budgets ------------------------------------------------------------------------------


def test_budget_bars_show_usage_and_limit_per_key_raw_keys_included(
    admin_client: Client, cluster: dict[str, Any]
) -> None:
    response = admin_client.get(reverse("admin:budgets"))
    assert response.status_code == 200
    tenants = {t.namespace: t for t in response.context["tenants"]}
    team_a = {k.key: k for k in tenants["team-a"].keys}
    # vm-a: 2 × a10 Bound; vm-lost: 3 × 2 units of h100x2 Lost (Lost still counts)
    assert (team_a["a10"].used, team_a["a10"].limit) == (2, None)
    assert (team_a["h100x2"].used, team_a["h100x2"].limit, team_a["h100x2"].percent) == (6, 6, 100)
    assert (team_a[A10].used, team_a[A10].limit, team_a[A10].raw) == (2, 2, True)
    assert team_a[H100].raw and team_a[H100].used == 6
    team_b = {k.key: k for k in tenants["team-b"].keys}
    assert team_b[A10].used == 1  # the raw pod: raw key only
    assert "a10" not in team_b
    # the same numbers as dump_state (the engine's ledger and effective limits)
    state = {t["namespace"]: t for t in cluster_state()["tenants"]}
    for namespace, tenant in tenants.items():
        assert {k.key: k.used for k in tenant.keys if k.used} == state[namespace]["usage"]
        assert {k.key: k.limit for k in tenant.keys if k.limit is not None} == state[namespace]["limits"]
    html = response.content.decode()
    assert f'data-tenant="team-a" data-key="{A10}" data-used="2" data-limit="2"' in html
    assert 'style="width: 100%"' in html


def test_budget_over_the_limit_is_marked(admin_client: Client, cluster: dict[str, Any]) -> None:
    models.GpuBudget.objects.filter(namespace__name="team-a").update(limits={"h100x2": 4})
    response = admin_client.get(reverse("admin:budgets"))
    key = next(k for t in response.context["tenants"] if t.namespace == "team-a" for k in t.keys if k.key == "h100x2")
    assert key.over and key.excess == 2 and key.percent == 100
    assert "over by 2" in response.content.decode()


def test_budgets_with_default_deny(admin_client: Client, cluster: dict[str, Any], settings: Any) -> None:
    settings.GPUPLANE_DEFAULT_BUDGET = "deny"
    response = admin_client.get(reverse("admin:budgets"))
    team_b = next(t for t in response.context["tenants"] if t.namespace == "team-b")
    assert team_b.denied_by_default and all(k.limit == 0 for k in team_b.keys)
    assert "(no budget: every key denied)" in response.content.decode()


# -- usage chart --------------------------------------------------------------------------

DAY = date(2026, 11, 20)


def _at(day: date, hour: int) -> datetime:
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC)


@pytest.fixture
def history() -> None:
    """Closed and open records across midnights, for two tenants and a raw key."""

    def record(namespace: str, subject: str, key: str, resource: str, units: int, start: datetime, end: Any) -> None:
        UsageRecord.objects.create(
            namespace=namespace,
            subject_kind="Pod" if "/" in key else "GPU",
            subject=subject,
            key=key,
            resource_name=resource,
            units=units,
            node="n1",
            phase="Raw" if "/" in key else "Bound",
            start=start,
            end=end,
        )

    # 2 units from 18:00 on day 0 to 06:00 on day 1: 12 GPU-hours on each day
    record("team-a", "g0", "h100", H100, 2, _at(DAY, 18), _at(DAY + timedelta(days=1), 6))
    # 1 unit for all of day 1: 24
    record("team-b", "g1", "a10", A10, 1, _at(DAY + timedelta(days=1), 0), _at(DAY + timedelta(days=2), 0))
    # a raw pod, 1 unit, day 2 from 12:00, still open (counted until now)
    record("team-b", "trainer", A10, A10, 1, _at(DAY + timedelta(days=2), 12), None)


NOW = _at(DAY + timedelta(days=3), 6)


def test_daily_hours_split_records_at_midnight(history: None) -> None:
    daily = daily_gpu_hours(DAY, DAY + timedelta(days=3), NOW)
    assert daily.cells == {
        (DAY, "team-a", "h100"): 12.0,
        (DAY + timedelta(days=1), "team-a", "h100"): 12.0,
        (DAY + timedelta(days=1), "team-b", "a10"): 24.0,
        (DAY + timedelta(days=2), "team-b", A10): 12.0,
        (DAY + timedelta(days=3), "team-b", A10): 6.0,  # open: until now
    }
    assert daily.by("tenant")["team-b"] == {
        DAY + timedelta(days=1): 24.0,
        DAY + timedelta(days=2): 12.0,
        DAY + timedelta(days=3): 6.0,
    }
    narrowed = daily_gpu_hours(DAY, DAY + timedelta(days=3), NOW, namespace="team-b", key=A10)
    assert set(narrowed.cells) == {(DAY + timedelta(days=2), "team-b", A10), (DAY + timedelta(days=3), "team-b", A10)}


def test_daily_hours_add_up_to_the_tenant_api_gpu_hours(history: None) -> None:
    first, last = DAY - timedelta(days=1), DAY + timedelta(days=4)
    daily = daily_gpu_hours(first, last, NOW)
    for namespace in ("team-a", "team-b"):
        api = gpu_hours(namespace, _at(first, 0), _at(last + timedelta(days=1), 0), NOW)
        ours = sum(h for (_, ns, _), h in daily.cells.items() if ns == namespace)
        assert ours == pytest.approx(api.total, abs=1e-5)


def _chart_values(html: str) -> dict[str, dict[tuple[str, str], float]]:
    """The chart's rect data: chart kind -> (day, series) -> hours."""

    class Rects(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.kind = ""
            self.values: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            a = {k: v or "" for k, v in attrs}
            if tag == "svg" and "data-series-kind" in a:
                self.kind = a["data-series-kind"]
            elif tag == "rect" and "data-hours" in a:
                self.values[self.kind][(a["data-day"], a["data-series"])] = float(a["data-hours"])

    parser = Rects()
    parser.feed(html)
    return parser.values


def test_usage_chart_and_its_csv_show_the_same_numbers(admin_client: Client, history: None, clock: Any) -> None:
    clock.now = NOW
    params = {"from": "2026-11-19", "to": "2026-11-23"}
    page = admin_client.get(reverse("admin:usage-chart"), params)
    assert page.status_code == 200
    chart = _chart_values(page.content.decode())
    download = admin_client.get(reverse("admin:usage-chart"), {**params, "format": "csv"})
    assert download.status_code == 200 and download["Content-Type"] == "text/csv"
    assert download["Content-Disposition"] == 'attachment; filename="gpu-hours-2026-11-19-2026-11-23.csv"'
    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert len(rows) == 5
    by_tenant: dict[tuple[str, str], float] = defaultdict(float)
    by_class: dict[tuple[str, str], float] = defaultdict(float)
    for row in rows:
        by_tenant[(row["day"], row["tenant"])] += float(row["gpu_hours"])
        by_class[(row["day"], row["class"])] += float(row["gpu_hours"])
    assert chart["tenant"].keys() == by_tenant.keys()
    assert chart["class"].keys() == by_class.keys()
    for key, hours in by_tenant.items():
        assert chart["tenant"][key] == pytest.approx(hours, abs=1e-6)
    for key, hours in by_class.items():
        assert chart["class"][key] == pytest.approx(hours, abs=1e-6)
    assert chart["tenant"][("2026-11-21", "team-b")] == 24.0
    assert chart["class"][("2026-11-21", "h100")] == 12.0
    assert page.context["total"] == pytest.approx(66.0)
    # the page links to the CSV of the same window and filters
    assert "format=csv" in page.context["csv_url"] and "from=2026-11-19" in page.context["csv_url"]


def test_usage_chart_filters(admin_client: Client, history: None, clock: Any) -> None:
    clock.now = NOW
    params = {"from": "2026-11-19", "to": "2026-11-23", "tenant": "team-b", "class": A10}
    chart = _chart_values(admin_client.get(reverse("admin:usage-chart"), params).content.decode())
    assert set(chart["tenant"]) == {("2026-11-22", "team-b"), ("2026-11-23", "team-b")}
    rows = list(
        csv.DictReader(
            io.StringIO(admin_client.get(reverse("admin:usage-chart"), {**params, "format": "csv"}).content.decode())
        )
    )
    assert {(r["day"], r["tenant"], r["class"]) for r in rows} == {
        ("2026-11-22", "team-b", A10),
        ("2026-11-23", "team-b", A10),
    }


def test_usage_chart_defaults_to_the_last_two_weeks(admin_client: Client, history: None, clock: Any) -> None:
    clock.now = NOW
    response = admin_client.get(reverse("admin:usage-chart"))
    assert response.status_code == 200
    params = response.context["params"]
    assert (params["from"], params["to"]) == (NOW.date() - timedelta(days=13), NOW.date())
    assert response.context["total"] == pytest.approx(66.0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"from": "2026-13-01"}, "&#x27;from&#x27; must be a date as YYYY-MM-DD"),
        ({"to": "yesterday"}, "&#x27;to&#x27; must be a date as YYYY-MM-DD"),
        ({"from": "2026-11-25", "to": "2026-11-20"}, "must not be after"),
        ({"from": "2024-01-01", "to": "2026-01-01"}, "at most 366 days"),
        ({"tenant": "nobody"}, "unknown tenant &#x27;nobody&#x27;"),
        ({"class": "v100"}, "unknown class &#x27;v100&#x27;"),
    ],
)
def test_usage_chart_bad_parameters_are_a_clear_400(
    admin_client: Client, history: None, params: dict[str, str], message: str
) -> None:
    response = admin_client.get(reverse("admin:usage-chart"), params)
    assert response.status_code == 400
    assert message in response.content.decode()
    as_csv = admin_client.get(reverse("admin:usage-chart"), {**params, "format": "csv"})
    assert as_csv.status_code == 400 and as_csv["Content-Type"] == "text/csv"
    assert as_csv.content.decode().startswith("error\n")


# -- actions ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_run_pass_now_shows_the_pass_result(admin_client: Client, cluster: dict[str, Any]) -> None:
    before = models.PassRun.objects.count()
    response = admin_client.post(reverse("admin:run-pass"), {"next": reverse("admin:budgets")}, follow=True)
    assert response.redirect_chain == [(reverse("admin:budgets"), 302)]
    run = models.PassRun.objects.order_by("-pk").first()
    assert run is not None and models.PassRun.objects.count() == before + 1
    text = response.content.decode()
    # sets, not devices: the board counts devices, the pass sets
    assert f"Full pass #{run.pk} ran: bound {run.bound} set" in text and f"lost {run.lost} set" in text, text


@pytest.mark.django_db(transaction=True)
def test_retry_a_lost_set_shows_where_it_went(admin_client: Client, cluster: dict[str, Any]) -> None:
    lost_sets = reverse("admin:binder_lostset_changelist")
    still = admin_client.post(lost_sets, {"retry": "team-a/vm-lost"}, follow=True).content.decode()
    assert "team-a/vm-lost is still Lost: lost:" in still
    models.Node.objects.filter(name="n3").update(ready=True, allocatable={H100: 8})  # back, with room again
    response = admin_client.post(lost_sets, {"retry": "team-a/vm-lost"}, follow=True)
    assert "team-a/vm-lost is now Bound on n3." in response.content.decode()
    assert [(r["namespace"], r["vm"]) for r in response.context["rows"]] == [("team-b", "vm-big")]  # moved off n2
    assert set(models.GpuDevice.objects.filter(vm_name="vm-lost").values_list("phase", "node")) == {("Bound", "n3")}


def test_malformed_retry_is_a_message(admin_client: Client, cluster: dict[str, Any]) -> None:
    response = admin_client.post(reverse("admin:binder_lostset_changelist"), {"retry": "no-slash"}, follow=True)
    assert response.status_code == 200
    assert "Say which set to retry" in response.content.decode()


def test_run_pass_is_post_only_and_stays_on_this_site(
    admin_client: Client, cluster: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    assert admin_client.get(reverse("admin:run-pass")).status_code == 405
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(reverse("admin:run-pass"), {"next": "https://evil.example/"})
    assert response.status_code == 302 and response["Location"] == reverse(BOARD)


def test_outcome_with_a_broker_says_queued(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    calls = []
    monkeypatch.setattr("binder.actions.queue_full_pass", lambda triggered_by: calls.append(triggered_by))
    settings.CELERY_TASK_ALWAYS_EAGER = False
    outcome = full_pass_now()
    assert calls == ["staff"] and outcome.queued and outcome.run is None
    assert outcome.message.startswith("Queued a full pass on the binder queue")


def test_a_failing_pass_is_a_message_not_a_500(admin_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(triggered_by: str) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr("binder.actions.queue_full_pass", boom)
    response = admin_client.post(reverse("admin:run-pass"), follow=True)
    assert response.status_code == 200
    assert "The full pass failed: RuntimeError: database went away" in response.content.decode()
    assert PassOutcome(error="x").message == "The full pass failed: x"


# -- who may open the staff pages ---------------------------------------------------------


def test_staff_pages_open_for_staff_and_are_linked_from_the_index(
    admin_client: Client, cluster: dict[str, Any]
) -> None:
    index = admin_client.get(reverse("admin:index")).content.decode()
    for name in PAGES:
        url = reverse(name)
        assert admin_client.get(url).status_code == 200, name
        assert f'href="{url}"' in index, name


def test_anonymous_and_non_staff_are_sent_to_the_login(client: Client, cluster: dict[str, Any]) -> None:
    urls = [reverse(n) for n in PAGES] + [reverse("admin:decisions") + "?namespace=team-a&vm=vm-lost"]
    for url in urls:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login")), url
    get_user_model().objects.create_user(username="tenant", password="tenant-pass-1234")
    assert client.login(username="tenant", password="tenant-pass-1234")
    for url in urls:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login")), url
    passes = models.PassRun.objects.count()
    assert client.post(reverse("admin:run-pass")).status_code == 302
    assert models.PassRun.objects.count() == passes


def test_tenant_api_tokens_do_not_open_the_admin(cluster: dict[str, Any]) -> None:
    tenant = token_client(account("alice", "team-a"))
    assert tenant.get("/api/v1/tenants/team-a/usage").status_code == 200  # the token works for the API
    staff_token = token_client(account("ops", staff=True))
    for client in (tenant, staff_token):
        for url in [reverse(n) for n in PAGES] + [reverse("admin:index")]:
            response = client.get(url)
            assert response.status_code == 302, url
            assert response["Location"].startswith(reverse("admin:login")), url
        passes = models.PassRun.objects.count()
        assert client.post(reverse("admin:run-pass")).status_code in (302, 403)
        assert models.PassRun.objects.count() == passes


def test_staff_without_permissions_get_403(client: Client, cluster: dict[str, Any]) -> None:
    user = get_user_model().objects.create_user(username="helpdesk", password="helpdesk-pass-1234", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_gpubudget"))
    assert client.login(username="helpdesk", password="helpdesk-pass-1234")
    assert client.get(reverse("admin:budgets")).status_code == 200
    for name in ("admin:placement-board", "admin:usage-chart"):
        assert client.get(reverse(name)).status_code == 403, name
    assert client.get(reverse("admin:decisions"), {"namespace": "team-a", "vm": "vm-lost"}).status_code == 403
    passes = models.PassRun.objects.count()
    assert client.post(reverse("admin:run-pass")).status_code == 403
    assert models.PassRun.objects.count() == passes


def test_usage_chart_csv_link_pins_the_moment(admin_client: Client, history: None, clock: Any) -> None:
    """Open records grow: the page's CSV link carries its ``at``, so a download a minute
    later has the numbers drawn, not the minute's growth."""
    clock.now = NOW
    page = admin_client.get(reverse("admin:usage-chart"), {"from": "2026-11-22", "to": "2026-11-23"})
    csv_url = page.context["csv_url"]
    assert "at=2026-11-23T06%3A00%3A00%2B00%3A00" in csv_url and csv_url.count("from=") == 1
    clock.advance(hours=2)
    rows = list(csv.DictReader(io.StringIO(admin_client.get(csv_url).content.decode())))
    assert [float(r["gpu_hours"]) for r in rows if r["day"] == "2026-11-23"] == [6.0]
    later = admin_client.get(reverse("admin:usage-chart"), {"from": "2026-11-22", "to": "2026-11-23", "format": "csv"})
    assert [
        float(r["gpu_hours"]) for r in csv.DictReader(io.StringIO(later.content.decode())) if r["day"] == "2026-11-23"
    ] == [8.0]
    # a future ``at`` counts until now; a malformed one is a clear 400
    future = admin_client.get(reverse("admin:usage-chart"), {"to": "2026-11-23", "at": "2027-01-01T00:00:00Z"})
    assert future.context["params"]["at"] == clock.now
    bad = admin_client.get(reverse("admin:usage-chart"), {"at": "noon"})
    assert bad.status_code == 400 and "&#x27;at&#x27; must be a time" in bad.content.decode()


def test_demo_prints_the_board_link(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    out = io.StringIO()
    call_command("demo", "--addrport", "127.0.0.1:8123", stdout=out)
    assert "board:        http://127.0.0.1:8123/admin/placement-board/" in out.getvalue()


def test_board_shows_a_deleted_node_that_still_holds_devices(admin_client: Client, cluster: dict[str, Any]) -> None:
    models.Node.objects.filter(name="n1").delete()  # the binder has not run since
    row = board(admin_client).rows["n1"]
    assert row["badges"][0] == "deleted (not in the mirror)" and "deleted" in row["css"]
    assert len(row["cells"]) == 3 and all("ob" in classes(c) for c in row["cells"])  # allocatable 0 now

"""Usage for billing on the usage chart: presets, the ranked table with
shares, rates per class (a field, or the setting), the billing CSV clipped to the window,
and ``make demo``'s two weeks of history."""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from gpuplane.management.demo_history import SUBJECT_PREFIX, load_history
from gpuplane.staff.billing import RatesError, parse_rates, presets
from usage.daily import daily_gpu_hours
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db

CHART = "admin:usage-chart"
H100, A10 = "nvidia.com/H100", "nvidia.com/A10"


def _at(day: date, hour: int) -> datetime:
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC)


DAY = date(2026, 11, 20)
NOW = _at(DAY + timedelta(days=5), 6)


def _record(
    namespace: str, subject: str, key: str, units: int, start: datetime, end: datetime | None, *, borrowed: bool = False
) -> None:
    UsageRecord.objects.create(
        borrowed=borrowed,
        namespace=namespace,
        subject_kind="GPU",
        subject=subject,
        key=key,
        resource_name=H100 if key == "h100" else A10,
        units=units,
        node="n1",
        phase="Bound",
        start=start,
        end=end,
    )


@pytest.fixture
def records() -> None:
    # team-a: 2 × h100 from day 0 18:00 to day 2 06:00 (36 h: 12 on day 0, 24 on day 1)
    _record("team-a", "g0", "h100", 2, _at(DAY, 18), _at(DAY + timedelta(days=2), 6))
    # team-b: 1 × a10 all of day 1 (24 h) and 1 × h100 day 1 00:00-10:00
    _record("team-b", "g1", "a10", 1, _at(DAY + timedelta(days=1), 0), _at(DAY + timedelta(days=2), 0))
    _record("team-b", "g2", "h100", 1, _at(DAY + timedelta(days=1), 0), _at(DAY + timedelta(days=1), 10))


def _billing(client: Client, **params: str) -> list[dict[str, str]]:
    response = client.get(reverse(CHART), {**params, "format": "billing"})
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "text/csv"
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_billing_csv_is_clipped_to_the_window(admin_client: Client, records: None, clock: Any) -> None:
    clock.now = NOW
    day1 = str(DAY + timedelta(days=1))
    rows = _billing(admin_client, **{"from": day1, "to": day1})
    got = {(r["tenant"], r["class"]): float(r["gpu_hours"]) for r in rows}
    # team-a's record runs from day 0 to day 2: only its 24 h of day 1 count (2 units × 24)
    assert got == {("team-a", "h100"): 48.0, ("team-b", "a10"): 24.0, ("team-b", "h100"): 10.0}
    assert {r["from"] for r in rows} == {day1} and {r["to"] for r in rows} == {day1}
    assert float(next(r["share"] for r in rows if r["tenant"] == "team-a")) == pytest.approx(48 / 82)
    # the clipped totals are the chart's: the same query
    daily = daily_gpu_hours(DAY + timedelta(days=1), DAY + timedelta(days=1), NOW)
    assert sum(got.values()) == pytest.approx(daily.total)
    assert all(r["rate"] == "" and r["amount"] == "" for r in rows)


def test_billing_and_day_csvs_show_the_borrowed_gpu_hours_apart(admin_client: Client, clock: Any) -> None:
    """A borrowed set's hours (lending: records with ``borrowed``) are billed like the rest
    and shown apart in ``borrowed_gpu_hours``: the part of ``gpu_hours`` borrowed sets held."""
    clock.now = NOW
    day1 = DAY + timedelta(days=1)
    # team-a: 2 × h100 of its own all of day 1 (48 h), and a borrowed 1 × h100 from 06:00 to 18:00
    # (12 h), which was repaid then: the same device's own record goes on to the end of the day (6 h).
    _record("team-a", "g0", "h100", 2, _at(day1, 0), _at(day1 + timedelta(days=1), 0))
    _record("team-a", "g1", "h100", 1, _at(day1, 6), _at(day1, 18), borrowed=True)
    _record("team-a", "g1", "h100", 1, _at(day1, 18), _at(day1 + timedelta(days=1), 0))
    # team-b: a borrowed a10 from day 0 18:00 into day 2: 6 h on day 0, 24 h on day 1.
    _record("team-b", "g2", "a10", 1, _at(DAY, 18), _at(DAY + timedelta(days=2), 0), borrowed=True)
    rows = _billing(admin_client, **{"from": str(day1), "to": str(day1), "rates": "h100=2,a10=1"})
    got = {(r["tenant"], r["class"]): (float(r["gpu_hours"]), float(r["borrowed_gpu_hours"])) for r in rows}
    assert got == {("team-a", "h100"): (66.0, 12.0), ("team-b", "a10"): (24.0, 24.0)}
    # Billed alike: the amount is of every GPU-hour, borrowed ones included.
    assert {r["tenant"]: r["amount"] for r in rows} == {"team-a": "132.0000", "team-b": "24.0000"}
    # The day CSV: the same split per day, and a day with no borrowed hours says 0.
    response = admin_client.get(reverse(CHART), {"from": str(DAY), "to": str(day1), "format": "csv"})
    days = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert list(days[0]) == ["day", "tenant", "class", "gpu_hours", "borrowed_gpu_hours"]
    per_day = {(r["day"], r["tenant"]): (float(r["gpu_hours"]), float(r["borrowed_gpu_hours"])) for r in days}
    assert per_day == {
        (str(DAY), "team-b"): (6.0, 6.0),
        (str(day1), "team-a"): (66.0, 12.0),
        (str(day1), "team-b"): (24.0, 24.0),
    }


def test_ranked_table_with_shares_and_rates(admin_client: Client, records: None, clock: Any) -> None:
    clock.now = NOW
    window = {"from": str(DAY), "to": str(DAY + timedelta(days=2))}
    html = admin_client.get(reverse(CHART), {**window, "rates": "h100=2.50, a10=1"}).content.decode()
    table = html.split('id="ranked"', 1)[1].split("</table>", 1)[0]
    # team-a 72 GPU-hours (2 × 36) first, then team-b 34 (24 + 10)
    assert table.index('data-tenant="team-a"') < table.index('data-tenant="team-b"')
    assert "72.000" in table and "67.9 %" in table and "34.000" in table and "32.1 %" in table
    assert "h100: 72.000 × 2.50 = 180.0000" in table
    rows = _billing(admin_client, **window, rates="h100=2.50,a10=1")
    amounts = {(r["tenant"], r["class"]): Decimal(r["amount"]) for r in rows}
    assert amounts == {
        ("team-a", "h100"): Decimal("180.0000"),
        ("team-b", "a10"): Decimal("24.0000"),
        ("team-b", "h100"): Decimal("25.0000"),
    }


def test_rates_from_the_setting_and_a_key_without_a_rate(
    admin_client: Client, records: None, clock: Any, settings: Any
) -> None:
    clock.now = NOW
    settings.GPUPLANE_BILLING_RATES = "h100=3"
    rows = _billing(admin_client, **{"from": str(DAY), "to": str(DAY + timedelta(days=2))})
    by = {(r["tenant"], r["class"]): r for r in rows}
    assert by[("team-a", "h100")]["amount"] == "216.0000"
    assert by[("team-b", "a10")]["rate"] == "" and by[("team-b", "a10")]["amount"] == ""  # never a silent 0


@pytest.mark.parametrize(
    ("rates", "message"),
    [
        ("h100", "is not key=rate"),
        ("h100=cheap", "must be a number"),
        ("h100=-1", "must be zero or more"),
        ("h100=1,h100=2", "given twice"),
    ],
)
def test_bad_rates_are_a_clear_400(admin_client: Client, clock: Any, rates: str, message: str) -> None:
    clock.now = NOW
    response = admin_client.get(reverse(CHART), {"rates": rates})
    assert response.status_code == 400
    assert message in response.content.decode()
    with pytest.raises(RatesError):
        parse_rates(rates)


def test_presets() -> None:
    thursday = date(2026, 12, 3)
    assert presets(thursday) == [
        ("last 7 days", date(2026, 11, 27), date(2026, 12, 3)),
        ("last week", date(2026, 11, 23), date(2026, 11, 29)),
        ("this month", date(2026, 12, 1), date(2026, 12, 3)),
        ("last month", date(2026, 11, 1), date(2026, 11, 30)),
    ]


def test_chart_links_the_presets_and_the_billing_csv(admin_client: Client, records: None, clock: Any) -> None:
    clock.now = NOW
    html = admin_client.get(reverse(CHART), {"tenant": "team-a"}).content.decode()
    presets_html = html.split('id="chart-presets"', 1)[1].split("</nav>", 1)[0]
    assert "tenant=team-a" in presets_html and "from=2026-11-01&amp;to=2026-11-25" in presets_html
    assert 'id="billing-link"' in html and "format=billing" in html


def test_demo_loads_two_weeks_of_history_once(clock: Any) -> None:
    clock.now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    added = load_history(clock.now)
    assert added > 0
    first = UsageRecord.objects.filter(subject__startswith=SUBJECT_PREFIX).order_by("start").first()
    assert first is not None and first.start.date() == date(2026, 11, 17)
    assert not UsageRecord.objects.filter(subject__startswith=SUBJECT_PREFIX, end__gt=_at(date(2026, 12, 1), 0))
    assert load_history(clock.now) == 0  # a second make demo adds none
    daily = daily_gpu_hours(date(2026, 11, 17), date(2026, 11, 30), clock.now)
    assert all(any(d == day for d, _, _ in daily.cells) for day in daily.days)  # every day has usage


def test_demo_command_prints_the_history(settings: Any) -> None:
    out = io.StringIO()
    call_command("demo", stdout=out)
    assert "usage history:" in out.getvalue()


def test_chart_legends_are_ranked(admin_client: Client, records: None, clock: Any) -> None:
    clock.now = NOW
    html = admin_client.get(reverse(CHART), {"from": str(DAY), "to": str(DAY + timedelta(days=2))}).content.decode()
    tenant_legend = html.split('id="chart-tenant"', 1)[1].split('class="gp-legend"', 1)[1].split("</div>", 1)[0]
    assert tenant_legend.index('data-series="team-a"') < tenant_legend.index('data-series="team-b"')
    class_legend = html.split('id="chart-class"', 1)[1].split('class="gp-legend"', 1)[1].split("</div>", 1)[0]
    assert class_legend.index('data-series="h100"') < class_legend.index('data-series="a10"')  # 82 h before 24 h

"""GPU-hours per day, per tenant and per key, summed in SQL for the staff usage chart.

The chart and its CSV export must show the same numbers and must not read every usage
record into Python: a year of records of a thousand tenants is millions of rows. So one
aggregate query returns, per (tenant, key), one column per day: units × the seconds of
the record inside that day (UTC), with the overlap arithmetic of ``usage.queries`` (the
tenant usage API's GPU-hours), so a day's figures add up to the API's window totals.

A record's key is its class name for devices and its raw resource name for pods' raw
usage; every record counts once, so a day's total counts every GPU once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.db.models import ExpressionWrapper, F, FloatField, QuerySet, Sum, Value
from django.db.models.functions import Greatest, Least

from usage.models import UsageRecord
from usage.queries import SECONDS_PER_HOUR, Seconds, held_until, in_window

#: The longest window one chart covers (one aggregate column per day).
MAX_DAYS = 366
#: Figures are rounded to this many decimals (a micro-GPU-hour) in the chart and the CSV alike.
DECIMALS = 6


def day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class DailyHours:
    """GPU-hours per (day, tenant, key) in a window of whole UTC days ``first``…``last``."""

    first: date
    last: date
    cells: dict[tuple[date, str, str], float]
    """(day, namespace, key) -> GPU-hours, rounded; zero cells left out."""
    borrowed: dict[tuple[date, str, str], float] = field(default_factory=dict)
    """The share of those held by borrowed sets (lending; records with ``borrowed``), by the
    same cells, rounded alike; cells with none left out."""

    @property
    def days(self) -> list[date]:
        return [self.first + timedelta(days=i) for i in range((self.last - self.first).days + 1)]

    def by(self, what: str) -> dict[str, dict[date, float]]:
        """Series → day → GPU-hours, summing the rounded cells: ``what`` is "tenant" or "key"."""
        out: dict[str, dict[date, float]] = defaultdict(lambda: defaultdict(float))
        for (day, tenant, key), hours in self.cells.items():
            out[tenant if what == "tenant" else key][day] += hours
        return {s: {d: round(h, DECIMALS) for d, h in sorted(days.items())} for s, days in sorted(out.items())}

    def rows(self) -> list[tuple[date, str, str, float, float]]:
        """The CSV rows: day, tenant, key, GPU-hours, of them borrowed GPU-hours; sorted."""
        lent = self.borrowed
        return [(d, ns, k, h, lent.get((d, ns, k), 0.0)) for (d, ns, k), h in sorted(self.cells.items())]

    @property
    def total(self) -> float:
        return round(sum(self.cells.values()), DECIMALS)


def daily_gpu_hours(first: date, last: date, now: datetime, *, namespace: str = "", key: str = "") -> DailyHours:
    """GPU-hours per day of ``[first, last]`` (whole UTC days) per tenant and key: one query.

    Open records run until ``now``; days after ``now`` are zero. ``namespace`` and ``key``
    narrow the records (empty: all).
    """
    if last < first:
        raise ValueError("the last day is before the first")
    if (last - first).days + 1 > MAX_DAYS:
        raise ValueError(f"a window covers at most {MAX_DAYS} days")
    records: QuerySet[UsageRecord] = UsageRecord.objects.all()
    if namespace:
        records = records.filter(namespace=namespace)
    if key:
        records = records.filter(key=key)
    start, end = day_start(first), day_start(last + timedelta(days=1))
    records = in_window(records, start, min(end, now), now)
    columns = {}
    days = [first + timedelta(days=i) for i in range((last - first).days + 1)]
    for i, day in enumerate(days):
        lower = day_start(day)
        if lower >= now:
            continue
        upper = min(lower + timedelta(days=1), now)
        overlap = Seconds(Least(held_until(now), Value(upper)), Greatest(F("start"), Value(lower)))
        seconds = ExpressionWrapper(F("units") * Greatest(overlap, Value(0.0)), output_field=FloatField())
        columns[f"d{i}"] = Sum(seconds, output_field=FloatField())
    seconds_of: dict[tuple[date, str, str], float] = defaultdict(float)
    lent_seconds: dict[tuple[date, str, str], float] = defaultdict(float)
    if columns:
        # Borrowed records apart (lending): one row per tenant, key and borrowed flag.
        for row in records.order_by().values("namespace", "key", "borrowed").annotate(**columns):
            for i, day in enumerate(days):
                value: Any = row.get(f"d{i}")  # a float column the stubs cannot see
                held = max(0.0, float(value or 0.0))
                if held > 0:
                    cell = (day, row["namespace"], row["key"])
                    seconds_of[cell] += held
                    if row["borrowed"]:
                        lent_seconds[cell] += held
    cells = {c: h for c, s in seconds_of.items() if (h := round(s / SECONDS_PER_HOUR, DECIMALS)) > 0}
    lent = {c: h for c, s in lent_seconds.items() if (h := round(s / SECONDS_PER_HOUR, DECIMALS)) > 0 and c in cells}
    return DailyHours(first=first, last=last, cells=cells, borrowed=lent)


@dataclass(frozen=True, slots=True)
class Segment:
    """One coloured rectangle of a stacked bar: a series' GPU-hours on one day."""

    x: float
    y: float
    width: float
    height: float
    day: date
    series: str
    hours: float
    colour: str


@dataclass(frozen=True, slots=True)
class Tick:
    y: float
    label: str


@dataclass(frozen=True, slots=True)
class DayLabel:
    x: float
    label: str


@dataclass(frozen=True, slots=True)
class BarChart:
    """A stacked bar chart (one bar per day) laid out for an SVG of ``width`` × ``height``."""

    width: int
    height: int
    left: int
    top: int
    bottom: float
    segments: list[Segment]
    ticks: list[Tick]
    labels: list[DayLabel]
    legend: list[tuple[str, str, float]]
    """(series, colour, GPU-hours in the window)"""


def _axis(value: float) -> tuple[float, int]:
    """An axis maximum at or above ``value`` (1, 2, 2.5 or 5 × 10^k) and how many equal,
    round steps divide it (so the labels read 0, 50, 100 … rather than 62.5)."""
    if value <= 0:
        return 1.0, 4
    power = 10.0 ** int(f"{value:e}".split("e")[1])
    for step, divisions in ((1, 5), (2, 4), (2.5, 5), (5, 5), (10, 5)):
        if value <= step * power:
            return step * power, divisions
    return 10 * power, 5


def stacked_bars(
    days: list[date],
    series: dict[str, dict[date, float]],
    colours: dict[str, str],
    *,
    width: int = 960,
    height: int = 280,
) -> BarChart:
    """Lay out ``series`` (name → day → hours) as bars per day, series stacked in name order."""
    left, right, top, bottom_margin = 64, 12, 12, 36
    plot_w, plot_h = width - left - right, height - top - bottom_margin
    bottom = top + plot_h
    totals = {d: sum(values.get(d, 0.0) for values in series.values()) for d in days}
    ceiling, divisions = _axis(max(totals.values(), default=0.0))
    slot = plot_w / max(1, len(days))
    bar = max(1.0, slot * 0.8)
    segments = []
    for i, day in enumerate(days):
        y = float(bottom)
        for name, values in series.items():
            hours = values.get(day, 0.0)
            if hours <= 0:
                continue
            h = plot_h * hours / ceiling
            y -= h
            segments.append(
                Segment(
                    round(left + i * slot + (slot - bar) / 2, 2),
                    round(y, 2),
                    round(bar, 2),
                    round(h, 2),
                    day,
                    name,
                    hours,
                    colours[name],
                )
            )
    ticks = [
        Tick(round(bottom - plot_h * k / divisions, 2), f"{ceiling * k / divisions:g}") for k in range(divisions + 1)
    ]
    every = max(1, -(-len(days) // 12))
    labels = [
        DayLabel(round(left + i * slot + slot / 2, 2), d.strftime("%m-%d"))
        for i, d in enumerate(days)
        if i % every == 0
    ]
    legend = [(name, colours[name], round(sum(values.values()), DECIMALS)) for name, values in series.items()]
    return BarChart(width, height, left, top, float(bottom), segments, ticks, labels, legend)

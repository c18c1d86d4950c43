"""Usage for billing: the usage chart's window ranked by tenant, with shares and optional rates.

Billing asks "who used how much of which class between these two dates, and what does it
cost", so every figure is clipped to the window: a record that started before the window
or runs past it counts only its hours inside (``usage.daily`` cuts records at midnight
UTC, and the window is whole UTC days). The totals are sums of the chart's rounded cells,
so the table, the chart and both CSVs agree to the micro-GPU-hour.

Rates are per class key (or raw resource key) per GPU-hour, in whatever currency the
operator bills in; a key without a rate has no amount (never a silent zero).
"""

from __future__ import annotations

import calendar
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, timedelta
from decimal import Decimal, InvalidOperation

from usage.daily import DECIMALS, DailyHours

#: Amounts are rounded to this many decimals (cents, and two more for small rates).
AMOUNT_DECIMALS = Decimal("0.0001")


class RatesError(ValueError):
    """Rates text that is not ``key=rate`` pairs (shown to staff, never a 500)."""


def parse_rates(text: str) -> dict[str, Decimal]:
    """``"h100=2.50, a10=0.8"`` (commas, semicolons or spaces between pairs) to key -> rate."""
    rates: dict[str, Decimal] = {}
    for pair in text.replace(";", ",").replace("\n", ",").replace(" ", ",").split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RatesError(f"rates: {pair.strip()!r} is not key=rate (for example h100=2.50)")
        try:
            rate = Decimal(value.strip())
        except InvalidOperation:
            raise RatesError(f"rates: the rate of {key!r} must be a number, not {value.strip()!r}") from None
        if not rate.is_finite() or rate < 0:
            raise RatesError(f"rates: the rate of {key!r} must be zero or more, not {value.strip()!r}")
        if key in rates:
            raise RatesError(f"rates: {key!r} is given twice")
        rates[key] = rate
    return rates


@dataclass(frozen=True, slots=True)
class Line:
    """One tenant's GPU-hours of one key in the window, and their amount at its rate."""

    tenant: str
    key: str
    hours: float
    rate: Decimal | None
    share: float
    """Of every tenant's GPU-hours in the window (0 to 1)."""
    borrowed: float = 0.0
    """Of ``hours``, those held by borrowed sets (lending): billed alike, shown apart."""

    @property
    def amount(self) -> Decimal | None:
        if self.rate is None:
            return None
        return (Decimal(str(self.hours)) * self.rate).quantize(AMOUNT_DECIMALS)


@dataclass(slots=True)
class TenantTotal:
    """A tenant's row of the ranked table."""

    tenant: str
    hours: float = 0.0
    share: float = 0.0
    lines: list[Line] = field(default_factory=list)

    @property
    def percent(self) -> float:
        return self.share * 100

    @property
    def amount(self) -> Decimal | None:
        """The sum of its lines' amounts, or None when a line has no rate."""
        amounts = [line.amount for line in self.lines]
        if not amounts or any(a is None for a in amounts):
            return None
        return sum((a for a in amounts if a is not None), Decimal(0))

    @property
    def unpriced(self) -> list[str]:
        return [line.key for line in self.lines if line.rate is None]


def ranked(daily: DailyHours, rates: dict[str, Decimal]) -> list[TenantTotal]:
    """Tenants by GPU-hours in the window, most first, each with its lines per key."""
    per: dict[tuple[str, str], float] = defaultdict(float)
    lent: dict[tuple[str, str], float] = defaultdict(float)
    for (_day, tenant, key), hours in daily.cells.items():
        per[(tenant, key)] += hours
    for (_day, tenant, key), hours in daily.borrowed.items():
        lent[(tenant, key)] += hours
    total = sum(per.values())
    tenants: dict[str, TenantTotal] = {}
    for (tenant, key), hours in sorted(per.items()):
        hours = round(hours, DECIMALS)
        row = tenants.setdefault(tenant, TenantTotal(tenant))
        share = hours / total if total else 0.0
        borrowed = round(lent.get((tenant, key), 0.0), DECIMALS)
        row.lines.append(Line(tenant, key, hours, rates.get(key), share, borrowed))
        row.hours += hours
    for row in tenants.values():
        row.hours = round(row.hours, DECIMALS)
        row.share = row.hours / total if total else 0.0
        row.lines.sort(key=lambda line: (-line.hours, line.key))
    return sorted(tenants.values(), key=lambda r: (-r.hours, r.tenant))


def presets(today: date) -> list[tuple[str, date, date]]:
    """The windows billing asks for most: (label, first day, last day), all whole UTC days."""
    monday = today - timedelta(days=today.weekday())
    first_of_month = today.replace(day=1)
    last_month_end = first_of_month - timedelta(days=1)
    return [
        ("last 7 days", today - timedelta(days=6), today),
        ("last week", monday - timedelta(days=7), monday - timedelta(days=1)),
        ("this month", first_of_month, today),
        (
            "last month",
            last_month_end.replace(day=1),
            last_month_end.replace(day=calendar.monthrange(last_month_end.year, last_month_end.month)[1]),
        ),
    ]

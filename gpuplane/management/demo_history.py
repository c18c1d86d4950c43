"""Two weeks of usage history for ``manage.py demo``, so its usage chart has days to show.

The demo's own records start at its first pass (today); billing presets ("last week",
"last month") and the ranked table need past days. These are closed records of the
demo's tenants and classes, a few sets a day of varying length, written once: usage
records are never deleted (they are the billing trail), so a second ``make demo``
finds them by their subject prefix and adds none.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from usage.models import UsageRecord

SUBJECT_PREFIX = "demo-history-"
#: (tenant, class key, resource, units per record, records a day)
_SHAPE = (
    ("team-nlp", "h100", "nvidia.com/GH100_H100_SXM5_80GB", 8, 1),
    ("team-vision", "h100", "nvidia.com/GH100_H100_SXM5_80GB", 4, 2),
    ("team-research", "h100", "nvidia.com/GH100_H100_SXM5_80GB", 2, 1),
    ("team-research", "a10", "nvidia.com/GA102GL_A10", 2, 1),
    ("team-sandbox", "a10", "nvidia.com/GA102GL_A10", 1, 2),
)


def load_history(now: datetime, days: int = 14, seed: int = 18) -> int:
    """Write ``days`` days of closed records before today (UTC); returns how many (0 when
    the history is there already)."""
    if UsageRecord.objects.filter(subject__startswith=SUBJECT_PREFIX).exists():
        return 0
    rng = random.Random(seed)  # noqa: S311 - demo figures, not secrets
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = []
    for back in range(days, 0, -1):
        day = today - timedelta(days=back)
        for tenant, key, resource, units, per_day in _SHAPE:
            for i in range(per_day):
                start = day + timedelta(hours=rng.randrange(0, 12), minutes=rng.randrange(60))
                # Some run past midnight, so the chart and the billing CSV cut them at its edge.
                end = start + timedelta(hours=rng.randrange(2, 20), minutes=rng.randrange(60))
                rows.append(
                    UsageRecord(
                        namespace=tenant,
                        subject_kind="GPU",
                        subject=f"{SUBJECT_PREFIX}{tenant}-{key}-{back}-{i}",
                        vm_name=f"history-{key}",
                        key=key,
                        resource_name=resource,
                        units=units,
                        node=f"hgx-h100-0{1 + i}" if key == "h100" else f"gpu-a10-0{1 + i}",
                        phase="Bound",
                        start=start,
                        end=min(end, today),
                    )
                )
    UsageRecord.objects.bulk_create(rows)
    return len(rows)

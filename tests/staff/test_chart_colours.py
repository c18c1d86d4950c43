"""The usage chart draws tenants above and classes below: a colour means one tenant or one
class, never both (the demo's top tenant and first class were the same blue)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.urls import reverse

from gpuplane.staff.palette import CATEGORICAL, PALETTE, contrast
from harness.shapes import A10, H100
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db


def _lab(colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of ``#RRGGBB``: perceptual distance, independently of the palette module."""

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(int(colour[i : i + 2], 16) / 255) for i in (1, 3, 5))
    x, y, z = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        0.2126 * r + 0.7152 * g + 0.0722 * b,
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_class_colours_are_far_from_every_tenant_colour_and_visible() -> None:
    for colour in CATEGORICAL:
        assert contrast(colour) >= 3.0, colour
        nearest = min(math.dist(_lab(colour), _lab(tenant)) for tenant in PALETTE)
        assert nearest >= 25, f"{colour} is {nearest:.1f} ΔE from a tenant colour"


def test_the_two_charts_share_no_colour(admin_client: Client) -> None:
    start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=3)
    for i, (namespace, key) in enumerate([("team-a", "h100"), ("team-b", "a10"), ("team-c", "h100")]):
        UsageRecord.objects.create(
            namespace=namespace,
            subject_kind="GPU",
            subject=f"g{i}",
            key=key,
            resource_name=H100 if key == "h100" else A10,
            units=1 + i,
            node="n1",
            phase="Bound",
            start=start + timedelta(hours=i),
            end=start + timedelta(days=2),
        )
    html = admin_client.get(reverse("admin:usage-chart")).content.decode()

    def fills(kind: str) -> set[str]:
        svg = re.search(rf'<svg[^>]*data-series-kind="{kind}".*?</svg>', html, re.DOTALL)
        assert svg, kind
        return set(re.findall(r'<rect class="seg"[^>]*fill="(#[0-9A-Fa-f]{6})"', svg.group(0)))

    tenants, classes = fills("tenant"), fills("class")
    assert len(tenants) == 3 and len(classes) == 2
    assert not tenants & classes

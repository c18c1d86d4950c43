"""Time fields and the window (``from``/``to``) every usage read takes, all turned into UTC."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.utils import timezone
from django_filters import rest_framework as filters
from django_filters.fields import IsoDateTimeField
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers

# -- time windows -------------------------------------------------------------------------


def in_utc(value: datetime) -> datetime:
    """``value`` in UTC, or a ValueError if that is outside the years 1-9999.

    Python accepts offsets up to ±23:59 and PostgreSQL only ±15:59, so every time a
    client sends is turned into UTC before it reaches a query (schemathesis found
    ``+19:10`` answering a 500).
    """
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{value.isoformat()} is outside the years 1-9999 in UTC") from None


#: What a bad ``from``/``to`` is told, everywhere: both forms the API accepts.
WHEN_FORMATS = (
    "wrong format: must be an RFC 3339 date-time (YYYY-MM-DDThh:mm[:ss[.uuuuuu]] with Z or ±HH:MM, "
    "e.g. 2026-11-01T00:00:00Z) or a date YYYY-MM-DD (its midnight, UTC)"
)


class FlexibleDateTimeField(serializers.DateTimeField):
    """RFC 3339 / ISO 8601 date-time, or a plain date (its midnight, UTC); always in UTC."""

    default_error_messages = {**serializers.DateTimeField.default_error_messages, "invalid": WHEN_FORMATS}

    def to_internal_value(self, value: Any) -> datetime:
        if isinstance(value, str) and len(value) == 10:
            try:
                day = datetime.strptime(value, "%Y-%m-%d").date()
            except ValueError:
                pass
            else:
                return datetime.combine(day, time.min, tzinfo=timezone.get_current_timezone())
        parsed = super().to_internal_value(value)
        try:
            return in_utc(parsed)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None


class UtcIsoDateTimeField(IsoDateTimeField):
    """django-filter's ISO 8601 field (a plain date too), turned into UTC (see :func:`in_utc`)."""

    default_error_messages = {**IsoDateTimeField.default_error_messages, "invalid": WHEN_FORMATS}

    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return in_utc(parsed)
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


class UtcIsoDateTimeFilter(filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField


class WindowSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """``from`` / ``to`` query parameters: the window GPU-hours are counted in."""

    to = FlexibleDateTimeField(required=False, help_text="end of the window (default: now)")

    def get_fields(self) -> dict[str, serializers.Field]:  # type: ignore[type-arg]
        fields = super().get_fields()
        fields["from"] = FlexibleDateTimeField(required=False, help_text="start of the window (default: to − 30 days)")
        return fields

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        # DRF reads an empty query parameter as absent; here it is a mistake worth saying.
        empty = {name: ["must be a date-time, not empty"] for name in ("from", "to") if data.get(name) == ""}
        if empty:
            raise serializers.ValidationError(empty)
        return super().to_internal_value(data)  # type: ignore[no-any-return]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        now = timezone.now()
        end = attrs.get("to") or now
        start = attrs.get("from") or end - timedelta(days=settings.GPUPLANE_USAGE_DEFAULT_DAYS)
        if start >= end:
            raise serializers.ValidationError({"from": [f"must be before to ({end.isoformat()})"]})
        return {"from": start, "to": end, "now": now}


#: RFC 3339 date-time, or a plain date (its midnight, UTC).
WHEN = {"type": "string", "anyOf": [{"format": "date-time"}, {"format": "date"}]}
WINDOW_PARAMETERS = [
    OpenApiParameter(
        "from",
        WHEN,
        OpenApiParameter.QUERY,
        description="start of the window, RFC 3339 date-time or YYYY-MM-DD (default: `to` − 30 days)",
    ),
    OpenApiParameter("to", WHEN, OpenApiParameter.QUERY, description="end of the window, like `from` (default: now)"),
]

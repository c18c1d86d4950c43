"""Strict filters: an empty or malformed parameter is a 400 naming it, never silently ignored."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import forms
from django.db.models import Q, QuerySet
from django_filters import rest_framework as filters
from django_filters.fields import ChoiceField as FilterChoiceField

from binder import models as binder_models
from binder.models import RecordPhase, SubjectKind
from usage.api.fields import UtcIsoDateTimeFilter
from usage.models import UsageRecord

# -- filters --------------------------------------------------------------------------------


class StrictFilterSet(filters.FilterSet):
    """A FilterSet that refuses an empty value for a typed filter (choice, date-time, boolean).

    django-filter reads ``?phase=`` as "no filter"; for a typed parameter that is a client
    mistake (the OpenAPI schema says it is an enum or a date-time), so it is a 400 naming
    the parameter, not a silently unfiltered answer. Free-text filters may be empty.
    """

    def is_valid(self) -> bool:
        valid = super().is_valid()
        empty = [
            name
            for name, declared in self.filters.items()
            if self.data.get(name) == "" and not isinstance(declared, filters.CharFilter)
        ]
        for name in empty:
            self.form.add_error(name, "must not be empty (leave the parameter out to not filter)")
        return bool(valid) and not empty


class StrictBooleanField(forms.NullBooleanField):
    """``true``/``false`` (or ``1``/``0``); anything else is an error, not "no filter"."""

    def to_python(self, value: Any) -> bool | None:  # type: ignore[override] # None: not given
        if value in (None, ""):
            return None
        if str(value).lower() in ("true", "1"):
            return True
        if str(value).lower() in ("false", "0"):
            return False
        raise forms.ValidationError(f"must be true or false, got {value!r}")

    def validate(self, value: Any) -> None:
        pass


class StrictBooleanFilter(filters.BooleanFilter):
    """A boolean filter whose raw value reaches :class:`StrictBooleanField` (django-filter's
    own widget turns anything unknown into "no filter" before the field sees it)."""

    field_class = StrictBooleanField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", forms.TextInput)
        super().__init__(*args, **kwargs)


class AnyCaseChoiceField(FilterChoiceField):
    """A choice matched whatever its case (``phase=bound`` is ``Bound``); a wrong one is
    told the choices."""

    def to_python(self, value: Any) -> str:
        text = super().to_python(value)
        by_lower = {str(choice).lower(): str(choice) for choice, _ in self.choices if choice != ""}
        return str(by_lower.get(text.lower(), text))

    def validate(self, value: Any) -> None:
        if value in self.empty_values:
            return
        if not self.valid_value(value):
            choices = ", ".join(str(choice) for choice, _ in self.choices if choice != "")
            raise forms.ValidationError(f"{value!r} is not one of {choices} (any case)", code="invalid_choice")


class AnyCaseChoiceFilter(filters.ChoiceFilter):
    field_class = AnyCaseChoiceField


class UsageRecordFilter(StrictFilterSet):
    """Filters of ``usage-records``; ``from``/``to`` keep records that overlap the range."""

    key = filters.CharFilter(help_text="class name or raw resource name")
    phase = AnyCaseChoiceFilter(choices=RecordPhase.choices)
    subject = filters.CharFilter(help_text="device or pod name")
    subject_kind = AnyCaseChoiceFilter(choices=SubjectKind.choices)
    node = filters.CharFilter()
    vm = filters.CharFilter(field_name="vm_name")
    open = StrictBooleanFilter(field_name="end", lookup_expr="isnull", help_text="true: only open records")

    class Meta:
        model = UsageRecord
        fields: list[str] = []


def _held_at_or_after(queryset: QuerySet[UsageRecord], name: str, value: datetime) -> QuerySet[UsageRecord]:
    return queryset.filter(Q(end__isnull=True) | Q(end__gt=value))


# ``from`` is a Python keyword: declared after the class.
UsageRecordFilter.base_filters["from"] = UtcIsoDateTimeFilter(
    method=_held_at_or_after, help_text="records still held after this time (open, or ending later)"
)
UsageRecordFilter.base_filters["to"] = UtcIsoDateTimeFilter(
    field_name="start", lookup_expr="lt", help_text="records that started before this time"
)


class DeviceFilter(StrictFilterSet):
    namespace = filters.CharFilter(field_name="namespace__name")
    phase = AnyCaseChoiceFilter(choices=binder_models.Phase.choices)
    node = filters.CharFilter()
    vm = filters.CharFilter(field_name="vm_name")
    className = filters.CharFilter(field_name="class_name")
    reason = filters.CharFilter(lookup_expr="icontains", help_text="words the reason contains")

    class Meta:
        model = binder_models.GpuDevice
        fields: list[str] = []

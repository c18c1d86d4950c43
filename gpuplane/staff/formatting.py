"""Template filters of the staff pages (a builtin library: every template has them).

``{{ t|iso }}`` a time, ``{{ t|age }}`` how long ago, ``{{ ms|duration_ms }}`` a rounded
duration; the rules are ``binder.reports.formatting``'s, shared with the model admins.
"""

from __future__ import annotations

from datetime import datetime

from django import template

from binder.reports import formatting

register = template.Library()


@register.filter
def iso(value: datetime | None) -> str:
    return formatting.iso(value)


@register.filter
def age(value: datetime | None) -> str:
    return formatting.age(value)


@register.filter
def duration_ms(value: float | None) -> str:
    return formatting.duration_ms(value)

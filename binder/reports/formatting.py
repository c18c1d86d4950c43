"""How staff pages write times, ages, durations and a device's class: one format everywhere.

Times are ISO 8601 with seconds and the zone's offset, in the site's time zone, exactly as
the admin's own columns print them (``gpuplane.formats.en.formats.DATETIME_FORMAT``), so a
time copied from one page finds its row on another. Ages and durations are rounded to
what a person compares at a glance ("Lost 7 min", "13.5 ms"); the exact figures stay in the
database, the API and ``/metrics``.

A device's class, when its order accepts several classes: a device with alternatives is
held as one of its choices while Bound or Lost, and booked as its first choice while
Pending; the pages that list devices say which, beside every choice in order of preference
("held as a10 (choices h100, a10)"), so staff can tell an order placed on its second choice
from one placed as asked. A device without alternatives reads as it always did: its class
alone.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import formats, timezone

from binder import models


def iso(value: datetime | None) -> str:
    """``2026-11-30T12:00:05+0000``: the site's one time format ("" for no time)."""
    if value is None:
        return ""
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return formats.date_format(value, "DATETIME_FORMAT")


def age(since: datetime | None, now: datetime | None = None) -> str:
    """How long ago ``since`` was, to the unit that matters: "45 s", "7 min", "3 h 5 min", "2 d 4 h"."""
    if since is None:
        return ""
    return span(max(timedelta(0), (now or timezone.now()) - since))


def span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def duration_ms(value: float | None) -> str:
    """A pass's or an answer's duration: "0.42 ms", "13.5 ms", "1.24 s", "2 min 5 s"."""
    if value is None:
        return ""
    if value < 1:
        return f"{value:.2f} ms"
    if value < 1000:
        return f"{value:.1f} ms"
    if value < 60_000:
        return f"{value / 1000:.2f} s"
    if value < 3_600_000:
        minutes, seconds = divmod(int(value // 1000), 60)
        return f"{minutes} min {seconds} s"
    return span(timedelta(milliseconds=value))


def duration_s(value: float | None) -> str:
    """A lag or an interval kept in seconds, rounded like :func:`duration_ms`."""
    return "" if value is None else duration_ms(value * 1000)


def choices_words(device: models.GpuDevice) -> str:
    """``held as a10 (choices h100, a10)`` while held, ``choices h100, a10`` while Pending;
    "" for a device without alternatives (nothing new to say)."""
    if not device.alternative_class_names:
        return ""
    choices = ", ".join([device.class_name, *device.alternative_class_names])
    held = held_class(device)
    return f"held as {held} (choices {choices})" if device.phase != models.Phase.PENDING else f"choices {choices}"


def held_class(device: models.GpuDevice) -> str:
    """The class the device is booked as: the held class while Bound or Lost (when the
    binder has written one), else ``spec.className``."""
    if device.phase != models.Phase.PENDING and device.status_class_name:
        return device.status_class_name
    return device.class_name


def class_words(device: models.GpuDevice) -> str:
    """A device's class column: the class alone without alternatives, else the held class
    and every choice (:func:`choices_words`)."""
    return choices_words(device) or device.class_name

"""``{% load device_tags %}``: how a device's class reads on the staff pages that list
devices (the set's decision log, the node page, the Lost sets view, the device page),
worded once in ``binder.reports.formatting``."""

from __future__ import annotations

from django import template

from binder import models
from binder.reports.formatting import choices_words, class_words

register = template.Library()


@register.filter
def device_class(device: models.GpuDevice) -> str:
    """The class column: ``h100`` without alternatives, ``held as a10 (choices h100, a10)`` with."""
    return class_words(device)


@register.filter
def device_choices(device: models.GpuDevice) -> str:
    """Only what alternatives add (empty without them), for lists that name no class."""
    return choices_words(device)

"""How staff pages name the class of a device whose order accepts several classes.

A device with alternatives is held as one of its choices while Bound or Lost, and booked
as its first choice while Pending; the pages that list devices say which, beside every
choice in order of preference ("held as a10 (choices h100, a10)"), so staff can tell an
order placed on its second choice from one placed as asked. A device without
alternatives reads as it always did: its class alone.
"""

from __future__ import annotations

from binder import models


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

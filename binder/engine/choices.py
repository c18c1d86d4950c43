"""Orders that accept several GPU classes: the pure rules of choosing among them.

A device may list further classes after ``spec.className``, in order of preference. Every
member of a set must list the same ones, and a set is always held as one of them, all
members alike. Placing a set tries its choices in order and takes the first one that fits;
these helpers say what a set's choices are, whether its members agree, and how to word
the classes a placement passed over. The pass itself (``binder.engine.placement``) does
the placing, so a set with a single choice goes through exactly the code it always did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from binder.engine.types import Device

#: At most this many classes per device (``spec.className`` and its alternatives).
MAX_ALTERNATIVES = 8


def choices_of(device: Device) -> tuple[str, ...]:
    """The classes ``device`` accepts, first preference first (just its class when it
    lists no alternatives)."""
    return device.choices if len(device.choices) > 1 else (device.class_name,)


def has_alternatives(devices: Iterable[Device]) -> bool:
    """Whether any of ``devices`` accepts more than one class."""
    return any(len(d.choices) > 1 for d in devices)


def spec_class(device: Device) -> str:
    """``spec.className``: the first choice (the class the device is booked by while Pending)."""
    return device.choices[0] if device.choices else device.class_name


def disagreement(devices: Sequence[Device]) -> str | None:
    """A sentence naming two members of one set that list different choices, or None.

    Only sets where some member lists alternatives are checked: without alternatives a
    set may mix classes, as it always could.
    """
    if not has_alternatives(devices):
        return None
    ordered = sorted(devices, key=lambda d: d.name)
    first = ordered[0]
    for other in ordered[1:]:
        if choices_of(other) != choices_of(first):
            return (
                f"members {first.name} ({', '.join(choices_of(first))}) and {other.name} "
                f"({', '.join(choices_of(other))}) list different classes; every member of a set must "
                "list the same className and alternativeClassNames"
            )
    return None


def reclassed(devices: Iterable[Device], names: set[str], choice: str) -> tuple[Device, ...]:
    """``devices`` with the named ones booked as class ``choice``."""
    return tuple(
        d.placed(choice, d.phase, d.node, d.since, d.reason) if d.name in names and d.class_name != choice else d
        for d in devices
    )


def passed_over(notes: Sequence[tuple[str, str]]) -> str:
    """``h100: no h100 node has room for ...; a100: over budget: ...``: each class a
    placement passed over, with why."""
    return "; ".join(f"{choice}: {why}" for choice, why in notes)


def placed_as(choice: str, notes: Sequence[tuple[str, str]]) -> str:
    """The note a placement reason gets when the set was placed on a later choice (empty
    for the first choice: its reason reads as it always did)."""
    if not notes:
        return ""
    return f", as {choice} (passed over {passed_over(notes)})"

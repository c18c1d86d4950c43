"""Stable colours for tenants and chart series.

Staff learn "team-nlp is orange" from the board and expect the same colour on the usage
chart tomorrow, so a colour is derived from the name alone (a hash), never from the
position of a name in today's list, which changes as tenants come and go. Hue and
lightness both come from the hash, so two names rarely look alike.
"""

from __future__ import annotations

import hashlib

_LIGHTNESS = (42, 52, 62)


def _colour(name: str, saturation: int) -> str:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    hue = int.from_bytes(digest[:4]) % 360
    return f"hsl({hue} {saturation}% {_LIGHTNESS[digest[4] % 3]}%)"


def tenant_colour(namespace: str) -> str:
    """The board's and the charts' colour of a tenant namespace (an HSL CSS colour)."""
    return _colour(namespace, 65)


#: For series that are few and not tenants (classes on the usage chart): ten colours that
#: are told apart easily, taken in the order the series are sorted.
CATEGORICAL = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)


def categorical(index: int) -> str:
    """The colour of the ``index``-th series of a chart (repeats after ten)."""
    return CATEGORICAL[index % len(CATEGORICAL)]

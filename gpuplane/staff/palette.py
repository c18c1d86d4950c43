"""Colours for tenants and chart series that every eye can tell apart.

A hashed hue per tenant gave 225 colours for 250 tenants: most were indistinguishable,
some (yellow, 1.44:1 on white) were barely visible, and green and yellow merged under
deuteranopia. Now the few tenants that matter on a page (the top ones by units or
GPU-hours, ranked on that page and named in its legend) get a colour from a fixed,
colour-blind-safe palette, and every other tenant shares one neutral grey with a hatch
pattern; the tooltip, the panel and the legend name the tenant in words, so colour never
carries the meaning alone.

The palette is Okabe & Ito's (blue, vermillion, bluish green, reddish purple) with Paul
Tol's muted indigo, wine and olive: seven colours designed to stay distinct under the common
colour-vision deficiencies, each with at least 3:1 contrast against white (WCAG 1.4.11
for graphics; :func:`contrast` checks it, and a test holds every entry to it). Okabe-Ito's
orange, sky blue and yellow are left out: under 3:1 on white.
"""

from __future__ import annotations

#: The top tenants' colours, in rank order (the first is the tenant with the most units).
PALETTE = (
    "#0072B2",  # Okabe-Ito blue            5.2:1
    "#D55E00",  # Okabe-Ito vermillion      3.9:1
    "#009E73",  # Okabe-Ito bluish green    3.4:1
    "#332288",  # Tol muted indigo         12.2:1
    "#CC79A7",  # Okabe-Ito reddish purple  3.1:1
    "#882255",  # Tol muted wine            8.7:1
    "#999933",  # Tol muted olive           3.0:1
)
#: Every tenant past the palette: one grey (5.1:1), drawn with a hatch pattern.
OTHER = "#6E6E6E"


def _luminance(colour: str) -> float:
    channels = [int(colour.lstrip("#")[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(colour: str, background: str = "#FFFFFF") -> float:
    """WCAG contrast ratio of two ``#RRGGBB`` colours."""
    high, low = sorted((_luminance(colour), _luminance(background)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def ranked_colours(names: list[str]) -> dict[str, str]:
    """``names`` (ranked, the largest first) to colours: the palette for the first ones,
    :data:`OTHER` for the rest."""
    return {name: PALETTE[i] if i < len(PALETTE) else OTHER for i, name in enumerate(names)}


#: For series that are few and not tenants (classes on the usage chart), in sorted order.
#: Not the tenants' colours: the usage chart draws tenants above and classes below, and
#: the same blue for the top tenant and for a class read as the same thing. These are
#: darker or other hues (ColorBrewer's dark red and teal, Tol's magenta, browns and a dark
#: olive, Tol's purple), each at least 3:1 on white and far (CIE76 ΔE ≥ 25) from every
#: tenant colour; the legend still names every series.
CATEGORICAL = (
    "#B2182B",  # dark red      6.9:1
    "#01665E",  # dark teal     6.9:1
    "#EE3377",  # Tol magenta   3.9:1
    "#885500",  # brown         6.3:1
    "#553311",  # dark brown   11.2:1
    "#AA4499",  # Tol purple    5.3:1
    "#666633",  # dark olive    6.0:1
)


def categorical(index: int) -> str:
    """The colour of the ``index``-th series of a chart (grey past the palette)."""
    return CATEGORICAL[index] if index < len(CATEGORICAL) else OTHER

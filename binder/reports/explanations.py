"""Lost and Pending sets explained for staff pages, as HTML (issue 18).

The engine (``binder.engine.explain``) says what a set needs and what would fit; this reads
the mirror once for it and renders the one block every page shows (the board's panel, the
Lost sets view, the device page), so the three never word it differently.
"""

from __future__ import annotations

from datetime import datetime

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from binder.engine.accounting import SetKey
from binder.engine.explain import Explanation, explain_sets
from binder.mirror.read import read_cluster


def explanations_now(now: datetime) -> dict[SetKey, Explanation]:
    """Every set with a Lost or Pending device, explained from the mirror as it is now."""
    cluster, _ = read_cluster(now)
    return explain_sets(cluster)


def explanation_html(why: Explanation) -> SafeString:
    """The explanation as a block: what it needs (the largest gap, who holds the rest), the
    VMI's node flagged when NotReady, and the options that would fit, fewest changes first."""
    vmi = (
        format_html('<p class="vmi{}">{}</p>', " notready" if why.vmi_node_not_ready else "", why.vmi_note)
        if why.vmi_note
        else ""
    )
    steps = (
        format_html(
            '<p class="fit-heading">would fit:</p><ol class="would-fit">{}</ol>',
            format_html_join("", "<li>{}</li>", ((step,) for step in why.steps)),
        )
        if why.steps
        else ""
    )
    return format_html(
        '<div class="explain" data-set="{}/{}"><p class="needs">{}</p>{}{}</div>',
        why.namespace,
        why.vm,
        why.summary,
        vmi,
        steps,
    )

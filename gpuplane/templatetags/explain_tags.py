"""``{% load explain_tags %}``: Lost and Pending sets explained, on pages whose view is not
ours to change (the Lost sets view is binder's changelist). The mirror is read once per
page render however many rows ask (and not at all while the board's cached snapshot is current)."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from binder.engine.explain import Explainer, Explanation
from binder.engine.ledger_records import SetKey
from binder.engine.types import Phase
from binder.reports.explanations import explanation_html
from gpuplane.staff.snapshot import snapshot

register = template.Library()


def _explanations(context: Any) -> dict[SetKey, Explanation]:
    cache = context.render_context
    if "gp_explanations" not in cache:
        snap = snapshot(timezone.now())  # the board's snapshot, reused while the mirror is unchanged
        explainer = Explainer(snap.cluster, snap.ledger, snap.holdings)
        keys = sorted({d.set_key for d in snap.cluster.devices if d.phase is not Phase.BOUND})
        cache["gp_explanations"] = {key: explainer.explain(key) for key in keys}
    found: dict[SetKey, Explanation] = cache["gp_explanations"]
    return found


@register.simple_tag(takes_context=True)
def explain_set(context: Any, namespace: str, vm: str) -> SafeString | str:
    """The explanation block of set ``namespace/vm`` (empty when it is Bound)."""
    why = _explanations(context).get((namespace, vm))
    return explanation_html(why) if why else ""


@register.simple_tag(takes_context=True)
def vmi_node_flag(context: Any, namespace: str, vm: str) -> SafeString | str:
    """A NotReady badge when the set's VMI runs on a NotReady node."""
    why = _explanations(context).get((namespace, vm))
    if why is None or not why.vmi_node_not_ready:
        return ""
    return format_html('<span class="badge notready" title="{}">NotReady</span>', why.vmi_note)


@register.simple_tag(takes_context=True)
def pending_sets(context: Any) -> list[Explanation]:
    """Sets with Pending devices and no Lost one, explained."""
    return [why for why in _explanations(context).values() if why.phase is Phase.PENDING]


@register.filter
def explained(why: Explanation) -> SafeString:
    """An explanation already worked out (the board's), as its block."""
    return explanation_html(why)

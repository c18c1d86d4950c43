"""Reading a Prometheus text exposition: the totals the harness and the benches take from a
``/metrics`` page (the apiserver's, the webhook server's)."""

from __future__ import annotations


def histogram_totals(text: str, metric: str, /, **labels: str) -> tuple[float, float]:
    """``(count, sum)`` of histogram ``metric`` in the exposition ``text``, added up over its series
    whose labels include ``labels`` (every series without; a label may be called ``name``)."""
    from prometheus_client.parser import text_string_to_metric_families

    count = total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != metric:
            continue
        for sample in family.samples:
            if any(sample.labels.get(key) != value for key, value in labels.items()):
                continue
            if sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    return count, total

"""gpuplane's Grafana dashboards, as data: hack/chart.py writes them to charts/gpuplane/dashboards/
(JSON for import, and the chart's ConfigMaps for Grafana's sidecar) and lists every panel with the
question it answers in docs/operations.md.

Every query uses only series /metrics exports (tests/project/test_chart.py scrapes the product and fails on
a name it does not find). Every web process answers the same database-derived numbers, so each
query takes ``max`` over the scraped instances before it sums over anything else; only the
``gpuplane_readmodel_*`` series describe the process that answered (label ``process``).

Every series a query selects is scoped to the dashboard's ``namespace`` and ``job`` variables
(one release: its namespace and its API Service's job), and the webhook server's own series
(``gpuplane_webhook_*``) to ``webhook_job``, so one Grafana shows several releases apart
(:func:`scoped` adds the matchers; the queries below are written without them).
"""

from __future__ import annotations

import re
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: Panel kind -> (Grafana panel type, width, height).
KINDS = {
    "stat": ("stat", 6, 5),
    "series": ("timeseries", 12, 8),
    "bars": ("bargauge", 12, 8),
    "table": ("table", 12, 8),
}


#: The webhook server's own series (deploy/webhook_server.py's metrics port), on their own job.
WEBHOOK_SERVER_SERIES = ("gpuplane_webhook_reviews", "gpuplane_webhook_review_seconds", "gpuplane_webhook_certificate")
SERIES = re.compile(r"\b(gpuplane_[a-z0-9_]+)(\{([^}]*)\})?")


def scoped(expr: str) -> str:
    """``expr`` with every gpuplane series limited to the dashboard's release."""

    def scope(match: re.Match[str]) -> str:
        name, inner = match.group(1), match.group(3)
        job = "$webhook_job" if name.startswith(WEBHOOK_SERVER_SERIES) else "$job"
        matchers = f'namespace=~"$namespace", job=~"{job}"'
        return f"{name}{{{matchers}{', ' + inner if inner else ''}}}"

    return SERIES.sub(scope, expr)


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A query variable over one label of the release's series."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "current": {},
        "hide": 0,
    }


def panel(
    kind: str, title: str, answers: str, *targets: tuple[str, str], unit: str = "short", stack: bool = False
) -> dict[str, Any]:
    """One panel: ``answers`` is its description (the question it answers); ``targets`` are
    (PromQL, legend) pairs."""
    kind_type, width, height = KINDS[kind]
    defaults: dict[str, Any] = {"unit": unit}
    if kind == "series":
        defaults["custom"] = {"stacking": {"mode": "normal" if stack else "none"}, "fillOpacity": 20 if stack else 0}
    out: dict[str, Any] = {
        "type": kind_type,
        "title": title,
        "description": answers,
        "datasource": DATASOURCE,
        "gridPos": {"w": width, "h": height},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {},
        "targets": [
            {"datasource": DATASOURCE, "expr": scoped(expr), "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }
    if kind == "table":
        out["targets"] = [{**t, "format": "table", "instant": True} for t in out["targets"]]
        out["transformations"] = [{"id": "merge", "options": {}}]
    if kind == "bars":
        out["targets"] = [{**t, "instant": True} for t in out["targets"]]
        out["options"] = {"orientation": "horizontal", "displayMode": "gradient"}
    return out


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"w": 24, "h": 1}, "panels": []}


HELD = 'max by (class, phase) (gpuplane_class_devices{phase=~"Bound|Lost"})'


def held_over(window: str) -> str:
    """Held devices by class and phase, averaged over ``window``."""
    return f'max by (class, phase) (avg_over_time(gpuplane_class_devices{{phase=~"Bound|Lost"}}[{window}]))'


FLEET = [
    row("Devices"),
    panel(
        "stat",
        "Bound devices",
        "How many GPU devices are placed on a node now?",
        ('max(gpuplane_devices{phase="Bound"})', "Bound"),
    ),
    panel(
        "stat",
        "Pending devices",
        "How many devices wait for a node (orders without room or over budget, or naming a missing class)?",
        ('max(gpuplane_devices{phase="Pending"})', "Pending"),
    ),
    panel(
        "stat",
        "Lost devices",
        "How many devices lost their node and found no other?",
        ('max(gpuplane_devices{phase="Lost"})', "Lost"),
    ),
    panel(
        "stat",
        "Lost sets",
        "How many VMs (sets) have Lost devices? Alerted after 10 minutes (GpuplaneLostSets).",
        ("max(gpuplane_lost_sets)", "Lost sets"),
    ),
    panel(
        "series",
        "Devices by phase",
        "How did Bound, Pending and Lost devices change over time?",
        ("max by (phase) (gpuplane_devices)", "{{phase}}"),
        stack=True,
    ),
    panel(
        "series",
        "Lost sets over time",
        "Since when have sets been Lost? A flat line above 0 is a set Lost that long.",
        ("max(gpuplane_lost_sets)", "Lost sets"),
    ),
    row("Classes"),
    panel(
        "table",
        "Devices by class and phase",
        "For each GPU class: how many devices are Bound, Pending and Lost now?",
        ("max by (class, phase) (gpuplane_class_devices)", "{{class}} {{phase}}"),
    ),
    panel(
        "bars",
        "Held devices by class",
        "Which classes hold the most devices (Bound or Lost)?",
        (f"sum by (class) ({HELD})", "{{class}}"),
    ),
    panel(
        "series",
        "Pending devices by class",
        "Which classes have orders waiting, and for how long? Alerted after 30 minutes (GpuplaneOrdersPending).",
        ('max by (class) (gpuplane_class_devices{phase="Pending"})', "{{class}}"),
    ),
    panel(
        "series",
        "Sets refused per pass",
        "How many sets does each pass leave unplaced (Pending or Lost), and is it growing?",
        (
            'max by (kind) (rate(gpuplane_pass_outcomes_total{outcome="refused"}[5m])) / max by (kind) (rate(gpuplane_passes_total[5m]))',
            "{{kind}} pass",
        ),
    ),
    row("Mirror"),
    panel(
        "series",
        "Objects that stopped parsing",
        "Cluster mode: which kinds have objects the sync keeps in their last good state because they no longer parse?",
        ("max by (kind) (gpuplane_mirror_parse_errors)", "{{kind}}"),
    ),
    panel(
        "series",
        "Objects in the last list",
        "Cluster mode: how many objects of each kind does the sync mirror?",
        ("max by (kind) (gpuplane_sync_listed_objects)", "{{kind}}"),
    ),
]

BINDER = [
    row("Passes"),
    panel(
        "series",
        "Passes per second",
        "How often do full and answer passes run?",
        ("max by (kind) (rate(gpuplane_passes_total[5m]))", "{{kind}}"),
        unit="ops",
    ),
    panel(
        "series",
        "Pass duration p50 / p99",
        "How long do passes take (lock wait, read, decide, write)?",
        (
            "histogram_quantile(0.5, max by (kind, le) (rate(gpuplane_pass_duration_seconds_bucket[5m])))",
            "p50 {{kind}}",
        ),
        (
            "histogram_quantile(0.99, max by (kind, le) (rate(gpuplane_pass_duration_seconds_bucket[5m])))",
            "p99 {{kind}}",
        ),
        unit="s",
    ),
    panel(
        "series",
        "Set outcomes per minute",
        "How many sets do passes bind, move, send to Lost and restore?",
        (
            'sum by (outcome) (max by (kind, outcome) (rate(gpuplane_pass_outcomes_total{outcome=~"bound|moved|lost|restored"}[5m]))) * 60',
            "{{outcome}}",
        ),
        stack=True,
    ),
    panel(
        "series",
        "Mean pass duration",
        "What does an average pass cost, by kind?",
        (
            "max by (kind) (rate(gpuplane_pass_duration_seconds_sum[5m])) / max by (kind) (rate(gpuplane_pass_duration_seconds_count[5m]))",
            "{{kind}}",
        ),
        unit="s",
    ),
    row("Verification"),
    panel(
        "stat",
        "Binder verification mismatches (24 h)",
        "Did a verification find the worker's incremental view differing from a rebuild? Anything above 0 is a bug (GpuplaneVerifyMismatch).",
        ("max(increase(gpuplane_verify_mismatches_total[24h]))", "mismatches"),
    ),
    panel(
        "stat",
        "Read model mismatches (24 h)",
        "Did a web process's read model differ from a read from scratch? (GpuplaneReadModelVerifyMismatch)",
        ("sum(increase(gpuplane_readmodel_verify_mismatches_total[24h]))", "mismatches"),
    ),
    panel(
        "series",
        "Verification mismatches",
        "When did mismatches happen?",
        ("max(increase(gpuplane_verify_mismatches_total[15m]))", "binder"),
        ("sum by (process) (increase(gpuplane_readmodel_verify_mismatches_total[15m]))", "read model {{process}}"),
    ),
    row("Queue"),
    panel(
        "series",
        "Passes waiting in the broker",
        "Is work piling up in the binder queue?",
        ("max(gpuplane_queued_passes)", "queued passes"),
    ),
    panel(
        "series",
        "Pass queued flags",
        "Is a full or answer pass queued (further events then queue nothing more)?",
        ("max by (kind) (gpuplane_pass_queued)", "{{kind}}"),
    ),
    panel(
        "stat",
        "Broker up",
        "Did the Redis broker answer the last scrape? (1 yes, 0 no)",
        ("min(gpuplane_broker_up)", "broker up"),
    ),
    row("Sync (cluster mode)"),
    panel(
        "series",
        "Sync lag by kind",
        "How long from a batch of watch events' first receipt to its mirror rows committed?",
        ("max by (kind) (gpuplane_sync_lag_seconds)", "{{kind}}"),
        unit="s",
    ),
    panel(
        "series",
        "Watch events per second",
        "How busy is each kind's watch?",
        ("max by (kind) (rate(gpuplane_sync_events_total[5m]))", "{{kind}}"),
        unit="ops",
    ),
    panel(
        "series",
        "Relists, 410 Gone and errors",
        "Are watches expiring or failing, forcing relists?",
        ("max by (kind) (increase(gpuplane_sync_relists_total[15m]))", "relists {{kind}}"),
        ("max by (kind) (increase(gpuplane_sync_gone_total[15m]))", "410 {{kind}}"),
        ("max by (kind) (increase(gpuplane_sync_errors_total[15m]))", "errors {{kind}}"),
    ),
    panel(
        "series",
        "Refused and stale objects",
        "Are objects refused as unparsable, or events ignored as older than the binder's own write?",
        ("max by (kind) (increase(gpuplane_sync_invalid_total[15m]))", "invalid {{kind}}"),
        ("max by (kind) (increase(gpuplane_sync_stale_total[15m]))", "stale {{kind}}"),
    ),
]

WEBHOOK = [
    row("Bind requests"),
    panel(
        "series",
        "Answers per minute",
        "How many new orders did the webhook ask the binder about, allowed or refused?",
        ("max by (allowed) (rate(gpuplane_bind_answers_total[5m])) * 60", "allowed={{allowed}}"),
        stack=True,
    ),
    panel(
        "series",
        "Refused share",
        "What share of bind requests does the binder refuse (over budget, no room, missing class)?",
        (
            'max(rate(gpuplane_bind_answers_total{allowed="false"}[5m])) / max(rate(gpuplane_bind_answers_total[5m]))',
            "refused",
        ),
        unit="percentunit",
    ),
    panel(
        "series",
        "Wait for the answer p50 / p90 / p99",
        "How long does a VMI that orders GPUs wait for the binder? (A Bound VM is answered from memory.) Alerted at p99 > 1 s (GpuplaneWebhookSlow).",
        *(
            (
                f"histogram_quantile({q}, max by (le) (rate(gpuplane_bind_answer_latency_seconds_bucket[5m])))",
                f"p{round(q * 100)}",
            )
            for q in (0.5, 0.9, 0.99)
        ),
        unit="s",
    ),
    panel(
        "series",
        "Answers after the webhook's wait",
        'How many VMIs were denied "try again" because the answer came after GPUPLANE_BIND_WAIT_SECONDS (8 s)? (GpuplaneWebhookTryAgain)',
        (
            'max(increase(gpuplane_bind_answer_latency_seconds_count[10m])) - max(increase(gpuplane_bind_answer_latency_seconds_bucket{le="8.0"}[10m]))',
            "late answers",
        ),
    ),
    row("Webhook server"),
    panel(
        "series",
        "Calls by outcome",
        "What does the webhook server answer per minute: allowed, patched (pinned), denied, shed, errors, callers refused (unauthorized) or malformed reviews? Errors and refused callers alert (GpuplaneWebhookErrors), mostly denials too (GpuplaneWebhookRefusing).",
        ("sum by (outcome) (rate(gpuplane_webhook_reviews_total[5m])) * 60", "{{outcome}}"),
        stack=True,
    ),
    panel(
        "series",
        "Call latency p50 / p99",
        "How long does the webhook take to answer the apiserver, arrival to answer (a Bound VM in about a millisecond, a new order up to GPUPLANE_BIND_WAIT_SECONDS)?",
        *(
            (
                f"histogram_quantile({q}, sum by (le) (rate(gpuplane_webhook_review_seconds_bucket[5m])))",
                f"p{round(q * 100)}",
            )
            for q in (0.5, 0.99)
        ),
        unit="s",
    ),
    panel(
        "stat",
        "Certificate expires in",
        "How long until the serving certificate a webhook pod serves expires? Alerted below 14 days (GpuplaneWebhookCertificateExpiry).",
        ("min(gpuplane_webhook_certificate_expiry_seconds) - time()", "expires in"),
        unit="s",
    ),
    row("Read model (per web process)"),
    panel(
        "table",
        "Read model ready",
        "Has every scraped web process built its read model (1)? Alerted after 10 minutes at 0 (GpuplaneReadModelNotReady).",
        ("gpuplane_readmodel_ready", "{{process}}"),
    ),
    panel(
        "series",
        "Read model build time",
        "How long did each process's last full read of the mirror take?",
        ("gpuplane_readmodel_build_seconds", "{{process}}"),
        unit="s",
    ),
    panel(
        "series",
        "Follows, rebuilds and verifications",
        "Does each read model follow the change feed, and how often does it rebuild or verify?",
        ("sum by (process) (rate(gpuplane_readmodel_follows_total[5m]))", "follows {{process}}"),
        ("sum by (process) (increase(gpuplane_readmodel_rebuilds_total[1h]))", "rebuilds/h {{process}}"),
        ("sum by (process) (increase(gpuplane_readmodel_verifications_total[1h]))", "verifications/h {{process}}"),
    ),
]

USAGE = [
    row("Held devices"),
    panel(
        "series",
        "Held devices by class",
        "How many devices does each class hold (Bound or Lost: both count in budgets and usage records)?",
        (f"sum by (class) ({HELD})", "{{class}}"),
        stack=True,
    ),
    panel(
        "bars",
        "Device-hours by class (dashboard range)",
        "How many device-hours did each class hold over the selected range (sampled from the device counts)?",
        (f"sum by (class) ({held_over('$__range')}) * $__range_s / 3600", "{{class}}"),
        unit="h",
    ),
    panel(
        "series",
        "Device-hours per day by class",
        "How many device-hours did each class hold per day?",
        (f"sum by (class) ({held_over('1d')}) * 24", "{{class}}"),
        unit="h",
        stack=True,
    ),
    panel(
        "series",
        "Lost share of held devices",
        "What share of held devices are Lost (held for the tenant but on no node)?",
        (
            'max(gpuplane_devices{phase="Lost"}) / (max(gpuplane_devices{phase="Lost"}) + max(gpuplane_devices{phase="Bound"}))',
            "Lost share",
        ),
        unit="percentunit",
    ),
]

DASHBOARDS: dict[str, tuple[str, str, list[dict[str, Any]]]] = {
    "fleet": ("gpuplane / Fleet", "GPU devices by phase and class, Lost sets, Pending orders, the mirror.", FLEET),
    "binder": ("gpuplane / Binder", "Passes, their duration and outcomes, verification, the queue, the sync.", BINDER),
    "webhook": (
        "gpuplane / Webhook",
        "Bind requests, refusals, the wait for the binder, late answers, the read model.",
        WEBHOOK,
    ),
    "usage": ("gpuplane / Usage", "Devices held and device-hours by class.", USAGE),
}


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ids and positions: panels flow left to right, rows start a new line."""
    out, x, y, line = [], 0, 0, 0
    for i, item in enumerate(panels, start=1):
        pos = item["gridPos"]
        if item["type"] == "row" or x + pos["w"] > 24:
            x, y = 0, y + line
            line = 0
        out.append({**item, "id": i, "gridPos": {**pos, "x": x, "y": y}})
        x, line = x + pos["w"], max(line, pos["h"])
        if item["type"] == "row":
            x, y, line = 0, y + pos["h"], 0
    return out


def dashboard(name: str) -> dict[str, Any]:
    title, description, panels = DASHBOARDS[name]
    return {
        "uid": f"gpuplane-{name}",
        "title": title,
        "description": description,
        "tags": ["gpuplane"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "1m",
        "time": {"from": "now-24h" if name != "usage" else "now-7d", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["gpuplane"], "asDropdown": True, "title": "gpuplane"}],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("namespace", "Namespace", "label_values(gpuplane_devices, namespace)"),
                variable("job", "Release (API job)", 'label_values(gpuplane_devices{namespace="$namespace"}, job)'),
                *(
                    [
                        variable(
                            "webhook_job",
                            "Webhook server job",
                            'label_values(gpuplane_webhook_reviews_total{namespace="$namespace"}, job)',
                        )
                    ]
                    if name == "webhook"
                    else []
                ),
            ]
        },
        "panels": layout(panels),
    }

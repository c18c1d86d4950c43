"""``GET /metrics``: Prometheus metrics of the binder, derived from the database at scrape time.

Why not prometheus_client's ``Counter`` and ``Histogram`` objects: passes run in Celery
worker processes, often on other hosts, and the web runs several gunicorn processes,
so counters kept in process memory would each hold only the part their own process
saw (a web process sees at most the passes it ran itself). The database is the truth:
every pass leaves a ``PassRun`` row, every answered bind request a ``BindAnswer`` row,
every device its phase. So each scrape asks the database, through one custom collector:

- counters are SUMs over ``PassRun`` / ``BindAnswer`` rows (monotonic while rows are kept;
  deleting old rows looks like a counter reset to Prometheus, which ``rate()`` handles);
- histograms are bucket counts computed in SQL, one aggregate query per histogram with
  a conditional count per bucket (no Python loop over rows);
- gauges are COUNT queries.

Every web process answers the same numbers, whichever one is scraped. A scrape runs five
queries, plus one Redis round trip for the queue length when the broker is Redis.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from django.conf import settings
from django.db.models import Case, Count, F, Q, Sum, Value, When
from django.db.models.functions import Coalesce, NullIf
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from binder import models
from binder.engine.types import Outcome
from binder.mirror.write import MODELS
from binder.queue import BINDER_QUEUE, COLLAPSE_KEY, collapse_key
from binder.runtime import readmodel

log = logging.getLogger(__name__)

#: Pass duration buckets, in milliseconds (exported in seconds): 5 ms ... 30 s.
PASS_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 20000, 30000)
#: Bind answer latency buckets, in milliseconds: 5 ms ... 10 s (8 s is the default
#: GPUPLANE_BIND_WAIT_SECONDS, 10 s the webhook timeout).
ANSWER_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 8000, 10000)

#: Redis must answer a scrape quickly or not at all.
REDIS_TIMEOUT_SECONDS = 1.0

PHASES = tuple(models.Phase.values)
KINDS = tuple(models.PassKind.values)
OUTCOMES = tuple(o.value for o in Outcome)


def _le(ms: float) -> str:
    return str(floatToGoString(ms / 1000))  # type: ignore[no-untyped-call] # prometheus_client leaves it untyped


def _buckets(row: Mapping[str, Any], bounds_ms: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs from a row annotated with ``le_<i>`` and ``observed``."""
    pairs: list[tuple[str, float]] = [(_le(ms), row[f"le_{i}"]) for i, ms in enumerate(bounds_ms)]
    pairs.append(("+Inf", row["observed"]))
    return pairs


def _bucket_counts(field: str, bounds_ms: Sequence[int]) -> dict[str, Any]:
    """Aggregates for one histogram: a conditional count per bucket, the count and the sum."""
    counts: dict[str, Any] = {
        f"le_{i}": Count("id", filter=Q(**{f"{field}__lte": ms})) for i, ms in enumerate(bounds_ms)
    }
    counts["observed"] = Count(field)  # COUNT(column) skips NULLs: rows with no value are not observed
    counts["observed_sum"] = Sum(field)
    return counts


def _empty_histogram_row(bounds_ms: Sequence[int]) -> dict[str, Any]:
    return {**{f"le_{i}": 0 for i in range(len(bounds_ms))}, "observed": 0, "observed_sum": None}


class DatabaseCollector(Collector):
    """Every gpuplane metric, read from the database (and the broker) when scraped."""

    def collect(self) -> Iterable[Metric]:
        yield from self.pass_metrics()
        yield from self.answer_metrics()
        yield from self.device_metrics()
        yield from self.lending_metrics()
        yield from queue_metrics()
        yield from self.sync_metrics()

    def sync_metrics(self) -> Iterator[Metric]:
        """Cluster mode: how fresh the mirror is, per kind (rows written by ``sync_cluster``)."""
        rows = list(models.SyncStatus.objects.all())
        if not rows:
            return
        lag = GaugeMetricFamily(
            "gpuplane_sync_lag_seconds",
            "Last batch of watch events' lag, first event's receipt to the rows committed, per kind.",
            labels=["kind"],
        )
        events = CounterMetricFamily("gpuplane_sync_events", "Watch events applied to the mirror.", labels=["kind"])
        relists = CounterMetricFamily("gpuplane_sync_relists", "Full lists of a kind.", labels=["kind"])
        gone = CounterMetricFamily("gpuplane_sync_gone", "Watches that expired with 410 Gone.", labels=["kind"])
        errors = CounterMetricFamily("gpuplane_sync_errors", "Failed lists or watches.", labels=["kind"])
        listed = GaugeMetricFamily("gpuplane_sync_listed_objects", "Objects in the last list.", labels=["kind"])
        invalid = CounterMetricFamily(
            "gpuplane_sync_invalid", "Objects refused because they do not parse (listed or watched).", labels=["kind"]
        )
        stale = CounterMetricFamily(
            "gpuplane_sync_stale",
            "Watch events and listed objects ignored as older than their mirror row (the binder's own write).",
            labels=["kind"],
        )
        for row in rows:
            invalid.add_metric([row.kind], row.invalid)
            stale.add_metric([row.kind], row.stale)
            if row.lag_seconds is not None:
                lag.add_metric([row.kind], row.lag_seconds)
            events.add_metric([row.kind], row.events)
            relists.add_metric([row.kind], row.relists)
            gone.add_metric([row.kind], row.gone)
            errors.add_metric([row.kind], row.errors)
            listed.add_metric([row.kind], row.listed)
        yield from (lag, events, relists, gone, errors, listed, invalid, stale)
        yield parse_error_metric()

    def pass_metrics(self) -> Iterator[Metric]:
        """Passes, their set outcomes and their duration: one GROUP BY kind query."""
        rows: dict[str, Mapping[str, Any]] = {
            row["kind"]: row
            for row in models.PassRun.objects.order_by()
            .values("kind")
            .annotate(
                passes=Count("id"),
                **{f"sum_{o}": Sum(o) for o in OUTCOMES},
                **_bucket_counts("duration_ms", PASS_BUCKETS_MS),
                mismatches=Sum("verify_mismatches"),
                made_room=Sum("made_room"),
                room_refused=Sum("room_refused"),
            )
        }
        mismatches = CounterMetricFamily(
            "gpuplane_verify_mismatches",
            "Differences a verification found between the worker's incremental view and pass and a "
            "rebuild from scratch; anything above 0 is a bug, logged with the objects.",
        )
        mismatches.add_metric([], sum(row.get("mismatches") or 0 for row in rows.values()))
        passes = CounterMetricFamily(
            "gpuplane_passes", "Binder passes run (committed), by kind (full or answer).", labels=["kind"]
        )
        outcomes = CounterMetricFamily(
            "gpuplane_pass_outcomes",
            "Sets handled by binder passes, by pass kind and outcome: bound, moved, lost, restored; "
            "refused counts each set a pass left unplaced (Pending or Lost), again in every pass that leaves it.",
            labels=["kind", "outcome"],
        )
        duration = HistogramMetricFamily(
            "gpuplane_pass_duration_seconds",
            "How long binder passes took (lock wait, read, decide and write), by kind.",
            labels=["kind"],
        )
        for kind in sorted(set(KINDS) | set(rows)):
            row = rows.get(kind) or {"passes": 0, **_empty_histogram_row(PASS_BUCKETS_MS)}
            passes.add_metric([kind], row["passes"])
            for outcome in OUTCOMES:
                outcomes.add_metric([kind, outcome], row.get(f"sum_{outcome}") or 0)
            duration.add_metric([kind], _buckets(row, PASS_BUCKETS_MS), (row["observed_sum"] or 0) / 1000)
        made_room = CounterMetricFamily(
            "gpuplane_room_moves",
            "Sets of stopped VMs a full pass moved to another node to make room for a waiting set "
            "(SPEC 4 Making room; also counted as moved in gpuplane_pass_outcomes).",
        )
        made_room.add_metric([], sum(row.get("made_room") or 0 for row in rows.values()))
        room_refused = CounterMetricFamily(
            "gpuplane_room_plans_refused",
            "Waiting sets whose plan to make room would have moved more sets than GPUPLANE_MOVES_PER_PASS "
            "left in the pass, so no room was made for them in it (counted again in every such pass).",
        )
        room_refused.add_metric([], sum(row.get("room_refused") or 0 for row in rows.values()))
        yield passes
        yield outcomes
        yield duration
        yield mismatches
        yield made_room
        yield room_refused

    def answer_metrics(self) -> Iterator[Metric]:
        """Answered bind requests and how long the webhook waited: one GROUP BY allowed query."""
        rows = {
            row["allowed"]: row
            for row in models.BindAnswer.objects.order_by()
            .values("allowed")
            .annotate(answers=Count("id"), **_bucket_counts("latency_ms", ANSWER_BUCKETS_MS))
        }
        answers = CounterMetricFamily(
            "gpuplane_bind_answers",
            "Bind requests the binder answered, by whether it allowed the VMI (true) or refused it (false).",
            labels=["allowed"],
        )
        latency = HistogramMetricFamily(
            "gpuplane_bind_answer_latency_seconds",
            "From the webhook writing a bind request to the binder answering it, by allowed; "
            "answers whose request time is unknown are not observed.",
            labels=["allowed"],
        )
        for allowed in (False, True):
            row: Mapping[str, Any] = rows.get(allowed) or {"answers": 0, **_empty_histogram_row(ANSWER_BUCKETS_MS)}
            label = "true" if allowed else "false"
            answers.add_metric([label], row["answers"])
            latency.add_metric([label], _buckets(row, ANSWER_BUCKETS_MS), (row["observed_sum"] or 0) / 1000)
        yield answers
        yield latency

    def device_metrics(self) -> Iterator[Metric]:
        """Devices by phase and class, and Lost sets: three COUNT queries."""
        # A held device counts under the class it is held as: status_class_name (empty while
        # Pending) for a device with alternatives; spec.className for one without.
        held_as = Case(
            When(alternative_class_names=[], then=F("class_name")),
            default=Coalesce(NullIf(F("status_class_name"), Value("")), F("class_name")),
        )
        counts = {
            (row["phase"], row["held_as"]): row["n"]
            for row in models.GpuDevice.objects.order_by()
            .annotate(held_as=held_as)
            .values("phase", "held_as")
            .annotate(n=Count("id"))
        }
        existing = sorted(models.GpuClass.objects.order_by().values_list("name", flat=True))
        lost_sets = (
            models.GpuDevice.objects.order_by()
            .filter(phase=models.Phase.LOST)
            .values("namespace_id", "vm_name")
            .distinct()
            .count()
        )
        phases = sorted(set(PHASES) | {p for p, _ in counts})
        by_phase = GaugeMetricFamily("gpuplane_devices", "GPU devices by phase.", labels=["phase"])
        for phase in phases:
            by_phase.add_metric([phase], sum(n for (p, _), n in counts.items() if p == phase))
        by_class = GaugeMetricFamily(
            "gpuplane_class_devices",
            f"GPU devices by class and phase. Devices naming a class that does not exist count under "
            f'class="{NO_SUCH_CLASS}"; past {MAX_CLASS_LABELS} classes the rest count under '
            f'class="{OTHER_CLASSES}"; names are cut to {MAX_LABEL_LENGTH} characters.',
            labels=["class", "phase"],
        )
        for label, per_phase in class_series(existing, counts).items():
            for phase in phases:
                by_class.add_metric([label, phase], per_phase.get(phase, 0))
        yield by_phase
        yield by_class
        yield GaugeMetricFamily(
            "gpuplane_lost_sets", "Sets (namespace, VM) with at least one Lost device.", value=lost_sets
        )

    def lending_metrics(self) -> Iterator[Metric]:
        """Borrowed units per class and tenant (the budgets' ``status.borrowed``, which every
        full pass writes), sets marked for reclaim and how long the oldest set a mark is for
        has waited: two queries, a third while some mark exists."""
        borrowed = GaugeMetricFamily(
            "gpuplane_borrowed_units",
            "Units held by borrowed sets (lent beyond the tenant's limit on idle GPUs), by class and tenant.",
            labels=["class", "namespace"],
        )
        per_tenant: dict[str, Mapping[str, int]] = {}
        for namespace, lent in models.GpuBudget.objects.order_by("namespace__name", "name").values_list(
            "namespace__name", "borrowed"
        ):
            per_tenant.setdefault(namespace, lent or {})  # every budget of a namespace holds the same
        for namespace, lent in sorted(per_tenant.items()):
            for key, units in sorted(lent.items()):
                if "/" not in key:
                    borrowed.add_metric([key[:MAX_LABEL_LENGTH], namespace], units)
        yield borrowed
        marked = set(
            models.GpuDevice.objects.order_by()
            .exclude(reclaim_for="")
            .values_list("namespace_id", "vm_name", "reclaim_for")
        )
        yield GaugeMetricFamily(
            "gpuplane_reclaim_marks",
            "Borrowed sets marked for reclaim: a waiting set wants their GPUs back once their VM stops.",
            value=len({(ns, vm) for ns, vm, _ in marked}),
        )
        oldest = None
        targets = Q()
        for mark in {m for _, _, m in marked}:
            namespace, _, vm = mark.partition("/")
            targets |= Q(namespace__name=namespace, vm_name=vm)
        if marked:
            for phase, since, created in models.GpuDevice.objects.filter(targets).values_list(
                "phase", "since", "created"
            ):
                began = since if phase == models.Phase.LOST else created
                if began is not None and (oldest is None or began < oldest):
                    oldest = began
        waited = GaugeMetricFamily(
            "gpuplane_reclaim_mark_oldest_wait_seconds",
            "How long the longest-waiting set a reclaim mark is for has waited (since its order was created, "
            "or it went Lost); 0 with no mark.",
        )
        waited.add_metric([], (timezone.now() - oldest).total_seconds() if oldest is not None else 0.0)
        yield waited


#: Bounds on ``gpuplane_class_devices``' class label. Tenants choose the class names their
#: GPUs name (a name per object makes a series per object), and staff's names are capped
#: too: Prometheus keeps every series it has seen.
MAX_CLASS_LABELS = 100
MAX_LABEL_LENGTH = 63
NO_SUCH_CLASS = "(no such class)"
OTHER_CLASSES = "(other classes)"


def class_series(existing: Sequence[str], counts: Mapping[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """Device counts per bounded class label and phase: the first MAX_CLASS_LABELS existing
    classes by name (cut to MAX_LABEL_LENGTH), then one label for the other existing
    classes and one for the names no class has."""
    labels = {name: name[:MAX_LABEL_LENGTH] for name in existing[:MAX_CLASS_LABELS]}
    labels.update({name: OTHER_CLASSES for name in existing[MAX_CLASS_LABELS:]})
    series: dict[str, dict[str, int]] = {label: {} for label in labels.values()}
    for (phase, name), n in counts.items():
        per_phase = series.setdefault(labels.get(name, NO_SUCH_CLASS), {})
        per_phase[phase] = per_phase.get(phase, 0) + n
    return dict(sorted(series.items()))


def parse_error_metric() -> Metric:
    """Mirror rows whose object stopped parsing, per kind (they keep their last good state):
    one COUNT query per mirrored kind, cluster mode only (a snapshot refuses bad objects whole)."""
    family = GaugeMetricFamily(
        "gpuplane_mirror_parse_errors",
        "Mirror rows whose object in the cluster stopped parsing (kept in their last good state), by kind.",
        labels=["kind"],
    )
    for kind, model in MODELS.items():
        family.add_metric([kind], model.objects.exclude(parse_error="").count())
    return family


# -- the broker ---------------------------------------------------------------------------------

_clients: dict[str, Any] = {}


def redis_url(broker_url: str | None) -> str | None:
    """The redis-py URL of a Redis broker URL (the first of a failover list), else None."""
    if not broker_url:
        return None
    first = broker_url.split(";")[0].strip()
    scheme = urlsplit(first).scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        return first
    if scheme == "redis+socket":
        return "unix" + first[len("redis+socket") :]
    return None


def queue_keys(queue: str, transport_options: Mapping[str, Any]) -> list[str]:
    """The Redis lists kombu's Redis transport keeps ``queue`` in, one per priority step.

    kombu (``kombu.transport.redis.Channel._q_for_pri``) stores priority step 0 in the
    list named after the queue and every other step ``s`` in ``<queue><sep><s>``; its
    defaults are ``sep = "\\x06\\x16"`` and steps ``[0, 3, 6, 9]``, the project's transport
    options (settings.CELERY_BROKER_TRANSPORT_OPTIONS) make them ``":"`` and ``[0, 9]``:
    lists ``binder`` and ``binder:9``. ``global_keyprefix`` prefixes every key.
    """
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    steps = transport_options.get("priority_steps") or PRIORITY_STEPS
    sep = transport_options.get("sep") or Channel.sep
    prefix = transport_options.get("global_keyprefix") or ""
    names = [f"{queue}{sep}{step}" if step else queue for step in steps]
    return [prefix + name for name in dict.fromkeys(names)]


def _redis_client(url: str) -> Any:
    client = _clients.get(url)
    if client is None:
        client = redis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS
        )
        _clients[url] = client
    return client


def queue_metrics() -> Iterator[Metric]:
    """Passes waiting in the broker and the collapse flags (binder.queue.COLLAPSE_KEY).

    No broker (tasks run in-process): nothing can wait, all are 0. A Redis broker: the
    lengths of the binder queue's lists and whether each kind's collapse key exists, in
    one round trip; if Redis does not answer, ``gpuplane_broker_up`` is 0 and the queue
    metrics are left out rather than reported as 0. Any other broker: left out.
    """
    queued = GaugeMetricFamily(
        "gpuplane_queued_passes", "Binder passes waiting in the broker's binder queue (all priorities)."
    )
    flags = GaugeMetricFamily(
        "gpuplane_pass_queued",
        "1 while a pass of this kind is queued (its collapse key "
        + COLLAPSE_KEY.format(kind="<kind>")
        + " exists in Redis): more events queue nothing more.",
        labels=["kind"],
    )
    broker_url = getattr(settings, "CELERY_BROKER_URL", None)
    if not broker_url or getattr(settings, "CELERY_TASK_ALWAYS_EAGER", False):
        queued.add_metric([], 0)
        for kind in KINDS:
            flags.add_metric([kind], 0)
        yield queued
        yield flags
        return
    url = redis_url(broker_url)
    if url is None:
        return
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None) or {}
    keys = queue_keys(BINDER_QUEUE, options)
    up = GaugeMetricFamily("gpuplane_broker_up", "1 if the Redis broker answered this scrape, else 0.")
    try:
        with _redis_client(url).pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.llen(key)
            for kind in KINDS:
                pipe.exists(collapse_key(kind))
            replies = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        log.warning("metrics: cannot read the binder queue from the broker: %s", exc)
        up.add_metric([], 0)
        yield up
        return
    up.add_metric([], 1)
    queued.add_metric([], sum(int(n) for n in replies[: len(keys)]))
    for kind, exists in zip(KINDS, replies[len(keys) :], strict=True):
        flags.add_metric([kind], 1 if exists else 0)
    yield up
    yield queued
    yield flags


class ReadModelCollector(Collector):
    """The read model of the web process that answered the scrape (``binder.runtime.readmodel``).

    The one exception to "the database is the truth": the model lives in each web
    process's memory, so these series describe the process that answered (labelled with
    its reader name). A verification mismatch is also logged at ERROR with the objects,
    so it is never only in the memory of a process that was not scraped.
    """

    def collect(self) -> Iterable[Metric]:
        model = readmodel.MODEL
        counters = model.counters
        labels = ["process"]
        value = [model.worker]
        families = [
            (
                CounterMetricFamily,
                "gpuplane_readmodel_verify_mismatches",
                "Differences a verification found between this web process's read model and a read "
                "from scratch; anything above 0 is a bug, logged with the objects.",
                counters.mismatches,
            ),
            (
                CounterMetricFamily,
                "gpuplane_readmodel_verifications",
                "Verifications of this web process's read model.",
                counters.verifications,
            ),
            (
                CounterMetricFamily,
                "gpuplane_readmodel_rebuilds",
                "Times this web process read the whole mirror into its read model.",
                counters.rebuilds,
            ),
            (
                CounterMetricFamily,
                "gpuplane_readmodel_follows",
                "Follows of the change feed by this web process's read model.",
                counters.follows,
            ),
            (
                GaugeMetricFamily,
                "gpuplane_readmodel_build_seconds",
                "How long this web process's last full read of the mirror took.",
                counters.build_seconds,
            ),
            (
                GaugeMetricFamily,
                "gpuplane_readmodel_ready",
                "1 once the read model is built.",
                int(model.built.is_set()),
            ),
        ]
        for family, name, documentation, number in families:
            metric = family(name, documentation, labels=labels)
            metric.add_metric(value, number)
            yield metric


#: The registry /metrics serves: the database collector (a process's own counters would
#: describe whichever gunicorn process happened to answer), plus the answering process's
#: read model.
REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(DatabaseCollector())
REGISTRY.register(ReadModelCollector())


def _authorized(request: HttpRequest, token: str) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text format; with GPUPLANE_METRICS_TOKEN set, only for ``Bearer <token>``."""
    token = getattr(settings, "GPUPLANE_METRICS_TOKEN", "")
    if (token and not _authorized(request, token)) or (not token and not settings.GPUPLANE_METRICS_OPEN):
        text = (
            "a bearer token is required\n"
            if token
            else "/metrics needs GPUPLANE_METRICS_TOKEN in cluster mode (or GPUPLANE_METRICS_OPEN=true)\n"
        )
        response = HttpResponse(text, status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="gpuplane metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)

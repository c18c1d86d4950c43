"""The webhook server's own metrics: every call by outcome and how long it took.

Served by the webhook server's metrics port (``deploy/webhook_server.py``,
``GPUPLANE_WEBHOOK_METRICS_BIND``), not by the API's ``/metrics``: that one is derived from the
database, whichever gunicorn process answers, while these are counted where each call is
decided. The webhook server runs several processes, so with ``PROMETHEUS_MULTIPROC_DIR`` set
(the server sets it before its workers start) each process writes its counts to files there
and the metrics port adds them up (prometheus_client's multiprocess mode); without it they are
this process's own (the tests, ``make serve-webhook``).

Outcomes: ``allowed`` (untouched: the VMI names no gpuplane device, or nothing to change),
``patched`` (allowed with the pin), ``denied`` (the webhook refused the VMI: its devices, its
budget, the binder's refusal, "try again"), ``error`` (denied because the database failed under
the call), ``bad_request`` (400 or 413: a malformed or oversized review), ``unauthorized``
(401, or 404 where the webhook is off: a caller that is not the apiserver), and ``shed`` (denied
"try again" from the event loop at the call limit, ``GPUPLANE_WEBHOOK_SHED``).
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

OUTCOMES = ("allowed", "patched", "denied", "error", "bad_request", "unauthorized", "shed")
#: Seconds: a Bound call takes about a millisecond; a new order waits for the binder up to 8 s.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 8.0, 10.0)

REVIEWS = Counter(
    "gpuplane_webhook_reviews",
    "AdmissionReview calls the webhook server answered, by outcome.",
    ["outcome"],
)
LATENCY = Histogram(
    "gpuplane_webhook_review_seconds",
    "From a call's arrival to its answer, by outcome.",
    ["outcome"],
    buckets=BUCKETS,
)
for _outcome in OUTCOMES:  # every series exists from the start: rate() and the alerts see zeros
    REVIEWS.labels(_outcome)
    LATENCY.labels(_outcome)


def observe(outcome: str, started: float) -> None:
    """Count one answered call (``started``: its arrival, ``time.monotonic()``)."""
    REVIEWS.labels(outcome).inc()
    LATENCY.labels(outcome).observe(max(0.0, time.monotonic() - started))


def outcome_of_status(status: int) -> str:
    """The outcome of a call answered before a decision, by its HTTP status."""
    return "unauthorized" if status in (401, 404) else "bad_request"

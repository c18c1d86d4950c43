"""GET /metrics: every value derived from the database (and the broker) at scrape time."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.test import Client
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from binder import models
from binder.metrics import queue_keys, redis_url
from binder.mirror.snapshot import load_objects
from binder.queue import PRIORITY, collapse_key
from binder.runtime.passes import run_pass
from harness.shapes import A10, H100, class_obj, gpu_obj, node_obj

pytestmark = pytest.mark.django_db

A100_NOWHERE = "nvidia.com/GA100_NOWHERE"  # a resource no node offers
#: Redis for the broker tests: a database of its own, and a key prefix per test.
TEST_REDIS_URL = os.environ.get("GPUPLANE_TEST_METRICS_REDIS_URL", "redis://127.0.0.1:6379/15")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: Client, **headers: str) -> Samples:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    samples: Samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        assert family.documentation, family.name  # every metric has HELP text
        assert family.name.startswith("gpuplane_"), family.name
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, key
            samples[key] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def buckets(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    """``le`` -> cumulative count of histogram ``name`` with ``labels``."""
    found = {}
    for (sample, sample_labels), count in samples.items():
        as_dict = dict(sample_labels)
        le = as_dict.pop("le", None)
        if sample == f"{name}_bucket" and as_dict == labels:
            found[le] = count
    return found


def cluster() -> list[dict[str, Any]]:
    """Three sets to bind, one to move, one to lose, two that cannot be placed, one already Lost."""
    return [
        class_obj("h100", H100),
        class_obj("a10", A10),
        class_obj("a100", A100_NOWHERE),
        node_obj("n1", {H100: 2}),
        node_obj("n-bad", {H100: 4}, ready=False, transition="2026-01-01T00:00:00Z"),
        node_obj("n-a10", {A10: 2}),
        node_obj("n-drain", {A10: 2}, labels={"gpuplane.io/drain": "true"}),
        # held on a node NotReady for months, 3 GPUs, only 2 free elsewhere: goes Lost
        *[gpu_obj("t1", f"l{i}", "h100", "vm-lost", phase="Bound", node="n-bad") for i in range(3)],
        # already Lost, its class on no node: stays Lost (same VM name, other tenant: another set)
        gpu_obj("t2", "l0", "a100", "vm-lost", phase="Lost"),
        # new orders: bound onto n1; then no room left for vm-b
        gpu_obj("t2", "a0", "h100", "vm-a", created="2026-11-20T10:00:00Z"),
        gpu_obj("t2", "a1", "h100", "vm-a", created="2026-11-20T10:00:00Z"),
        gpu_obj("t2", "b0", "h100", "vm-b", created="2026-11-21T10:00:00Z"),
        # a10: one set moved off the drained node, one new order, one of a class that does not exist
        gpu_obj("t3", "m0", "a10", "vm-m", phase="Bound", node="n-drain"),
        gpu_obj("t3", "c0", "a10", "vm-c"),
        gpu_obj("t3", "d0", "nope", "vm-d"),
    ]


@pytest.fixture
def placed() -> dict[str, models.PassRun]:
    """The cluster after a full pass, an answer pass (one allowed, one refused) and a full pass,
    with durations and latencies set to known values."""
    load_objects(cluster())
    first = run_pass(models.PassKind.FULL)
    assert (first.bound, first.moved, first.lost) == (2, 1, 1)

    load_objects(
        [
            node_obj("n-new", {A10: 1}),
            gpu_obj("t4", "e0", "a10", "vm-e", bind_request="req-e"),
            gpu_obj("t2", "b0", "h100", "vm-b", created="2026-11-21T10:00:00Z", bind_request="req-b"),
        ]
    )
    answer = run_pass(models.PassKind.ANSWER)
    assert (answer.bound, answer.moved, answer.lost) == (1, 0, 0)
    assert dict(models.BindAnswer.objects.values_list("device_name", "allowed")) == {"e0": True, "b0": False}

    second = run_pass(models.PassKind.FULL)
    assert (second.bound, second.moved, second.lost) == (0, 0, 0)

    # Known durations, one exactly on a bucket bound (le is inclusive), one past the last bucket.
    models.PassRun.objects.filter(pk=first.pk).update(duration_ms=3.0)
    models.PassRun.objects.filter(pk=second.pk).update(duration_ms=250.0)
    models.PassRun.objects.filter(pk=answer.pk).update(duration_ms=7.5)
    now = first.started
    models.PassRun.objects.create(kind="full", started=now, duration_ms=45_000.0, bound=0)
    # Known latencies: the two real answers and three more; one with no request time.
    models.BindAnswer.objects.filter(device_name="e0").update(latency_ms=4.0)
    models.BindAnswer.objects.filter(device_name="b0").update(latency_ms=30.0)
    for allowed, latency in ((True, 1000.0), (True, 9000.0), (False, None)):
        models.BindAnswer.objects.create(
            pass_run=answer,
            namespace="t9",
            device_name="x",
            request=uuid.uuid4().hex,
            allowed=allowed,
            answer="bound:n1" if allowed else "refused: test",
            answered_at=now,
            latency_ms=latency,
        )
    return {"first": first, "answer": answer, "second": second}


def test_pass_counters_sum_the_pass_history(client: Client, placed: dict[str, models.PassRun]) -> None:
    samples = scrape(client)
    assert value(samples, "gpuplane_passes_total", kind="full") == 3
    assert value(samples, "gpuplane_passes_total", kind="answer") == 1

    def outcome(kind: str, name: str) -> float:
        return value(samples, "gpuplane_pass_outcomes_total", kind=kind, outcome=name)

    # bound: vm-a and vm-c in the first full pass, vm-e by the answer pass
    assert (outcome("full", "bound"), outcome("answer", "bound")) == (2, 1)
    assert (outcome("full", "moved"), outcome("answer", "moved")) == (1, 0)  # vm-m off the drained node
    assert (outcome("full", "lost"), outcome("answer", "lost")) == (1, 0)  # t1/vm-lost
    assert (outcome("full", "restored"), outcome("answer", "restored")) == (0, 0)
    runs = placed.values()
    for kind in ("full", "answer"):
        for name in ("bound", "moved", "lost", "refused", "restored"):
            assert outcome(kind, name) == sum(getattr(r, name) for r in runs if r.kind == kind), (kind, name)
    assert outcome("full", "refused") == placed["first"].refused + placed["second"].refused > 0
    assert outcome("answer", "refused") == 1  # vm-b had no room


def test_pass_duration_histogram(client: Client, placed: dict[str, models.PassRun]) -> None:
    samples = scrape(client)
    full = buckets(samples, "gpuplane_pass_duration_seconds", kind="full")  # 3 ms, 250 ms, 45 s
    assert full == {
        "0.005": 1,
        "0.01": 1,
        "0.025": 1,
        "0.05": 1,
        "0.1": 1,
        "0.25": 2,
        "0.5": 2,
        "1.0": 2,
        "2.5": 2,
        "5.0": 2,
        "10.0": 2,
        "20.0": 2,
        "30.0": 2,
        "+Inf": 3,
    }
    assert value(samples, "gpuplane_pass_duration_seconds_count", kind="full") == 3
    assert value(samples, "gpuplane_pass_duration_seconds_sum", kind="full") == pytest.approx(45.253)
    answer = buckets(samples, "gpuplane_pass_duration_seconds", kind="answer")  # 7.5 ms
    assert answer["0.005"] == 0
    assert answer["0.01"] == answer["30.0"] == answer["+Inf"] == 1
    assert value(samples, "gpuplane_pass_duration_seconds_count", kind="answer") == 1
    assert value(samples, "gpuplane_pass_duration_seconds_sum", kind="answer") == pytest.approx(0.0075)


def test_devices_by_phase_and_class_and_lost_sets(client: Client, placed: dict[str, models.PassRun]) -> None:
    samples = scrape(client)
    assert {phase: value(samples, "gpuplane_devices", phase=phase) for phase in ("Pending", "Bound", "Lost")} == {
        "Pending": 2,  # t2/b0 (no room), t3/d0 (class nope does not exist)
        "Bound": 5,  # t2/a0 a1, t3/m0 c0, t4/e0
        "Lost": 4,  # t1/l0-l2, t2/l0
    }
    by_class = {
        (dict(labels)["class"], dict(labels)["phase"]): n
        for (name, labels), n in samples.items()
        if name == "gpuplane_class_devices"
    }
    assert by_class == {
        ("a10", "Bound"): 3,
        ("a10", "Lost"): 0,
        ("a10", "Pending"): 0,
        ("a100", "Bound"): 0,
        ("a100", "Lost"): 1,
        ("a100", "Pending"): 0,
        ("h100", "Bound"): 2,
        ("h100", "Lost"): 3,
        ("h100", "Pending"): 1,
        # a class no GPUClass has (tenants choose these names): one bounded label for all of them
        ("(no such class)", "Bound"): 0,
        ("(no such class)", "Lost"): 0,
        ("(no such class)", "Pending"): 1,
    }
    # t1/vm-lost (three devices) and t2/vm-lost: two sets, not four devices nor one VM name
    assert value(samples, "gpuplane_lost_sets") == 2


def test_bind_answer_latency_histogram(client: Client, placed: dict[str, models.PassRun]) -> None:
    samples = scrape(client)
    assert value(samples, "gpuplane_bind_answers_total", allowed="true") == 3
    assert value(samples, "gpuplane_bind_answers_total", allowed="false") == 2
    allowed = buckets(samples, "gpuplane_bind_answer_latency_seconds", allowed="true")  # 4 ms, 1 s, 9 s
    assert allowed == {
        "0.005": 1,
        "0.01": 1,
        "0.025": 1,
        "0.05": 1,
        "0.1": 1,
        "0.25": 1,
        "0.5": 1,
        "1.0": 2,
        "2.5": 2,
        "5.0": 2,
        "8.0": 2,
        "10.0": 3,
        "+Inf": 3,
    }
    assert value(samples, "gpuplane_bind_answer_latency_seconds_count", allowed="true") == 3
    assert value(samples, "gpuplane_bind_answer_latency_seconds_sum", allowed="true") == pytest.approx(10.004)
    refused = buckets(samples, "gpuplane_bind_answer_latency_seconds", allowed="false")  # 30 ms; one unknown
    assert (refused["0.025"], refused["0.05"], refused["+Inf"]) == (0, 1, 1)
    assert value(samples, "gpuplane_bind_answer_latency_seconds_count", allowed="false") == 1
    assert value(samples, "gpuplane_bind_answer_latency_seconds_sum", allowed="false") == pytest.approx(0.03)


def test_an_empty_database_exports_every_series_at_zero(client: Client) -> None:
    samples = scrape(client)
    for kind in ("full", "answer"):
        assert value(samples, "gpuplane_passes_total", kind=kind) == 0
        assert value(samples, "gpuplane_pass_outcomes_total", kind=kind, outcome="bound") == 0
        assert value(samples, "gpuplane_pass_duration_seconds_count", kind=kind) == 0
        assert set(buckets(samples, "gpuplane_pass_duration_seconds", kind=kind).values()) == {0}
    for allowed in ("true", "false"):
        assert value(samples, "gpuplane_bind_answer_latency_seconds_count", allowed=allowed) == 0
    for phase in ("Pending", "Bound", "Lost"):
        assert value(samples, "gpuplane_devices", phase=phase) == 0
    assert value(samples, "gpuplane_lost_sets") == 0
    # no broker: tasks run in-process, nothing can wait
    assert value(samples, "gpuplane_queued_passes") == 0
    assert value(samples, "gpuplane_pass_queued", kind="full") == 0
    assert value(samples, "gpuplane_pass_queued", kind="answer") == 0
    assert not any(name == "gpuplane_broker_up" for name, _ in samples)


def test_a_scrape_is_a_handful_of_queries(
    client: Client, placed: dict[str, models.PassRun], django_assert_max_num_queries: Any
) -> None:
    # passes, answers, devices (2), queue, sync status; lending: budgets' borrowed units, marks
    with django_assert_max_num_queries(8):
        scrape(client)


# -- access ------------------------------------------------------------------------------------


def test_open_without_a_token(client: Client, settings: Any) -> None:
    settings.GPUPLANE_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 200
    assert client.post("/metrics").status_code == 405


def test_token_required_when_set(client: Client, settings: Any) -> None:
    settings.GPUPLANE_METRICS_TOKEN = "s3cret-token"
    missing = client.get("/metrics")
    assert missing.status_code == 401
    assert missing["WWW-Authenticate"].startswith("Bearer")
    assert b"gpuplane_" not in missing.content
    for header in ("Bearer wrong", "Basic s3cret-token", "s3cret-token", "Bearer", "Bearer s3cret-tokenX"):
        assert client.get("/metrics", headers={"Authorization": header}).status_code == 401, header
    assert client.get("/metrics", headers={"Authorization": "Bearer \u00e9"}).status_code == 401
    ok = scrape(client, Authorization="Bearer s3cret-token")
    assert value(ok, "gpuplane_lost_sets") == 0
    assert client.get("/metrics", headers={"Authorization": "bearer s3cret-token"}).status_code == 200


# -- the broker --------------------------------------------------------------------------------


def kombu_keys(queue: str, options: dict[str, Any]) -> list[str]:
    """The lists kombu's own Redis channel reads for ``queue`` (as its ``_size`` does)."""
    from kombu.transport.redis import Channel

    channel = Channel.__new__(Channel)  # only the key naming is used: no connection
    for option in ("priority_steps", "sep"):
        if option in options:
            setattr(channel, option, options[option])
    prefix = options.get("global_keyprefix", "")
    return [prefix + channel._q_for_pri(queue, p) for p in channel.priority_steps]


def test_queue_keys_follow_kombu_redis_transport(settings: Any) -> None:
    # kombu's defaults
    assert queue_keys("binder", {}) == ["binder", "binder\x06\x163", "binder\x06\x166", "binder\x06\x169"]
    assert queue_keys("binder", {}) == kombu_keys("binder", {})
    # the project's transport options, and a key prefix
    options = dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    assert queue_keys("binder", options) == kombu_keys("binder", options)
    options["global_keyprefix"] = "pfx:"
    assert queue_keys("binder", options) == kombu_keys("binder", options)
    assert queue_keys("binder", {"priority_steps": [0, 5], "sep": ":"}) == ["binder", "binder:5"]


def test_redis_url() -> None:
    assert redis_url(None) is None
    assert redis_url("redis://:pw@redis:6379/2") == "redis://:pw@redis:6379/2"
    assert redis_url("rediss://redis:6380/0;redis://other:6379/0") == "rediss://redis:6380/0"
    assert redis_url("redis+socket:///run/redis.sock") == "unix:///run/redis.sock"
    assert redis_url("amqp://guest@rabbit//") is None
    assert redis_url("sentinel://s1:26379") is None


def collapse_keys() -> list[str]:
    return [collapse_key(kind) for kind in ("full", "answer")]


@pytest.fixture
def broker(settings: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """A Redis broker for the metrics: a test database, the project's transport options
    and a key prefix of this test's own for the queue lists."""
    client = redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {TEST_REDIS_URL} (set GPUPLANE_TEST_METRICS_REDIS_URL)")
    options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": f"gpuplane-test-{uuid.uuid4().hex}:"}
    settings.CELERY_BROKER_URL = TEST_REDIS_URL
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    client.delete(*collapse_keys())
    try:
        yield TEST_REDIS_URL, options
    finally:
        for key in client.scan_iter(match=f"{options['global_keyprefix']}*"):
            client.delete(key)
        client.delete(*collapse_keys())
        client.close()


def test_queued_passes_are_read_from_the_redis_broker(client: Client, broker: tuple[str, dict[str, Any]]) -> None:
    from kombu import Connection

    url, options = broker
    samples = scrape(client)
    assert value(samples, "gpuplane_broker_up") == 1
    assert value(samples, "gpuplane_queued_passes") == 0
    assert value(samples, "gpuplane_pass_queued", kind="full") == 0
    assert value(samples, "gpuplane_pass_queued", kind="answer") == 0

    # Publish as Celery does, through kombu's Redis transport with the project's options,
    # at the priorities binder.tasks uses: two full passes and one answer pass waiting.
    with Connection(url, transport_options=options) as connection:
        queue = connection.SimpleQueue("binder")
        for kind in ("full", "full", "answer"):
            queue.put({"task": f"binder.{kind}_pass"}, priority=PRIORITY[kind])
        queue.close()
    lists = redis.Redis.from_url(url)
    assert sum(lists.llen(key) for key in kombu_keys("binder", options)) == 3
    lists.set(collapse_key("full"), "1")  # under the prefix, like the queue lists
    samples = scrape(client)
    assert value(samples, "gpuplane_queued_passes") == 3
    assert value(samples, "gpuplane_pass_queued", kind="full") == 1
    assert value(samples, "gpuplane_pass_queued", kind="answer") == 0
    lists.close()


def test_an_unreachable_broker_is_reported_not_zeroed(client: Client, settings: Any) -> None:
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    settings.CELERY_TASK_ALWAYS_EAGER = False
    samples = scrape(client)
    assert value(samples, "gpuplane_broker_up") == 0
    assert not any(name in ("gpuplane_queued_passes", "gpuplane_pass_queued") for name, _ in samples)
    assert value(samples, "gpuplane_lost_sets") == 0  # the database metrics are still there


def test_a_broker_that_is_not_redis_exports_no_queue_length(client: Client, settings: Any) -> None:
    settings.CELERY_BROKER_URL = "amqp://guest@127.0.0.1:1//"
    settings.CELERY_TASK_ALWAYS_EAGER = False
    samples = scrape(client)
    assert not any(
        name.startswith(("gpuplane_queued", "gpuplane_pass_queued", "gpuplane_broker")) for name, _ in samples
    )

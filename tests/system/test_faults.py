"""Faults with real parts: what the webhook answers, and what the next passes restore.

Four faults, one test each, against the real parts of a deployment:

1. the worker is SIGKILLed mid-pass while a webhook burst waits for answers;
2. Redis (the broker: a ``redis-server`` of this test's own, on a free port) is restarted
   during a webhook burst;
3. PostgreSQL drops every connection of the database (the worker's, mid-pass, and the web
   server's) while a burst waits;
4. the real kube-apiserver refuses 30 % of gpuplane's writes at random (409, 500, 503; seeded)
   in cluster mode, through an admission webhook (harness/faults.py).

For each, every webhook answer must be an AdmissionReview (HTTP 200, never a 500): an
allow, or a denial with the binder's reason or a clear "try again", within
``GPUPLANE_BIND_WAIT_SECONDS`` plus a final read. Then passes must restore every
invariant (no node over-booked, every set whole, each Bound or Lost device exactly one
open usage record with its node and phase, none otherwise), and no usage record may be
lost or duplicated: every record from before the fault is still there (closed ones
unchanged, open ones changed only by being closed), no two records of one subject
overlap, and every record belongs to a pass that committed. The figures (answers by
kind, slowest answer against the wait, passes until the invariants held, records) are
printed per fault; docs/testing.md ("Faults") quotes them.

Tests 1-3 start real processes (gunicorn, ``celery worker``) and run on PostgreSQL
only, like ``tests/runtime/test_worker.py`` (the PostgreSQL run sets GPUPLANE_FORBID_SKIPS=1);
test 4 and the webhook's database-failure unit tests run on SQLite too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest
import redis
from django.conf import settings as django_settings
from django.db import OperationalError, connection
from django.test import Client
from django.utils import timezone
from redis.backoff import NoBackoff
from redis.retry import Retry

from binder import models, sync
from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from binder.tasks import resync_task
from gpuplane.celery import app as celery_app
from harness import workers
from harness.cluster_mode import GPUS, cluster_gpus, mirrored_devices
from harness.controlplane import ControlPlane
from harness.factories import new_vmi, review
from harness.faults import Kind
from harness.ports import free_port
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj
from harness.webhook_calls import answer_of, post
from usage.models import UsageRecord
from webhooks import binding, views

pytestmark = pytest.mark.django_db(transaction=True)

#: GPUPLANE_BIND_WAIT_SECONDS of the web servers under test (default 8, below the 10 s timeout).
WAIT = 2.0
#: What an answer may take beyond the wait: the final read and the HTTP round trip.
SLACK = 1.5
#: The API server's fault injection is seeded: the same seed fails the same writes.
#: GPUPLANE_FAULT_SEED=<n> runs that seed alone.
SEEDS = [int(os.environ["GPUPLANE_FAULT_SEED"])] if os.environ.get("GPUPLANE_FAULT_SEED") else [6, 1]

# The real parts (the ``server``, ``start_worker`` and ``apiserver`` fixtures) are those of
# tests/conftest.py and harness/workers.py, shared with tests/runtime/test_worker.py,
# tests/webhooks/test_webhook_race.py and tests/kube/test_cluster.py; ``broker`` is overridden below.


# -- fixtures: real parts ----------------------------------------------------------------------


@pytest.fixture
def real_parts() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("worker integration tests run on PostgreSQL (make test-postgres), as in production")


class OwnRedis:
    """A ``redis-server`` of this test's own (no persistence), so it can be stopped and started."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        # No retries: a stopped server must answer "down" at once (redis-py retries with backoff).
        self.client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
        )

    def alive(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def start(self) -> None:
        subprocess.run(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "yes", "--dir", str(self.workdir), "--pidfile", str(self.workdir / "redis.pid"),
             "--logfile", str(self.workdir / "redis.log")],
            check=True,
        )  # fmt: skip
        workers.wait_for(self.alive, timeout=10)

    def stop(self) -> None:
        """SHUTDOWN NOSAVE: the queue, unacked messages and collapse flags are gone, as in a crash."""
        with contextlib.suppress(redis.RedisError):
            self.client.shutdown(nosave=True)
        workers.wait_for(lambda: not self.alive(), timeout=10)


@pytest.fixture
def own_redis(real_parts: None, tmp_path: Path) -> Iterator[OwnRedis]:
    instance = OwnRedis(tmp_path)
    instance.start()
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture
def broker(
    request: pytest.FixtureRequest, real_parts: None, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[redis.Redis]:
    """The ``broker`` of tests/conftest.py with the Redis of ``own_redis`` when the test asks for it,
    and the short bind wait for the web server and this process."""
    url = request.getfixturevalue("own_redis").url if "own_redis" in request.fixturenames else workers.REDIS_URL
    monkeypatch.setattr(workers, "REDIS_URL", url)  # read by Worker and the gunicorn fixture
    monkeypatch.setenv("GPUPLANE_BIND_WAIT_SECONDS", str(WAIT))
    settings.GPUPLANE_BIND_WAIT_SECONDS = WAIT
    client = redis.Redis.from_url(url, socket_timeout=5)
    client.ping()  # no Redis is a failure here, not a skip
    workers.forget_keys(client)
    # Saved before the settings change: Celery reads its configuration from them lazily.
    conf = celery_app.conf
    saved = (conf.broker_url, conf.task_always_eager, conf.broker_transport_options)
    options = {**django_settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": workers.PREFIX}
    settings.CELERY_BROKER_URL = url
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    conf.broker_url, conf.task_always_eager, conf.broker_transport_options = url, False, options
    workers.reset_producer_pool()
    yield client
    conf.broker_url, conf.task_always_eager, conf.broker_transport_options = saved
    workers.reset_producer_pool()
    with contextlib.suppress(redis.RedisError):
        workers.forget_keys(client)


# -- webhook calls -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int  # HTTP status
    allowed: bool
    message: str
    seconds: float


#: Denial messages by what they say; a denial that matches none of these is not a clear one.
KINDS = (
    ("could not place its GPUs", "denied: no room (binder's reason)"),
    ("did not answer within", "denied: binder did not answer in time; try again"),
    ("could not run an answer pass", "denied: broker unavailable; try again"),
    ("database is unavailable", "denied: database unavailable; try again"),
    ("API server refused the bind request", "denied: API server refused the bind request; try again"),
    ("changed while it was checked", "denied: set changed; try again"),
)


def kind_of(answer: Answer) -> str:
    if answer.status != 200:
        return f"HTTP {answer.status}: {' '.join(answer.message.split())[:80]}"
    if answer.allowed:
        return "allowed"
    for needle, kind in KINDS:
        if needle in answer.message:
            return kind
    return f"denied, unclear: {answer.message}"


def call(url: str, body: dict[str, Any]) -> Answer:
    """One webhook call over HTTP, as the kube-apiserver makes it."""
    request = urllib.request.Request(  # noqa: S310 - loopback
        f"{url}/webhooks/vmi", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310 - loopback
            status, out = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, False, exc.read().decode(errors="replace"), time.monotonic() - started)
    seconds = time.monotonic() - started
    answer = out["response"]
    assert answer["uid"] == body["request"]["uid"]
    return Answer(status, answer["allowed"], (answer.get("status") or {}).get("message", ""), seconds)


class Burst:
    """Webhook calls started ``spread`` seconds apart in all, each on its own thread."""

    def __init__(self, url: str, bodies: list[dict[str, Any]], spread: float = 0.0) -> None:
        self.pool = ThreadPoolExecutor(max_workers=len(bodies))
        step = spread / max(1, len(bodies) - 1)
        self.futures: list[Future[Answer]] = [
            self.pool.submit(self._delayed, url, body, i * step) for i, body in enumerate(bodies)
        ]

    @staticmethod
    def _delayed(url: str, body: dict[str, Any], delay: float) -> Answer:
        time.sleep(delay)
        return call(url, body)

    def answers(self) -> list[Answer]:
        try:
            return [f.result(timeout=60) for f in self.futures]
        finally:
            self.pool.shutdown()


def bodies(vms: list[tuple[str, str, list[str]]]) -> list[dict[str, Any]]:
    """One VMI CREATE review per (namespace, VM, devices); a new request uid each time."""
    return [review(new_vmi(ns, vm, devices)) for ns, vm, devices in vms]


def check_answers(answers: list[Answer], wait: float) -> Counter[str]:
    """Every answer an AdmissionReview, a clear one, within the wait: the answers by kind."""
    kinds = Counter(kind_of(a) for a in answers)
    unclear = [k for k in kinds if not (k == "allowed" or k.startswith("denied: "))]
    assert not unclear, kinds
    slowest = max(a.seconds for a in answers)
    assert slowest <= wait + SLACK, f"an answer took {slowest:.2f}s, the wait is {wait}s"
    return kinds


# -- invariants and usage history --------------------------------------------------------------


HELD = (models.Phase.BOUND, models.Phase.LOST)


def violations() -> list[str]:
    """What breaks the invariants in the database (standalone mode: the truth; cluster mode: the
    mirror, which the cluster-mode test compares with the cluster).

    A set is whole when its held members (Bound or Lost) share one phase and node, as in
    the engine's property tests (harness/engine_invariants.py): Pending members may sit next
    to them, with a reason (new members that cannot grow on the set's node
    stay Pending); ``partly_pending`` lists those sets.
    """
    problems = []
    classes = {c.name: c for c in models.GpuClass.objects.all()}
    allocatable = {n.name: n.allocatable for n in models.Node.objects.all()}
    devices = list(
        models.GpuDevice.objects.values_list("namespace__name", "name", "vm_name", "class_name", "phase", "node")
    )
    booked: Counter[tuple[str, str]] = Counter()
    sets: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for ns, _, vm, class_name, phase, node in devices:
        if phase in HELD:
            sets[(ns, vm)].add((phase, node if phase == models.Phase.BOUND else ""))
        if phase == models.Phase.BOUND:
            gpu_class = classes[class_name]
            booked[(node, gpu_class.resource_name)] += gpu_class.units_per_device
    for (node, resource), units in sorted(booked.items()):
        have = int((allocatable.get(node) or {}).get(resource, 0))
        if units > have:
            problems.append(f"node {node} over-booked: {units} units of {resource} on {have}")
    problems += [f"set {ns}/{vm} not whole: {sorted(s)}" for (ns, vm), s in sorted(sets.items()) if len(s) > 1]
    open_records: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for ns, subject, phase, node in (
        UsageRecord.objects.open().filter(subject_kind="GPU").values_list("namespace", "subject", "phase", "node")
    ):
        open_records[(ns, subject)].append((phase, node))
    for ns, name, _, _, phase, node in devices:
        wanted = [(phase, node if phase == models.Phase.BOUND else "")] if phase in HELD else []
        found = open_records.pop((ns, name), [])
        if found != wanted:
            problems.append(f"device {ns}/{name} ({phase} {node}) has open usage records {found}, wanted {wanted}")
    problems += [f"open usage records of a device that is gone: {k} {v}" for k, v in sorted(open_records.items())]
    return problems


def partly_pending() -> list[str]:
    """Sets with held members and Pending ones next to them."""
    phases: dict[tuple[str, str], set[bool]] = defaultdict(set)
    for ns, vm, phase in models.GpuDevice.objects.values_list("namespace__name", "vm_name", "phase"):
        phases[(ns, vm)].add(phase in HELD)
    return sorted(f"{ns}/{vm}" for (ns, vm), held in phases.items() if held == {True, False})


def history() -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in UsageRecord.objects.values()}


@dataclass
class Ledger:
    """Usage records against those taken before the fault."""

    before: int
    after: int
    lost: list[int]
    changed: list[int]
    duplicated: list[tuple[int, int]]
    orphans: list[int]

    def __str__(self) -> str:
        return (
            f"usage records {self.before} before, {self.after} after; lost {len(self.lost)}, "
            f"changed {len(self.changed)}, duplicated {len(self.duplicated)}, "
            f"from no committed pass {len(self.orphans)}"
        )


def ledger(before: dict[int, dict[str, Any]]) -> Ledger:
    after = history()
    lost = sorted(set(before) - set(after))
    changed = []
    for pk, old in before.items():
        new = after.get(pk)
        if new is None:
            continue
        # A closed record never changes; an open one may only have been closed.
        mutable = ("end", "closed_by_pass") if old["end"] is None else ()
        if {k: v for k, v in old.items() if k not in mutable} != {k: v for k, v in new.items() if k not in mutable}:
            changed.append(pk)
    by_subject: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for record in after.values():
        key = ("namespace", "subject_kind", "subject", "subject_uid", "resource_name")
        by_subject[tuple(record[k] for k in key)].append(record)
    duplicated = []
    for records in by_subject.values():
        records.sort(key=lambda r: (r["start"], r["id"]))
        for first, second in zip(records, records[1:], strict=False):
            if first["end"] is None or first["end"] > second["start"]:
                duplicated.append((first["id"], second["id"]))
    passes = set(models.PassRun.objects.values_list("id", flat=True))
    orphans = sorted(
        r["id"]
        for r in after.values()
        if r["opened_by_pass"] not in passes or (r["closed_by_pass"] is not None and r["closed_by_pass"] not in passes)
    )
    return Ledger(len(before), len(after), lost, changed, duplicated, orphans)


def assert_ledger_clean(book: Ledger) -> None:
    assert not (book.lost or book.changed or book.duplicated or book.orphans), book


def last_pass() -> int:
    return models.PassRun.objects.order_by("-id").values_list("id", flat=True).first() or 0


def passes_since(mark: int) -> Counter[str]:
    return Counter(models.PassRun.objects.filter(id__gt=mark).values_list("kind", flat=True))


def restore(client: redis.Redis, mark: int, limit: int = 4) -> Counter[str]:
    """Let the queue drain; while an invariant is broken, send one more event (as the sync or
    the periodic resync would). The passes run since ``mark`` when every invariant held."""
    for _ in range(limit):
        workers.wait_until_idle(client)
        if not violations():
            return passes_since(mark)
        workers.mirror_event()
    workers.wait_until_idle(client)
    assert not violations(), violations()
    return passes_since(mark)


def placement() -> list[tuple[str, str, str, str]]:
    """What passes write on devices (``bind_request`` belongs to the webhook)."""
    return sorted(models.GpuDevice.objects.values_list("name", "phase", "node", "answered_request"))


def report(request: pytest.FixtureRequest, fault: str, lines: list[str]) -> None:
    """Print the figures, whatever pytest does with output."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    text = [f"[faults] {fault}", *(f"[faults]   {line}" for line in lines)]
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        for line in text:
            if reporter is not None:
                reporter.write_line(line)
            else:  # pragma: no cover - pytest without its terminal
                print(line)


def figures(name: str, answers: list[Answer], wait: float) -> str:
    kinds = Counter(kind_of(a) for a in answers)
    slowest = max((a.seconds for a in answers), default=0.0)
    listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{name}: {len(answers)} calls: {listed}; slowest {slowest:.2f}s (wait {wait:g}s)"


def held_set_with_records(nodes: list[str], units: int = 4) -> None:
    """A class, nodes, and t1's 'held' set (2 devices Bound on the first node) with its usage
    records opened by a full pass in this process."""
    load_objects(
        [
            class_obj("h100", H100),
            *(node_obj(name, {H100: units}) for name in nodes),
            gpu_obj("t1", "held-gpu0", "h100", "held", phase="Bound", node=nodes[0]),
            gpu_obj("t1", "held-gpu1", "h100", "held", phase="Bound", node=nodes[0]),
        ]
    )
    run_pass("full")
    assert UsageRecord.objects.open().count() == 2


def orders(count: int) -> list[tuple[str, str, list[str]]]:
    """``count`` single-device orders in t3/t4: (namespace, VM, devices)."""
    vms = [(f"t{3 + i % 2}", f"vm{i}", [f"vm{i}-gpu0"]) for i in range(count)]
    load_objects([gpu_obj(ns, devices[0], "h100", vm) for ns, vm, devices in vms])
    return vms


def assert_rebuilt_then_verified(mark: int) -> list[tuple[str, int | None]]:
    """After a fault the next worker's first pass read everything again (its in-memory
    state cannot be proven current), and every later pass's verification (the test
    workers verify every pass) found no difference from a rebuild."""
    runs = list(models.PassRun.objects.filter(id__gt=mark).order_by("id").values_list("view", "verify_mismatches"))
    assert runs and runs[0][0] == "rebuilt", runs
    assert all(not mismatches for _, mismatches in runs), runs
    assert any(mismatches == 0 for _, mismatches in runs), runs  # at least one pass verified
    return runs


# -- a pass held mid-flight ----------------------------------------------------------------------


@contextlib.contextmanager
def pass_held_before_its_writes() -> Iterator[psycopg.Connection[Any]]:
    """Hold every pass at its first write, for as long as the test needs.

    A connection of the test's own takes ``binder_passrun`` in SHARE mode: a pass takes the
    pass lock, reads and decides, then waits at the insert of its record, before it writes
    a device, a decision or a usage record, with its transaction open. The fault then hits
    a pass that is certainly in flight, however loaded the machine is (a pass slowed by a
    sleep could end before the fault on a busy machine, or start after it). Readers of
    the table are not held (SHARE allows them); the webhook writes no pass record."""
    holder = psycopg.connect(workers.database_url())
    try:
        holder.execute("LOCK TABLE binder_passrun IN SHARE MODE")
        yield holder
    finally:
        with contextlib.suppress(psycopg.Error):
            holder.rollback()
        holder.close()


def pass_waiting_at_its_write() -> bool:
    """True once a session holds the pass lock and waits for a lock (the held table)."""
    holder = workers.pass_holder()
    if holder is None:
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [holder])
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


def bind_requests_written(vms: list[tuple[str, str, list[str]]]) -> bool:
    """True once every call of the burst has written its bind request (it then waits)."""
    names = [name for _ns, _vm, devices in vms for name in devices]
    return models.GpuDevice.objects.filter(name__in=names).exclude(bind_request="").count() == len(names)


# -- 1. the worker SIGKILLed mid-pass ------------------------------------------------------------


@pytest.mark.slow
def test_worker_sigkilled_mid_pass_during_a_webhook_burst(
    request: pytest.FixtureRequest, server: str, start_worker: Callable[..., workers.Worker], broker: redis.Redis
) -> None:
    held_set_with_records(["n1", "n2"])
    # A set left split by an earlier half-failed write, and 6 orders for the 4 units left.
    load_objects(
        [
            gpu_obj("t2", "split-gpu0", "h100", "split", phase="Bound", node="n1"),
            gpu_obj("t2", "split-gpu1", "h100", "split", phase="Bound", node="n2"),
        ]
    )
    vms = orders(6)
    before, records, mark = placement(), history(), last_pass()

    doomed = start_worker("doomed")
    with pass_held_before_its_writes():
        workers.mirror_event()
        workers.wait_for(pass_waiting_at_its_write)
        burst = Burst(server, bodies(vms), spread=1.0)
        workers.wait_for(lambda: bind_requests_written(vms))  # the calls wait for the binder
        doomed.stop(signal.SIGKILL)
    # Released: the killed worker's backend goes on to its insert, finds its client gone
    # and rolls the pass back.
    workers.wait_for(lambda: workers.pass_holder() is None)
    # Nothing half-written: no placement, no pass, no usage record from the killed pass.
    assert placement() == before
    assert passes_since(mark) == Counter()
    assert history() == records

    start_worker("heir")
    during = burst.answers()
    kinds = check_answers(during, WAIT)
    passes = restore(broker, mark)
    retried = [call(server, body) for body in bodies(vms)]  # the VM controller creates the VMIs again
    retry_kinds = check_answers(retried, WAIT)
    workers.wait_until_idle(broker)

    assert not violations(), violations()
    # The split set is whole again: gathered on one node, or Lost whole if the room went to
    # orders first (the answer pass for the burst runs before the full pass that restores it).
    (split,) = set(models.GpuDevice.objects.filter(vm_name="split").values_list("phase", "node"))
    assert split[0] in HELD
    room = 4 if split[0] == models.Phase.BOUND else 6
    assert retry_kinds == Counter({"allowed": room, "denied: no room (binder's reason)": 6 - room}), retry_kinds
    book = ledger(records)
    assert_ledger_clean(book)
    assert book.after > book.before  # the split set and the new sets opened records
    assert_rebuilt_then_verified(mark)
    report(
        request,
        "1. worker SIGKILLed mid-pass during a burst of 6 calls",
        [
            figures("during the fault", during, WAIT),
            figures("retried after", retried, WAIT),
            f"passes after the kill until every invariant held: {sum(passes.values())} ({dict(passes)})",
            f"the split set ended {split[0]} {split[1]}".rstrip(),
            str(book),
        ],
    )
    assert sum(kinds.values()) == len(vms)


# -- 2. Redis restarted during a burst -----------------------------------------------------------


@pytest.mark.slow
def test_redis_restarted_during_a_webhook_burst(
    request: pytest.FixtureRequest,
    own_redis: OwnRedis,
    server: str,
    start_worker: Callable[..., workers.Worker],
    broker: redis.Redis,
) -> None:
    held_set_with_records(["n1", "n2"])
    vms = orders(8)  # 6 units left for 8 orders
    records, mark = history(), last_pass()
    start_worker("w1", delay=0.3)

    burst = Burst(server, bodies(vms), spread=3.0)
    time.sleep(0.5)
    down = time.monotonic()
    own_redis.stop()
    time.sleep(2.0)  # longer than kombu's publish retries (about 1 s)
    own_redis.start()
    back, downtime = timezone.now(), time.monotonic() - down
    during = burst.answers()
    kinds = check_answers(during, WAIT)

    # Redis came back empty (no persistence): queued passes and collapse flags are gone.
    # Passes resume with the next event; here the periodic resync, as celery beat sends it.
    resync_task.apply_async()
    passes = restore(broker, mark)
    first = models.PassRun.objects.filter(id__gt=mark, started__gte=back).order_by("started").first()
    assert first is not None
    resumed = (first.started - back).total_seconds()
    retried = [call(server, body) for body in bodies(vms)]
    retry_kinds = check_answers(retried, WAIT)
    workers.wait_until_idle(broker)

    assert not violations(), violations()
    assert retry_kinds == {"allowed": 6, "denied: no room (binder's reason)": 2}, retry_kinds
    book = ledger(records)
    assert_ledger_clean(book)
    report(
        request,
        f"2. Redis (the broker) restarted during a burst of 8 calls, down {downtime:.1f}s",
        [
            figures("during the fault", during, WAIT),
            figures("retried after", retried, WAIT),
            f"first pass {resumed:.1f}s after Redis was back (the worker reconnects with a backoff)",
            f"passes after the restart until every invariant held: {sum(passes.values())} ({dict(passes)})",
            str(book),
        ],
    )
    assert sum(kinds.values()) == len(vms)


# -- 3. PostgreSQL drops every connection mid-pass -------------------------------------------------


def terminate_backends() -> tuple[int, int]:
    """pg_terminate_backend on every other connection to this test database: (the pass's, others)."""
    holder = workers.pass_holder()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        killed = {pid for pid, done in cursor.fetchall() if done}
    assert holder in killed
    return holder, len(killed) - 1


@pytest.mark.slow
def test_postgresql_connections_dropped_mid_pass(
    request: pytest.FixtureRequest, server: str, start_worker: Callable[..., workers.Worker], broker: redis.Redis
) -> None:
    held_set_with_records(["n1", "n2", "n3"])
    load_objects([gpu_obj("t2", "mover-gpu0", "h100", "mover", phase="Bound", node="n2")])
    run_pass("full")  # the mover's record opens
    drained = models.Node.objects.get(name="n2")
    models.Node.objects.filter(pk=drained.pk).update(labels={**drained.labels, "gpuplane.io/drain": "true"})
    vms = orders(6)  # the mover and 6 orders for 6 units (n1: 2, n3: 4): one order refused
    records, mark = history(), last_pass()
    worker = start_worker("w1")

    with pass_held_before_its_writes():  # its connection is one of those dropped
        workers.mirror_event()  # a full pass that would move the mover (close and open records) and bind
        workers.wait_for(pass_waiting_at_its_write)
        burst = Burst(server, bodies(vms), spread=0.5)
        workers.wait_for(lambda: bind_requests_written(vms))  # the calls wait for the binder
        holder, others = terminate_backends()
    during = burst.answers()
    kinds = check_answers(during, WAIT)
    workers.wait_for(lambda: "OperationalError" in worker.log.read_text(), timeout=10)

    passes = restore(broker, mark)
    retried = [call(server, body) for body in bodies(vms)]
    retry_kinds = check_answers(retried, WAIT)
    workers.wait_until_idle(broker)

    assert not violations(), violations()
    # The mover left the drained node: moved to n3, or Lost if the answer pass for the burst
    # gave its room to the orders first (the full pass that would have moved it rolled back).
    (mover,) = set(models.GpuDevice.objects.filter(vm_name="mover").values_list("phase", "node"))
    assert mover[0] in HELD and mover[1] != "n2"
    room = 5 if mover[0] == models.Phase.BOUND else 6
    assert retry_kinds == Counter({"allowed": room, "denied: no room (binder's reason)": 6 - room}), retry_kinds
    book = ledger(records)
    assert_ledger_clean(book)
    # The mover's record closed and a new one opened on its new node; one per bound order.
    assert book.after == book.before + 1 + room, book
    # The same worker process went on: its next passes opened new connections.
    log = worker.log.read_text()
    assert worker.process.poll() is None and log.count("raised unexpected") == 1
    assert models.PassRun.objects.filter(id__gt=mark, finished__isnull=True).count() == 0
    assert_rebuilt_then_verified(mark)
    report(
        request,
        f"3. PostgreSQL connections dropped mid-pass (the pass's backend and {others} others)",
        [
            figures("during the fault", during, WAIT),
            figures("retried after", retried, WAIT),
            "the full pass whose backend was killed raised OperationalError and rolled back (no pass row,"
            " decision or record of it); acked, not redelivered; the same worker ran the next queued passes"
            " on new connections",
            f"passes after the drop until every invariant held: {sum(passes.values())} ({dict(passes)})",
            f"the set on the drained node ended {mover[0]} {mover[1]}".rstrip(),
            str(book),
        ],
    )
    assert sum(kinds.values()) == len(vms)


# -- 4. the API server fails writes at random -------------------------------------------------------


def cluster_violations(server: ControlPlane) -> list[str]:
    """The invariants on the cluster's own objects, the mirror against the cluster, and the
    mirror's invariants (usage records) as in standalone mode."""
    problems = []
    held: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    booked: Counter[str] = Counter()  # one unit per device (class h100)
    for (ns, name), gpu in cluster_gpus(server).items():
        status = gpu.get("status") or {}
        cluster_state = (status.get("phase") or "Pending", status.get("node") or "")
        if cluster_state[0] in HELD:
            held[(ns, gpu["spec"]["vmName"])].add(cluster_state)
        if cluster_state[0] == models.Phase.BOUND:
            booked[cluster_state[1]] += 1
        mirrored = mirrored_devices().get((ns, name))
        if mirrored != cluster_state:
            problems.append(f"GPU {ns}/{name}: cluster {cluster_state}, mirror {mirrored}")
    problems += [f"set {key} not whole in the cluster: {sorted(s)}" for key, s in sorted(held.items()) if len(s) > 1]
    problems += [f"node {n} over-booked in the cluster: {u} units on 4" for n, u in sorted(booked.items()) if u > 4]
    return problems + violations()


@pytest.mark.parametrize("seed", SEEDS)
def test_api_server_failing_writes_at_random(
    request: pytest.FixtureRequest, apiserver: ControlPlane, client: Client, settings: Any, seed: int
) -> None:
    wait = 1.0  # the answer pass runs in-process at commit: an answer not there by then will not come
    settings.GPUPLANE_BIND_WAIT_SECONDS = wait
    apiserver.seed(
        namespace_obj("t1"),
        namespace_obj("t2"),
        node_obj("n1", {H100: 4}),
        node_obj("n2", {H100: 4}),
        class_obj("h100", H100),
        gpu_obj("t1", "held-gpu0", "h100", "held", phase="Bound", node="n1"),
        gpu_obj("t1", "held-gpu1", "h100", "held", phase="Bound", node="n1"),
    )
    sync.sync_once()
    run_pass("full")  # the held set's usage records open
    records, mark = history(), last_pass()
    assert len(records) == 2
    # Five orders of two devices for the 6 units left: three fit.
    apiserver.seed(
        *(gpu_obj("t2", f"{vm}-gpu{i}", "h100", vm, created=f"2026-11-2{n}T10:00:00Z")
          for n, vm in enumerate(("vma", "vmb", "vmc", "vmd", "vme")) for i in range(2)),
    )  # fmt: skip
    vms = [("t2", vm, [f"{vm}-gpu0", f"{vm}-gpu1"]) for vm in ("vma", "vmb", "vmc", "vmd", "vme")]
    sync.sync_once()

    rng = random.Random(seed)
    injected: Counter[int] = Counter()

    def flaky(verb: str, kind: Kind, ns: str, target: str) -> int | None:
        """30 % of gpuplane's writes (annotations, status, finalizers) fail with 409, 500 or 503."""
        if kind.group != "gpuplane.io" or rng.random() >= 0.3:
            return None
        code = rng.choice((409, 500, 503))
        injected[code] += 1
        return code

    apiserver.faults.decide = flaky

    def webhook_round() -> list[Answer]:
        answers = []
        for body in bodies(vms):
            started = time.monotonic()
            resp = post(client, body)
            seconds = time.monotonic() - started
            if resp.status_code != 200:
                answers.append(Answer(resp.status_code, False, resp.content.decode(errors="replace"), seconds))
                continue
            answer = answer_of(resp, body)
            message = (answer.get("status") or {}).get("message", "")
            answers.append(Answer(200, answer["allowed"], message, seconds))
        return answers

    def passes_until_whole(limit: int = 20) -> int:
        for count in range(1, limit + 1):
            run = run_pass("full")
            if not cluster_violations(apiserver) and run.writes_failed == 0:
                return count
        raise AssertionError(cluster_violations(apiserver))

    during = webhook_round()
    kinds = check_answers(during, wait)
    restored = passes_until_whole()
    retried = webhook_round()  # faults still on
    retry_kinds = check_answers(retried, wait)
    restored_again = passes_until_whole()

    assert not cluster_violations(apiserver), cluster_violations(apiserver)
    assert sum(injected.values()) > 0
    bound = [key for key, (phase, _) in mirrored_devices().items() if phase == "Bound"]
    assert len(bound) == 2 + 6  # the held set and three orders of two: room for 6 units
    for gpu_class in apiserver.request("GET", f"{GPUS}/gpuclasses")["items"]:
        assert gpu_class["status"]["bound"] == 8, gpu_class["status"]
    writes = len(apiserver.faults.writes)
    book = ledger(records)
    assert_ledger_clean(book)
    assert book.after == 2 + 6
    quiet = run_pass("full")
    assert quiet.devices_written == 0 and quiet.records_opened == 0 and quiet.records_closed == 0
    report(
        request,
        f"4. API server failing 30% of gpuplane's writes at random (seed {seed}; 409/500/503)",
        [
            f"{sum(injected.values())} of {writes} writes failed ({dict(sorted(injected.items()))})",
            figures("first calls", during, wait),
            figures("retried, faults still on", retried, wait),
            f"full passes until every set was whole and every write landed: {restored}, after the retries"
            f" {restored_again} (passes since the faults began: {sum(passes_since(mark).values())})",
            f"sets left partly Pending next to held members: {partly_pending() or 'none'}",
            str(book),
        ],
    )
    assert sum(kinds.values()) == sum(retry_kinds.values()) == len(vms)


# -- the webhook when the database goes away (unit level; SQLite too) -----------------------------


def _pending_vm1() -> dict[str, Any]:
    load_objects([class_obj("h100", H100), node_obj("n1", {H100: 4}), gpu_obj("t1", "vm1-gpu0", "h100", "vm1")])
    return review(new_vmi("t1", "vm1", ["vm1-gpu0"]))


def test_webhook_denies_clearly_when_the_database_is_unavailable(client: Client, settings: Any) -> None:
    body = _pending_vm1()
    down = OperationalError("connection to server at 127.0.0.1, port 5432 failed: Connection refused")
    with mock.patch.object(views, "mirror_view", side_effect=down) as read:
        resp = post(client, body)
    answer = answer_of(resp, body)
    assert answer["allowed"] is False
    assert answer["status"]["message"] == "VMI t1/vm1: the gpuplane database is unavailable; try again"
    assert read.call_count == 2  # one reconnect, then the denial


def test_webhook_reconnects_once_when_its_pooled_connection_was_dropped(client: Client) -> None:
    body = _pending_vm1()
    real = binding.mirror_view
    calls = []

    def dropped_once(namespace: str) -> binding.MirrorView:
        calls.append(namespace)
        if len(calls) == 1:
            raise OperationalError("terminating connection due to administrator command")
        return real(namespace)

    with mock.patch.object(views, "mirror_view", side_effect=dropped_once):
        answer = answer_of(post(client, body), body)
    assert answer["allowed"] is True and len(calls) == 2


def test_webhook_keeps_waiting_through_a_dropped_connection_then_denies_within_the_wait(
    client: Client, settings: Any
) -> None:
    settings.GPUPLANE_BIND_WAIT_SECONDS = 0.5
    body = _pending_vm1()
    with mock.patch.object(binding, "answers_of", side_effect=OperationalError("server closed the connection")) as read:
        started = time.monotonic()
        answer = answer_of(post(client, body), body)
        seconds = time.monotonic() - started
    assert answer["allowed"] is False
    assert answer["status"]["message"] == "VMI t1/vm1: the gpuplane database is unavailable; try again"
    assert read.call_count > 1 and seconds < 0.5 + SLACK  # it kept trying until the deadline, not past it


def test_webhook_survives_postgresql_terminating_its_connection(real_parts: None, client: Client) -> None:
    """The real thing: PostgreSQL ends this process's connection (what a restart or failover does)."""
    body = _pending_vm1()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with connection.get_new_connection(connection.get_connection_params()) as other:
        other.autocommit = True
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    answer = answer_of(post(client, body), body)
    assert answer["allowed"] is True  # reconnected once, bound in-process (no broker here)

"""Shared test setup and the fixtures several test modules use.

Passes are driven by hand in tests (``GPUPLANE_AUTO_PASS`` off) unless a test turns
automatic passes on to check them. With ``GPUPLANE_FORBID_SKIPS=1`` (the PostgreSQL run
in CI) any skipped test fails the session, so a run that silently fell back is red.

Test modules share objects through these fixtures and through the helper modules next
to them (harness/shapes.py, factories.py, webhook_calls.py, workers.py, cluster_mode.py,
manifests.py, engine_invariants.py, accounts.py, clock.py, staff_cluster.py, browsing.py),
never by importing another test module.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
from django.conf import settings as django_settings
from hypothesis import settings as hypothesis_settings
from playwright.sync_api import Browser, Page

from binder import apiserver as kube_connection
from binder import models
from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from gpuplane.celery import app as celery_app
from harness import databases, workers
from harness.browsing import launch_chromium, load_demo, new_page
from harness.clock import Clock
from harness.controlplane import UNION_USER, ControlPlane, ControlPlaneError
from harness.factories import two_tenants
from harness.faults import FaultWebhook, WatchProxy
from harness.staff_cluster import load_staff_cluster
from harness.vm_cluster import Gpuplane, VmCluster

# Property tests, state machines and the schemathesis fuzzer search afresh on every local
# run (``make test``): that is how they find bugs. CI (``.ci/run``) sets
# HYPOTHESIS_PROFILE=ci: the same examples every run, so a red CI is a regression in the
# code, not the luck of the draw. Loaded here, before any test module builds its settings.
hypothesis_settings.register_profile("ci", derandomize=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Importing gpuplane.wsgi (the schema fuzzer does) would start building the read model in a
# thread against whatever database is current; tests build it on first use instead.
os.environ.setdefault("GPUPLANE_READ_MODEL_AT_START", "false")


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None, django_db_blocker: Any) -> None:
    """On PostgreSQL every test database (one per xdist worker) is a copy of one migrated
    template (harness/databases.py) instead of a migration from nothing."""
    db = django_settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.postgresql":
        with django_db_blocker.unblock():
            db.setdefault("TEST", {})["TEMPLATE"] = databases.migrated_template(db)


@pytest.fixture(autouse=True)
def _manual_passes(settings: Any) -> None:
    settings.GPUPLANE_AUTO_PASS = False
    # The webhook is off by default in standalone mode, and in cluster mode served only by the
    # webhook server; the tests call it through Django's client as that server would
    # (tests/webhooks/test_webhook_serving.py checks the defaults, the servers and who may call).
    settings.GPUPLANE_WEBHOOK_ENABLED = True
    settings.GPUPLANE_SERVE = "webhook"
    # Checkpoints off: the tests of when a worker reads everything again see those reads
    # (tests/runtime/test_checkpoint.py turns them on; GPUPLANE_TEST_CHECKPOINTS=1 runs the
    # state-machine tests with them, where only "rebuilt" views become "checkpoint").
    settings.GPUPLANE_CHECKPOINTS = os.environ.get("GPUPLANE_TEST_CHECKPOINTS") == "1"


@pytest.fixture(autouse=True)
def _close_answer_listener() -> Iterator[None]:
    """The webhook's per-process LISTEN connection holds the test database open; close it
    after each test so the database can be flushed and dropped."""
    yield
    from binder.runtime.answers import ANSWERS

    ANSWERS.stop()


@pytest.fixture
def clock() -> Iterator[Clock]:
    """Freeze ``django.utils.timezone.now`` at harness.shapes.NOW; ``clock.advance(hours=1)``."""
    c = Clock()
    with mock.patch("django.utils.timezone.now", side_effect=lambda: c.now):
        yield c


# -- the two-tenant cluster (tenant API, admin, security) ----------------------------------------


@pytest.fixture
def cluster(clock: Clock) -> Clock:
    """Load two tenants (harness.factories.two_tenants), run a pass, 2 h later move t1's set
    to n3, 1 h later stop there. (tests/staff/test_admin.py and tests/staff/test_staff_pages.py define
    a ``cluster`` of their own, which takes the place of this one in those modules.)"""
    load_objects(two_tenants())
    run_pass("full")
    clock.advance(hours=2)
    node = models.Node.objects.get(name="n1")
    node.labels = {**node.labels, "gpuplane.io/drain": "true"}
    node.save()
    run_pass("full")
    clock.advance(hours=1)
    return clock


# -- the staff console ----------------------------------------------------------------------------


@pytest.fixture
def fast_passwords(settings: Any) -> None:
    """For the modules that log staff in (``pytest.mark.usefixtures``): logins are not what
    they test, and the default hasher is slow on purpose."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def placed(tmp_path: Path) -> models.PassRun:
    """The staff cluster (harness/staff_cluster.py), placed by one full pass.
    (tests/staff/test_staff_audit.py and tests/staff/test_staff_time.py define a ``placed`` of their own.)"""
    return load_staff_cluster(tmp_path)


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Debian's Chromium, per test (about a second; harness/browsing.py)."""
    with launch_chromium() as chromium:
        yield chromium


@pytest.fixture
def page(live_server: Any, browser: Browser) -> Page:
    """A 1280 × 900 page (harness/browsing.py's new_page) with the live server running; it
    closes with the browser."""
    return new_page(browser)


@pytest.fixture
def demo() -> None:
    """The demo cluster, placed as ``make demo`` places it, and the ``staff`` superuser.
    (tests/staff/test_staff_explain.py defines a ``demo`` of its own, without the user.)"""
    load_demo()


# -- cluster mode: a real control plane (harness/controlplane/) ------------------------


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """etcd, kube-apiserver and kube-controller-manager for this xdist worker, started on
    first use (the binaries from ``make kube-bin`` or ``KUBEBUILDER_ASSETS``), with the
    fault webhook registered; stopped at the end of the session, leaving no process."""
    try:
        plane = ControlPlane().start()
    except ControlPlaneError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        plane.faults = FaultWebhook(plane).start()
    except BaseException:
        plane.stop()
        raise
    yield plane
    plane.faults.stop()
    plane.stop()


@pytest.fixture
def apiserver(control_plane: ControlPlane, settings: Any) -> Iterator[ControlPlane]:
    """The worker's control plane, emptied of the previous test's objects, with gpuplane
    in cluster mode talking to it as ``gpuplane-test`` (bound to each of deploy/'s
    ClusterRoles: it may do what their union grants, nothing more)."""
    control_plane.reset()
    control_plane.faults.reset()
    settings.GPUPLANE_CLUSTER = "kubernetes"
    kube_connection.use(control_plane.kube_api(UNION_USER))
    try:
        yield control_plane
    finally:
        kube_connection.use(None)
        control_plane.faults.reset()


@pytest.fixture
def watch_proxy(apiserver: ControlPlane) -> Iterator[WatchProxy]:
    """gpuplane's connection goes through a :class:`WatchProxy` in front of the apiserver."""
    proxy = WatchProxy(apiserver).start()
    kube_connection.use(apiserver.kube_api(UNION_USER, url=proxy.url))
    try:
        yield proxy
    finally:
        proxy.withhold = None
        kube_connection.use(None)
        proxy.stop()


# -- the VM cluster: kube-scheduler, KubeVirt's virt-controller and kwok (harness/vm_cluster.py) ----


@pytest.fixture(scope="session")
def vm_cluster_session() -> Iterator[VmCluster]:
    """This xdist worker's VM cluster, started on first use, stopped with the session."""
    cluster = VmCluster()
    try:
        cluster.start()
    except ControlPlaneError as exc:
        cluster.stop()
        pytest.fail(str(exc), pytrace=False)
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture
def vm_cluster(vm_cluster_session: VmCluster, settings: Any) -> Iterator[VmCluster]:
    """The VM cluster emptied of the previous test's objects, with this process's gpuplane
    reading it as ``gpuplane-test`` (what a test asks of the mirror)."""
    vm_cluster_session.check_running()
    vm_cluster_session.reset()
    settings.GPUPLANE_CLUSTER = "kubernetes"
    kube_connection.use(vm_cluster_session.plane.kube_api(UNION_USER))
    try:
        yield vm_cluster_session
    finally:
        kube_connection.use(None)


@pytest.fixture
def gpuplane(vm_cluster: VmCluster, transactional_db: None, broker: redis.Redis, tmp_path: Path) -> Iterator[Gpuplane]:
    """gpuplane as deployed on the VM cluster (harness/vm_cluster.py :class:`Gpuplane`),
    stopped before the test's database is emptied."""
    deployed = Gpuplane(vm_cluster, tmp_path, GPUPLANE_NODE_GRACE_SECONDS="5").start()
    try:
        yield deployed
    finally:
        deployed.stop()


# -- real parts: Redis, `celery worker`, gunicorn (harness/workers.py) ------------------------------


@pytest.fixture
def postgres_only() -> None:
    """Skip on SQLite: the real-parts tests run on PostgreSQL, as in production."""
    workers.skip_unless_postgres()


@pytest.fixture
def broker(settings: Any) -> Iterator[redis.Redis]:
    """Point this process's Celery at the test Redis, flushed; restore afterwards.
    (tests/system/test_faults.py overrides it with its own Redis; tests/runtime/test_metrics.py has a
    ``broker`` of its own.)"""
    client = redis.Redis.from_url(workers.REDIS_URL)
    client.ping()  # no Redis is a failure here, not a skip
    workers.forget_keys(client)
    # Saved before the settings change: Celery reads its conf from Django's settings lazily,
    # so reading it afterwards would "save" the test's values and leave eager mode off.
    conf = celery_app.conf
    saved = (conf.broker_url, conf.task_always_eager, conf.broker_transport_options)
    options = {**django_settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": workers.PREFIX}
    settings.CELERY_BROKER_URL = workers.REDIS_URL
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    conf.broker_url, conf.task_always_eager, conf.broker_transport_options = workers.REDIS_URL, False, options
    workers.reset_producer_pool()
    yield client
    conf.broker_url, conf.task_always_eager, conf.broker_transport_options = saved
    workers.reset_producer_pool()
    workers.forget_keys(client)


@pytest.fixture
def start_worker(broker: redis.Redis, tmp_path: Path) -> Iterator[Callable[..., workers.Worker]]:
    """``start_worker(name="w1", delay=0.0)`` starts a `celery worker`; all are stopped after the test."""
    started: list[workers.Worker] = []

    def start(name: str = "w1", delay: float = 0.0, **env: str) -> workers.Worker:
        worker = workers.Worker(name, tmp_path / f"{name}-{len(started)}.log", delay, env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def server(broker: redis.Redis, tmp_path: Path) -> Iterator[str]:
    """The webhook served by gunicorn (plain HTTP: TLS has its own test) on a free port: its URL."""
    with workers.serve_webhook(tmp_path) as url:
        yield url


def _django_group(item: pytest.Item) -> int:
    """pytest-django's order: 0 database tests, 1 transactional ones (they empty the
    database after them), 2 the rest."""
    names = set(getattr(item, "fixturenames", ()))
    marker = item.get_closest_marker("django_db")
    transactional = bool(marker and (marker.kwargs.get("transaction") or marker.kwargs.get("reset_sequences")))
    if transactional or names & {"transactional_db", "live_server"}:
        return 1
    return 0 if marker is not None or "db" in names else 2


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first: with two xdist processes a 30 s test collected last runs alone at
    the end while the other process idles. Slow tests that use no test database go to
    the very front; pytest-django's order of the others is kept, with the slow ones first
    in their group (the sorts are stable)."""
    items.sort(
        key=lambda item: (
            not (item.get_closest_marker("slow") and _django_group(item) == 2),
            _django_group(item),
            item.get_closest_marker("slow") is None,
        )
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("GPUPLANE_FORBID_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped:
        if reporter:
            reporter.write_line(f"GPUPLANE_FORBID_SKIPS=1: {skipped} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

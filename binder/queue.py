"""Asking for a pass: the one way every caller (signals, sync, staff, webhook) queues one.

Callers never run a pass inline: they call :func:`queue_full_pass` or
:func:`queue_answer_pass`, which publish after the current transaction commits (so
the pass sees what the caller wrote), at most once per transaction.

Collapse: any number of events while a pass of a kind is queued add nothing.
A Redis key, set-if-absent when a pass is published and deleted when that pass starts,
says "one is queued"; an event after the start publishes the next one, so nothing
that happened after the pass read the cluster is missed. The key expires after
``COLLAPSE_TTL`` so a message lost with its broker cannot mute passes for good (the
periodic resync covers the gap). Priority: answer passes go out with priority 0, full
passes with 9 (see settings: one queue, Redis priority lists).

Delay: a full pass may be asked for ``delay`` seconds from now (an answer pass that placed
a set asks so, ``GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS``): the message goes out at once
with a countdown, the worker holds it until then, and the collapse key (set meanwhile)
folds every later request into it, so a stream of bind requests is followed by one full
pass per delay instead of one after each answer pass, each of which the next answer pass
would wait behind. The key holds the time the pass is due, which is what
:func:`full_pass_overdue` measures from.

Tasks are published by name (``binder.tasks`` registers them when the binder app is
ready), so asking for a pass never imports the pass: the webhook, the sync and the
mirror writes stay below the pass in the import graph. Without a broker (the embedded
default) Celery runs the task in-process at commit.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import redis
from celery import current_app
from django.conf import settings
from django.db import transaction

from binder.models import PassKind

log = logging.getLogger(__name__)

#: The queue every binder task goes to (routed in settings.CELERY_TASK_ROUTES).
BINDER_QUEUE = "binder"
PRIORITY: dict[str, int] = {PassKind.ANSWER: 0, PassKind.FULL: 9}
COLLAPSE_KEY = "gpuplane:{kind}-pass-queued"
COLLAPSE_TTL = 300


def collapse_key(kind: str) -> str:
    """The collapse flag of ``kind``, under the broker's key prefix like the queue itself."""
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS or {}
    return str(options.get("global_keyprefix") or "") + COLLAPSE_KEY.format(kind=kind)


@cache
def _redis(url: str) -> redis.Redis[bytes]:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def collapse_client() -> redis.Redis[bytes] | None:
    """The broker's Redis, when the broker is Redis (collapse needs it); else None."""
    url = settings.CELERY_BROKER_URL
    if settings.CELERY_TASK_ALWAYS_EAGER or not url or not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    return _redis(url)


def _claim(kind: str, delay: float = 0.0) -> bool:
    """True if no pass of ``kind`` is queued yet (and mark one as queued, due in ``delay`` seconds)."""
    client = collapse_client()
    if client is None:
        return True
    try:
        # The value is when the pass is due: how long a full pass has waited (fairness).
        due = f"{time.time() + delay:.3f}"
        return bool(client.set(collapse_key(kind), due, nx=True, ex=COLLAPSE_TTL + math.ceil(delay)))
    except redis.RedisError:
        log.warning("collapse key unavailable; publishing the %s pass anyway", kind, exc_info=True)
        return True


def release(kind: str) -> None:
    """A pass of ``kind`` starts: events from now on need another pass."""
    client = collapse_client()
    if client is None:
        return
    try:
        client.delete(collapse_key(kind))
    except redis.RedisError:
        log.warning("could not clear the %s collapse key; it expires in %ss", kind, COLLAPSE_TTL, exc_info=True)


def full_pass_overdue() -> bool:
    """True when a full pass has been due for longer than
    ``GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS``: the next answer pass runs it first,
    so moves, usage records and status do not starve under a stream of bind requests. A
    full pass waits behind answer passes by design (they go first in the queue); this bounds
    how long."""
    client = collapse_client()
    if client is None:
        return False  # in-process passes run at once: nothing waits
    try:
        queued = client.get(collapse_key(PassKind.FULL))
    except redis.RedisError:
        return False
    try:
        since = float(queued) if queued else None
    except ValueError:
        since = None  # a flag from before the timestamp was kept: not overdue yet
    return since is not None and time.time() - since > settings.GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS


def answer_pass_queued() -> bool:
    """True while an answer pass is queued (its collapse flag is set); False without Redis."""
    client = collapse_client()
    if client is None:
        return False
    try:
        return bool(client.exists(collapse_key(PassKind.ANSWER)))
    except redis.RedisError:
        return False


#: Celery task names (stable: queued messages and beat schedules name them).
TASK_NAMES: dict[str, str] = {PassKind.FULL: "binder.full_pass", PassKind.ANSWER: "binder.answer_pass"}


def _publish(kind: str, triggered_by: str | None = None, delay: float = 0.0) -> None:
    kwargs = {"triggered_by": triggered_by} if triggered_by else {}
    # In-process (the embedded default) Celery ignores the countdown: the pass runs at once.
    task = current_app.tasks[TASK_NAMES[kind]]
    if delay > 0:
        task.apply_async(kwargs=kwargs, priority=PRIORITY[kind], countdown=delay)
    else:
        task.apply_async(kwargs=kwargs, priority=PRIORITY[kind])


def send_full_pass(triggered_by: str = "resync", delay: float = 0.0) -> None:
    """Publish a full pass now (not at commit) unless one is queued: the periodic resync.

    ``triggered_by`` travels with the task to the pass's record. While a pass is queued
    a later request adds nothing, so the record names the first request, not the last.
    That holds for delayed passes too: a request for a pass ``delay`` seconds from now
    folds into one already queued, and a request for one now folds into a delayed one,
    so it may run up to that delay later than asked.
    """
    if _claim(PassKind.FULL, delay):
        _publish(PassKind.FULL, triggered_by, delay)


def publish_full_pass_again(triggered_by: str) -> None:
    """Publish the queued full pass once more, now and in its priority list, leaving its
    collapse flag (and so its due time) as it is: a delayed full pass that came due behind
    a queued answer pass (``binder.tasks.full_pass_task``)."""
    _publish(PassKind.FULL, triggered_by)


def send_answer_pass(triggered_by: str | None = None) -> None:
    """Publish an answer pass now (not at commit) unless one is queued."""
    if _claim(PassKind.ANSWER):
        _publish(PassKind.ANSWER, triggered_by)


@dataclass(frozen=True, slots=True)
class _FullPassAtCommit:
    """The commit callback that publishes a full pass, carrying who asked for it.

    A class rather than a closure so that :func:`_queue_on_commit` can recognise an
    already registered one whatever its ``triggered_by``: once per transaction still.
    """

    triggered_by: str
    delay: float = 0.0

    def __call__(self) -> None:
        send_full_pass(self.triggered_by, self.delay)


def _same_send(registered: object, send: Callable[[], None]) -> bool:
    return registered is send or (isinstance(registered, _FullPassAtCommit) and isinstance(send, _FullPassAtCommit))


def _queue_on_commit(send: Callable[[], None]) -> None:
    """Register ``send`` to run at commit, once per transaction.

    Django itself drops the callbacks of a rolled-back transaction or savepoint from
    ``run_on_commit``, so looking there (rather than keeping a flag of our own) can
    never leave a stale "already queued" mark behind after a rollback.
    """
    connection = transaction.get_connection()
    if connection.in_atomic_block and any(_same_send(entry[1], send) for entry in connection.run_on_commit):
        return
    transaction.on_commit(send)


#: Set while mirror changes must not queue passes by themselves (:func:`passes_held`).
_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("gpuplane_passes_held", default=False)


@contextlib.contextmanager
def passes_held() -> Iterator[None]:
    """Mirror changes made inside queue no full pass: whoever holds them runs or queues
    the pass itself, once, afterwards (``load_snapshot``; ``--no-pass`` queues none)."""
    token = _HELD.set(True)
    try:
        yield
    finally:
        _HELD.reset(token)


def auto_pass() -> bool:
    """Whether a mirror change queues a full pass now (``GPUPLANE_AUTO_PASS``, not held)."""
    return bool(settings.GPUPLANE_AUTO_PASS) and not _HELD.get()


def queue_full_pass(triggered_by: str = "event", delay: float = 0.0) -> None:
    """Ask for a full pass once the current transaction commits (``delay`` seconds after it).

    ``triggered_by`` ends up on the pass's record (``PassRun.triggered_by``): "event" for
    a mirror change, "staff:<user>" for a staff action, and so on.
    """
    _queue_on_commit(_FullPassAtCommit(triggered_by, delay))


def queue_auto_full_pass() -> None:
    """:func:`queue_full_pass` for a mirror change, unless passes are driven by hand (tests)
    or held (:func:`auto_pass`): ``GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS`` later, so a
    burst of changes folds into one pass. The delay folds later events through the broker's
    collapse key; in-process passes (no broker) have none and run at once."""
    if auto_pass():
        folds = collapse_client() is not None
        queue_full_pass(delay=settings.GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS if folds else 0.0)


def queue_answer_pass() -> None:
    """Ask for an answer pass once the current transaction commits."""
    _queue_on_commit(send_answer_pass)

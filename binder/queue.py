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

Tasks are published by name (``binder.tasks`` registers them when the binder app is
ready), so asking for a pass never imports the pass: the webhook, the sync and the
mirror writes stay below the pass in the import graph. Without a broker (the embedded
default) Celery runs the task in-process at commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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


def _claim(kind: str) -> bool:
    """True if no pass of ``kind`` is queued yet (and mark one as queued)."""
    client = collapse_client()
    if client is None:
        return True
    try:
        # The value is when the pass was queued: how long a full pass has waited (fairness).
        return bool(client.set(collapse_key(kind), f"{time.time():.3f}", nx=True, ex=COLLAPSE_TTL))
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
    """True when a full pass has been queued for longer than
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


#: Celery task names (stable: queued messages and beat schedules name them).
TASK_NAMES: dict[str, str] = {PassKind.FULL: "binder.full_pass", PassKind.ANSWER: "binder.answer_pass"}


def _publish(kind: str, triggered_by: str | None = None) -> None:
    kwargs = {"triggered_by": triggered_by} if triggered_by else {}
    current_app.tasks[TASK_NAMES[kind]].apply_async(kwargs=kwargs, priority=PRIORITY[kind])


def send_full_pass(triggered_by: str = "resync") -> None:
    """Publish a full pass now (not at commit) unless one is queued: the periodic resync.

    ``triggered_by`` travels with the task to the pass's record. While a pass is queued
    a later request adds nothing, so the record names the first request, not the last.
    """
    if _claim(PassKind.FULL):
        _publish(PassKind.FULL, triggered_by)


def _send_answer_pass() -> None:
    if _claim(PassKind.ANSWER):
        _publish(PassKind.ANSWER)


@dataclass(frozen=True, slots=True)
class _FullPassAtCommit:
    """The commit callback that publishes a full pass, carrying who asked for it.

    A class rather than a closure so that :func:`_queue_on_commit` can recognise an
    already registered one whatever its ``triggered_by``: once per transaction still.
    """

    triggered_by: str

    def __call__(self) -> None:
        send_full_pass(self.triggered_by)


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


def queue_full_pass(triggered_by: str = "event") -> None:
    """Ask for a full pass once the current transaction commits.

    ``triggered_by`` ends up on the pass's record (``PassRun.triggered_by``): "event" for
    a mirror change, "staff:<user>" for a staff action, and so on.
    """
    _queue_on_commit(_FullPassAtCommit(triggered_by))


def queue_answer_pass() -> None:
    """Ask for an answer pass once the current transaction commits."""
    _queue_on_commit(_send_answer_pass)

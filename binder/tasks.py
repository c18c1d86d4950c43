"""Celery tasks of the binder queue, and the one way to ask for a pass.

Callers never run a pass inline: they call :func:`queue_full_pass` or
:func:`queue_answer_pass`, which publish after the current transaction commits (so
the pass sees what the caller wrote), at most once per transaction.

Collapse (SPEC §4): any number of events while a pass of a kind is queued add nothing.
A Redis key, set-if-absent when a pass is published and deleted when that pass starts,
says "one is queued"; an event after the start publishes the next one, so nothing
that happened after the pass read the cluster is missed. The key expires after
``COLLAPSE_TTL`` so a message lost with its broker cannot mute passes for good (the
periodic resync covers the gap). Priority: answer passes go out with priority 0, full
passes with 9 (see settings: one queue, Redis priority lists).

Without a broker (the embedded default) Celery runs the task in-process at commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache

import redis
from celery import shared_task
from django.conf import settings
from django.db import transaction

from .models import PassKind
from .passes import run_pass

log = logging.getLogger(__name__)

#: The queue every binder task goes to (routed in settings.CELERY_TASK_ROUTES).
BINDER_QUEUE = "binder"
PRIORITY = {PassKind.ANSWER: 0, PassKind.FULL: 9}
COLLAPSE_KEY = "gpuplane:{kind}-pass-queued"
COLLAPSE_TTL = 300


def collapse_key(kind: str) -> str:
    """The collapse flag of ``kind``, under the broker's key prefix like the queue itself."""
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS or {}
    return str(options.get("global_keyprefix") or "") + COLLAPSE_KEY.format(kind=kind)


@cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def collapse_client() -> redis.Redis | None:
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
        return bool(client.set(collapse_key(kind), "1", nx=True, ex=COLLAPSE_TTL))
    except redis.RedisError:
        log.warning("collapse key unavailable; publishing the %s pass anyway", kind, exc_info=True)
        return True


def _release(kind: str) -> None:
    """A pass of ``kind`` starts: events from now on need another pass."""
    client = collapse_client()
    if client is None:
        return
    try:
        client.delete(collapse_key(kind))
    except redis.RedisError:
        log.warning("could not clear the %s collapse key; it expires in %ss", kind, COLLAPSE_TTL, exc_info=True)


@shared_task(name="binder.full_pass")
def full_pass_task() -> int:
    """Run one full pass; returns the pass id."""
    _release(PassKind.FULL)
    return run_pass(PassKind.FULL).pk


@shared_task(name="binder.answer_pass")
def answer_pass_task() -> int:
    """Run one answer pass; returns the pass id.

    An answer pass that placed a set leaves usage records and class/budget status to
    a full pass (SPEC §4), so it asks for one (collapsed like any event): the set's
    usage record then opens within one pass of its binding.
    """
    _release(PassKind.ANSWER)
    run = run_pass(PassKind.ANSWER)
    if run.bound or run.moved or run.lost or run.restored:
        queue_full_pass()
    return run.pk


@shared_task(name="binder.resync")
def resync_task() -> None:
    """Periodic resync (celery beat): ask for a full pass, collapsed like any event."""
    _send_full_pass()


def _send_full_pass() -> None:
    if _claim(PassKind.FULL):
        full_pass_task.apply_async(priority=PRIORITY[PassKind.FULL])


def _send_answer_pass() -> None:
    if _claim(PassKind.ANSWER):
        answer_pass_task.apply_async(priority=PRIORITY[PassKind.ANSWER])


def _queue_on_commit(send: Callable[[], None]) -> None:
    """Register ``send`` to run at commit, once per transaction.

    Django itself drops the callbacks of a rolled-back transaction or savepoint from
    ``run_on_commit``, so looking there (rather than keeping a flag of our own) can
    never leave a stale "already queued" mark behind after a rollback.
    """
    connection = transaction.get_connection()
    if connection.in_atomic_block and any(entry[1] is send for entry in connection.run_on_commit):
        return
    transaction.on_commit(send)


def queue_full_pass() -> None:
    """Ask for a full pass once the current transaction commits."""
    _queue_on_commit(_send_full_pass)


def queue_answer_pass() -> None:
    """Ask for an answer pass once the current transaction commits."""
    _queue_on_commit(_send_answer_pass)

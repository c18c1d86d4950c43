"""Celery tasks of the binder queue, and the one way to ask for a pass.

Callers never run a pass inline: they call :func:`queue_full_pass` or
:func:`queue_answer_pass`, which enqueue after the current transaction commits (so
the pass sees what the caller wrote) and at most once per transaction. Without a
broker (the embedded default) Celery runs the task in-process at that moment.
"""

from __future__ import annotations

from collections.abc import Callable

from celery import shared_task
from django.db import transaction

from .models import PassKind
from .passes import run_pass

#: The queue every binder task goes to (routed in settings.CELERY_TASK_ROUTES).
BINDER_QUEUE = "binder"


@shared_task(name="binder.full_pass")
def full_pass_task() -> int:
    """Run one full pass; returns the pass id."""
    return run_pass(PassKind.FULL).pk


@shared_task(name="binder.answer_pass")
def answer_pass_task() -> int:
    """Run one answer pass; returns the pass id."""
    return run_pass(PassKind.ANSWER).pk


def _send_full_pass() -> None:
    full_pass_task.delay()


def _send_answer_pass() -> None:
    answer_pass_task.delay()


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

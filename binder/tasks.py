"""Celery tasks of the binder queue, and the one way to ask for a pass.

Callers never run a pass inline: they call :func:`queue_full_pass` or
:func:`queue_answer_pass`, which enqueue after the current transaction commits (so
the pass sees what the caller wrote) and at most once per transaction. Without a
broker (the embedded default) Celery runs the task in-process at that moment.
"""

from __future__ import annotations

import threading

from celery import shared_task
from django.db import transaction

from .models import PassKind
from .passes import run_pass

BINDER_QUEUE = "binder"

_pending = threading.local()


@shared_task(name="binder.full_pass", queue=BINDER_QUEUE)
def full_pass_task() -> int:
    """Run one full pass; returns the pass id."""
    return run_pass(PassKind.FULL).pk


@shared_task(name="binder.answer_pass", queue=BINDER_QUEUE)
def answer_pass_task() -> int:
    """Run one answer pass; returns the pass id."""
    return run_pass(PassKind.ANSWER).pk


def _queue_on_commit(kind: str) -> None:
    flag = f"queued_{kind}"
    if getattr(_pending, flag, False):
        return
    setattr(_pending, flag, True)

    def send() -> None:
        setattr(_pending, flag, False)
        task = full_pass_task if kind == PassKind.FULL else answer_pass_task
        task.delay()

    transaction.on_commit(send)


def queue_full_pass() -> None:
    """Ask for a full pass once the current transaction commits."""
    _queue_on_commit(PassKind.FULL)


def queue_answer_pass() -> None:
    """Ask for an answer pass once the current transaction commits."""
    _queue_on_commit(PassKind.ANSWER)

"""Celery tasks of the binder queue: a full pass, an answer pass, the periodic resync.

Registered when the binder app is ready (``BinderConfig.ready``); ``binder.queue``
publishes them by name, so only this module (and the worker) imports the pass.
"""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task
from celery.signals import worker_process_shutdown, worker_shutdown
from django.conf import settings

from binder.models import PassKind
from binder.queue import (
    answer_pass_queued,
    full_pass_overdue,
    publish_full_pass_again,
    queue_full_pass,
    release,
    send_answer_pass,
    send_full_pass,
)
from binder.runtime.checkpoint import save_on_shutdown
from binder.runtime.passes import run_pass

# A clean shutdown saves the pass state for the next start: the solo pool keeps it in the
# worker process itself, the prefork pool in each child (an invalid state saves nothing).
worker_shutdown.connect(save_on_shutdown, weak=False)
worker_process_shutdown.connect(save_on_shutdown, weak=False)


@shared_task(name="binder.full_pass", bind=True)
def full_pass_task(self: Task[Any, Any], triggered_by: str = "event") -> int | None:
    """Run one full pass; returns the pass id (None: queued again, see below).
    ``triggered_by`` (who queued it) goes on its record; messages queued before it
    existed run as "event".

    A delayed pass (a countdown: the worker holds the message until it is due) runs
    when due ahead of anything in the queue, answer passes included, which the priority
    lists would have put first. So when one comes due while an answer pass is queued, it
    goes back into its own priority list, still the one queued full pass (the collapse key
    stays), and waits behind answer passes as any full pass does, for at most
    ``GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS`` from when it was due.
    """
    if self.request.eta is not None and answer_pass_queued() and not full_pass_overdue():
        publish_full_pass_again(triggered_by)
        return None
    release(PassKind.FULL)
    return run_pass(PassKind.FULL, triggered_by=triggered_by).pk


#: An answer pass some of whose status writes did not land asks for another at once, up to
#: this many in a row (per worker process): a webhook call is waiting for those answers, and
#: the next full pass may be seconds away. What did not land is mostly a row the sync held
#: for a moment (it was mirroring the bind request's own watch event) or a 409; a write the
#: apiserver refuses for good stops being retried here after these few.
ANSWER_RETRIES = 10
_answer_retries = 0


@shared_task(name="binder.answer_pass")
def answer_pass_task(triggered_by: str = "webhook") -> int:
    """Run one answer pass; returns the pass id.

    An answer pass that placed a set leaves usage records and class/budget status to
    a full pass, so it asks for one (collapsed like any event), but
    ``GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS`` later: a full pass started at once made
    the next answer passes, and the webhook calls waiting on them, wait for its end. The
    set's usage record still opens at its binding (the device's ``since``). One whose
    writes did not all land asks for another answer pass at once (``ANSWER_RETRIES``).
    """
    global _answer_retries
    release(PassKind.ANSWER)
    if full_pass_overdue():
        # The queued full pass waited past GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS behind answer
        # passes: run it now, ahead of this one. Its queued message still runs later (cheap:
        # nothing changed), and events from now on queue the next one.
        release(PassKind.FULL)
        run_pass(PassKind.FULL, triggered_by="overdue")
    run = run_pass(PassKind.ANSWER, triggered_by=triggered_by)
    if run.bound or run.moved or run.lost or run.restored:
        queue_full_pass(triggered_by="answer", delay=settings.GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS)
    if not run.writes_failed:
        _answer_retries = 0
    elif _answer_retries < ANSWER_RETRIES:
        _answer_retries += 1
        send_answer_pass(triggered_by="retry")
    return run.pk


@shared_task(name="binder.resync")
def resync_task() -> None:
    """Periodic resync (celery beat): ask for a full pass, collapsed like any event."""
    send_full_pass(triggered_by="resync")

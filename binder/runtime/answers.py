"""The answers channel: how a pass tells waiting webhooks that bind requests were answered.

Both ends of one protocol live here: the pass ``NOTIFY``s ``gpuplane_answers`` inside its
transaction (PostgreSQL delivers it only at commit), and each web process keeps one
``LISTEN`` connection that wakes every waiting call. The database stays the truth: a
woken call re-reads the answers, so a lost or spurious notification only costs time.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from django.db import connection

log = logging.getLogger(__name__)

#: The PostgreSQL NOTIFY channel a pass that answered bind requests signals (payload: pass id).
ANSWERS_CHANNEL = "gpuplane_answers"


def notify_answers(pass_id: int) -> None:
    """Wake the webhooks waiting for bind answers (PostgreSQL ``NOTIFY``).

    Sent inside the pass transaction: PostgreSQL delivers it only when the pass commits,
    so a woken webhook always finds the answers in the database (its truth) and never a
    notification for a pass that rolled back. On SQLite the embedded default runs the
    answer pass in-process before the webhook starts waiting, so there is no one to wake.
    """
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [ANSWERS_CHANNEL, str(pass_id)])


class AnswerListener:
    """One ``LISTEN gpuplane_answers`` connection per process, shared by every waiting call.

    A connection per waiting call would not scale: under 50 concurrent calls gunicorn's
    own connections plus one listener each went past PostgreSQL's default of 100
    connections. Here a daemon thread holds the only listener and counts notifications;
    a caller notes the count before writing its bind requests and waits for it to move,
    then reads the database (the truth). If the connection drops, the thread wakes every
    waiter (they re-read), reconnects, and wakes them again once it listens anew: a
    notification sent while it was not listening is lost, and that second re-read finds
    what it announced. So waiters need no timed re-read while it listens.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0
        self._thread: threading.Thread | None = None
        self._params: dict[str, Any] = {}
        self.listening = threading.Event()
        self._stop = threading.Event()

    def start(self) -> bool:
        """Start the thread once per process (PostgreSQL only); True while it listens."""
        if connection.vendor != "postgresql":
            return False
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._params = {**connection.get_connection_params(), "connect_timeout": 2}
                self._thread = threading.Thread(target=self._run, name="gpuplane-answer-listener", daemon=True)
                self._thread.start()
        return self.listening.wait(timeout=2)

    @property
    def count(self) -> int:
        with self._changed:
            return self._count

    def wait(self, seen: int, timeout: float) -> int:
        """Until the count passes ``seen`` or ``timeout`` seconds went by; the new count."""
        with self._changed:
            self._changed.wait_for(lambda: self._count > seen, timeout=timeout)
            return self._count

    def stop(self) -> None:
        """Close the listener (tests, and before a database is dropped); start() reopens it."""
        thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join(timeout=5)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(**self._params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {ANSWERS_CHANNEL}")
                    self.listening.set()
                    with self._changed:  # listening (again): waiters re-read what a gap may have hidden
                        self._count += 1
                        self._changed.notify_all()
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=0.5):
                            with self._changed:
                                self._count += 1
                                self._changed.notify_all()
            except psycopg.Error:
                log.warning("LISTEN %s failed; retrying in 1 s", ANSWERS_CHANNEL, exc_info=True)
            self.listening.clear()
            with self._changed:  # wake waiters: they re-read the database
                self._count += 1
                self._changed.notify_all()
            self._stop.wait(1)


ANSWERS = AnswerListener()


def listening() -> AnswerListener | None:
    """The process's answer listener when it is listening (PostgreSQL), else None: poll."""
    return ANSWERS if ANSWERS.start() else None

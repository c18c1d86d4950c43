"""Single flight: one read at a time, shared by every caller that waits for it.

Both of a web process's shared reads go through it: the read model's follow of the
change feed (``binder.runtime.readmodel``) and the webhook's read of the answers its
waiting calls want (``webhooks.binding.AnswerReads``). A caller needs a read that began
after it arrived (what was committed before it asked is then in it); when one is already
running it may have begun too early, so the caller waits for it to end and either takes
the next one's result or runs the next one itself. A read that fails serves no one: its
own caller gets the exception, and the others run their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def _began_after(result: object, fresh: bool) -> bool:
    return fresh


class SingleFlight[R]:
    """Runs one read at a time and hands its result to the callers it serves.

    ``lock`` is the flight's own condition: a caller may hold it to change what the next
    read reads (it is held while ``begin`` runs).
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._running = False
        self._started = 0
        self._finished = 0
        self._result: tuple[R] | None = None

    def run(self, begin: Callable[[], Callable[[], R]], served: Callable[[R, bool], bool] = _began_after) -> R:
        """The result of a read this caller may use.

        ``served(result, fresh)`` says whether the last successful read's ``result`` serves
        this caller; ``fresh`` is true when that read began after this call arrived (the
        default rule: only then). Otherwise this call waits for the read running, if any,
        and runs one itself: ``begin()`` (under :attr:`lock`) returns the read to run, and
        the read runs outside the lock.
        """
        with self.lock:
            arrived = self._started
            while True:
                if self._result is not None and served(self._result[0], self._finished > arrived):
                    return self._result[0]
                if not self._running:
                    break
                self.lock.wait()
            self._running = True
            self._started += 1
            mine = self._started
            read = begin()
        ok = False
        try:
            result = read()
            ok = True
        finally:
            with self.lock:
                self._running = False
                if ok:
                    self._finished, self._result = mine, (result,)
                self.lock.notify_all()
        return result

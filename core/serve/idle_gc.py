"""The cyclic garbage collector run between requests instead of inside them.

CPython starts a collection from whatever allocation crosses the youngest generation's
threshold, so in a serving process a collection lands inside some request and adds its
whole length to that request's latency.  :class:`IdleCollector` switches the automatic
collector off and runs the same collections on a background thread right after a request
that crossed the threshold, holding the engine's request lock: a collection then runs while the engine is idle, and a
request that arrives meanwhile waits for the rest of it instead of carrying all of it.

Which generation is collected follows CPython's own rule (the oldest generation whose count
exceeds its threshold), so the collections are the ones the interpreter would have run,
only at another moment.  The collector is switched off process-wide while any
:class:`IdleCollector` is open and switched back on when the last one closes.

Details: docs/serving.md (## The collector between requests).
"""

from __future__ import annotations

import gc
import threading
from typing import ContextManager

#: Open collectors in this process (the automatic collector is off while there is one).
_open = 0
_open_lock = threading.Lock()
#: Whether the automatic collector was on when the first collector opened (restored after the last).
_was_enabled = True


def due_generation() -> int | None:
    """The generation CPython's automatic collector would collect now (the oldest whose
    count exceeds its threshold), or None when no collection is due."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1, 0):
        if thresholds[generation] and counts[generation] > thresholds[generation]:
            return generation
    return None


class IdleCollector:
    """Collections off the request path: call :meth:`after_request` when a request is done;
    :meth:`close` stops the thread (and switches the automatic collector back on when no
    other collector is open).  ``lock`` is the engine's request lock, held during a
    collection."""

    def __init__(self, lock: ContextManager[object]):
        global _open, _was_enabled
        self._lock = lock
        self._due = threading.Event()
        self._closed = False
        #: Collections run, by generation (a test and the metrics read them).
        self.collections = [0, 0, 0]
        with _open_lock:
            if _open == 0:
                _was_enabled = gc.isenabled()
            _open += 1
            gc.disable()
        self._thread = threading.Thread(target=self._run, name="rwb-gc", daemon=True)
        self._thread.start()

    def after_request(self) -> None:
        """Wake the collector thread when a collection is due (cheap when none is)."""
        if due_generation() is not None:
            self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            with self._lock:
                generation = due_generation()
                if generation is not None:
                    gc.collect(generation)
                    self.collections[generation] += 1

    def close(self) -> None:
        """Stop the thread; the last open collector switches the automatic collector back on
        (when it was on before the first one opened)."""
        global _open
        if self._closed:
            return
        self._closed = True
        self._due.set()
        self._thread.join(timeout=10)
        with _open_lock:
            _open -= 1
            if _open == 0 and _was_enabled:
                gc.enable()


__all__ = ["IdleCollector", "due_generation"]

"""One heartbeat thread per process renews the lease of every attempt running in it.

One thread, not one per task: starting a thread per task costs more than a trivial task, and
most attempts end before their first renewal (every lease/3) is due. The thread is started
lazily in the process that runs bodies, so it is never inherited across fork.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from celery_ledger.attempt import Attempt
from celery_ledger.ledger import LedgerError

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self) -> None:
        self._attempts: dict[int, tuple[Attempt, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = -1
        #: When the thread will next wake by itself; a registration due earlier wakes it.
        self._next_wake = 0.0

    def register(self, attempt: Attempt) -> None:
        due = time.monotonic() + attempt.lease_seconds / 3
        with self._lock:
            self._attempts[id(attempt)] = (attempt, due)
            if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="ledger-heartbeat", daemon=True
                )
                self._thread.start()
            # Waking the thread for every task would cost a context switch per task; most
            # attempts end long before their first renewal, which the sleeping thread meets.
            wake = due < self._next_wake
        if wake:
            self._wake.set()

    def unregister(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempts.pop(id(attempt), None)

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            with self._lock:
                due = [a for a, d in self._attempts.values() if d <= now]
            for attempt in due:
                self._renew(attempt)
            with self._lock:
                # Computed under the lock that register() takes, so a registration either
                # is seen here or sees the _next_wake set here (and wakes the thread).
                upcoming = [d for _, d in self._attempts.values()]
                left = (min(upcoming) - time.monotonic()) if upcoming else 5.0
                wait = max(0.05, min(left, 5.0))
                self._next_wake = time.monotonic() + wait
            self._wake.wait(timeout=wait)
            self._wake.clear()

    def _renew(self, attempt: Attempt) -> None:
        next_due = time.monotonic() + attempt.lease_seconds / 3
        try:
            ok = attempt.renew_lease()  # False: superseded, and marked so
        except LedgerError as exc:
            # Keep trying: the lease may still outlive the outage. If it does not, the
            # sweep interrupts the entry and the fence stops this attempt's writes.
            log.warning(
                "heartbeat for key=%s task_id=%s fence=%s failed: %s",
                attempt.key,
                attempt.task_id,
                attempt.fence,
                exc,
            )
            next_due = time.monotonic() + min(1.0, attempt.lease_seconds / 6)
            ok = True
        with self._lock:
            if id(attempt) in self._attempts and ok:
                self._attempts[id(attempt)] = (attempt, next_due)
            elif not ok:
                self._attempts.pop(id(attempt), None)


heartbeat = Heartbeat()

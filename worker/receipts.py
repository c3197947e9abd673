"""Holding the publish intents of the messages a worker has received and not started yet.

A worker's parent fetches messages before its pool processes claim them: prefetched ones wait
for a free pool process, countdown ones wait in its timer. If the whole worker is SIGKILLed
while they wait, Redis keeps them in its ``unacked`` hash until ``visibility_timeout`` (one
hour by default) and ``filesystem://`` forgets them; their entries are publish intents whose
lease (``ledger_publish_intent_seconds``) measures a queue backlog, not a worker's life.

So the parent holds what it received: once a ledgered message has waited ``HOLD_AFTER``
(50 ms) without a pool process accepting it, and every lease/3 while it waits on, one
statement sets the lease of its intent to the task's lease (``LedgerStore.hold_intents``). A
dead worker renews nothing: its held intents expire within the lease and the sweep re-sends
them, so a stranded message is found within lease + sweep interval, as the promise says, on
every broker. When a pool process accepts the message its claim takes the entry over, and the
hold ends (the store reports the key no longer held).

One thread per worker parent, off Celery's event loop, and one write for every key that came
due together. A message a pool process accepts at once (the usual case with prefetch 1: a
message is fetched when a pool process is free) costs nothing; measured, holding every message
at once cost the worker a third statement per task (``benchmarks/throughput.py``). A message
fetched less than ``HOLD_AFTER`` (plus one write) before the worker's death is still covered by
its intent's own lease.

**A message with no intent** (design.md § "One envelope, one admission gate"): a producer that does
not know the task's
class (``send_task`` by name from a service without the ``LedgerTask``) records none, and a
hold of nothing holds nothing. The worker's parent knows the class of every message it
receives, so a hold may bring a ``record`` callable (``LedgerRequest._record_intent``): when
the first write of a key finds no intent to hold, the callable records one (insert if absent,
one statement: ``LedgerStore.record_intent``) and the same pass holds it. It costs nothing per
message where it is not needed: a message accepted within ``HOLD_AFTER`` is never written (its
claim makes the entry), a producer's own intent is held by the one batched write as before,
and the callable runs in this thread only for a key that write did not hold, once. A key
already claimed or ended makes it a no-op insert.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_ledger import runtime
from celery_ledger.ledger import LedgerError

log = logging.getLogger(__name__)

#: A held key is renewed this often, as a fraction of its lease (the heartbeat's rhythm).
RENEW_FRACTION = 1 / 3
#: After a failed write, try again this soon (the lease may outlive a short outage).
RETRY_AFTER = 1.0
#: A received message is held once it has waited this long unaccepted: a pool process that
#: is free accepts it within milliseconds, and its claim then makes the hold needless.
HOLD_AFTER = 0.05


#: Records the intent of a held message that has none; True when it recorded one.
Recorder = Callable[[], bool]


class Receipts:
    """The intents one worker parent holds: key -> (app, lease, next renewal, recorder: the
    ``record`` of a key not written yet, None once written)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, float, float, Recorder | None]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = -1
        #: When the thread will next wake by itself; a hold due earlier wakes it.
        self._next_wake = 0.0

    def hold(
        self, app: Any, key: str, lease_seconds: float, record: Recorder | None = None
    ) -> None:
        """Hold ``key`` from ``HOLD_AFTER`` from now until ``release``; if the first write
        finds no intent of ``key`` to hold, ``record`` (if given) records one, in this
        module's thread (it must never raise)."""
        due = time.monotonic() + HOLD_AFTER
        with self._lock:
            self._held[key] = (app, lease_seconds, due, record)
            # Waking the thread for every message would cost a context switch per task; a
            # thread already due within one more HOLD_AFTER meets this hold on its own.
            wake = due + HOLD_AFTER < self._next_wake
            if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
                # Started lazily in the process that receives: never inherited across fork.
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="ledger-receipts", daemon=True
                )
                self._thread.start()
        if wake:
            self._wake.set()

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [(k, a, lease) for k, (a, lease, at, _) in self._held.items() if at <= now]
            by_app: dict[int, tuple[Any, float, list[str]]] = {}
            for key, app, lease in due:
                by_app.setdefault(id(app), (app, lease, []))[2].append(key)
            for app, lease, keys in by_app.values():
                self._write(app, lease, keys)
            with self._lock:
                # Under the lock hold() takes: a hold either is seen here or sees this
                # _next_wake (and wakes the thread).
                upcoming = [at for _, _, at, _ in self._held.values()]
                left = (min(upcoming) - time.monotonic()) if upcoming else 5.0
                wait = max(0.01, min(left, 5.0))
                self._next_wake = time.monotonic() + wait
            self._wake.wait(timeout=wait)

    def _write(self, app: Any, lease: float, keys: list[str]) -> None:
        store = runtime.store_for(app)
        try:
            still = set(store.hold_intents(keys, lease))
            recorded = self._record_missing([k for k in keys if k not in still])
            if recorded:
                still |= set(store.hold_intents(recorded, lease))
        except LedgerError as exc:
            log.warning("could not hold %d received intent(s): %s", len(keys), exc)
            again = time.monotonic() + RETRY_AFTER
            with self._lock:
                for key in keys:
                    if key in self._held:
                        a, lease_s, _, record = self._held[key]
                        self._held[key] = (a, lease_s, again, record)
            return
        next_at = time.monotonic() + lease * RENEW_FRACTION
        with self._lock:
            for key in keys:
                if key not in self._held:
                    continue
                if key in still:
                    a, lease_s, _, _ = self._held[key]
                    self._held[key] = (a, lease_s, next_at, None)
                else:  # claimed, swept, or never an intent: nothing left to hold
                    del self._held[key]

    def _record_missing(self, keys: list[str]) -> list[str]:
        """Record the intents of ``keys`` (not held by the write just made) whose holds bring
        a recorder and were never written: the keys it recorded. A recorder is run once."""
        with self._lock:
            found: list[tuple[str, Recorder]] = []
            for key in keys:
                held = self._held.get(key)
                if held is None:
                    continue
                app, lease, at, record = held
                if record is None:
                    continue
                found.append((key, record))
                self._held[key] = (app, lease, at, None)
        recorded = []
        for key, record in found:
            try:
                if record():
                    recorded.append(key)
            except Exception as exc:  # noqa: BLE001 - this thread holds every other key too
                log.warning("no intent recorded for received key=%s: %r", key, exc)
        return recorded


receipts = Receipts()

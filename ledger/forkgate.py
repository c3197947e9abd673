"""Forks wait for this process's SQLite transactions (design.md § "The embedded default's
pool").

SQLite keeps a process's file locks in memory, by file, and a fork copies that memory. A
process forked while another of its threads held a transaction on the ledger's file inherits
the bookkeeping of a lock it does not hold: SQLite in the child believes a connection of its
own holds the write lock, and every write the child tries waits out its busy timeout and
fails with "database is locked", for the child's whole life. A worker's parent writes the
ledger from threads of its own (holding received messages, marking a lost pool process's
entry) while billiard forks pool processes from another thread: a pool process forked at that
instant never claimed a task.

So each use of a SQLite connection holds an entry in ``GATE`` (the engine's pool: from
checkout to checkin or detach; the hot path: one unit of work), and a fork waits until no
entry is held and lets none begin until it is done (``os.register_at_fork``). It waits at
most ``FORK_WAIT`` seconds, then forks anyway and logs it: a connection that is never given
back must not stop a worker from replacing its pool processes. PostgreSQL connections are not
gated: a server session keeps no lock in the client's memory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: The longest a fork waits for the transactions in flight (a ledger transaction lasts
#: milliseconds; SQLite's busy timeout is the only long wait inside one).
FORK_WAIT = 35.0


class ForkGate:
    """Entries (each a use of a SQLite connection) and forks, which exclude each other."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside: set[Hashable] = set()
        self._forced = 0

    def enter(self, key: Hashable) -> None:
        """``key`` is using a connection (waits while a fork is under way)."""
        with self._cond:
            self._inside.add(key)

    def leave(self, key: Hashable) -> None:
        """``key`` is done (a key that never entered, or left already, is ignored)."""
        with self._cond:
            self._inside.discard(key)
            if not self._inside:
                self._cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[None]:
        """One entry for the duration of the block."""
        key = object()
        self.enter(key)
        try:
            yield
        finally:
            self.leave(key)

    def before_fork(self) -> None:
        """Hold the gate across the fork, once every entry has left (or ``FORK_WAIT``)."""
        self._cond.acquire()
        deadline = time.monotonic() + FORK_WAIT
        while self._inside:
            left = deadline - time.monotonic()
            if left <= 0:
                # Given up on: an entry that never left must not make every later fork wait.
                self._forced = len(self._inside)
                self._inside.clear()
                return
            self._cond.wait(left)

    def after_fork_in_parent(self) -> None:
        forced, self._forced = self._forced, 0
        self._cond.release()
        if forced:
            log.warning(
                "forked with %d SQLite connection(s) of the ledger still in use after %.0fs: "
                "the child may be unable to write the ledger until it is replaced",
                forced,
                FORK_WAIT,
            )

    def after_fork_in_child(self) -> None:
        # The parent's entries are the parent's; the inherited lock may be held.
        self.__init__()  # type: ignore[misc]  # a fresh gate in place


#: This process's gate (one per process: the bookkeeping it protects is per process).
GATE = ForkGate()

os.register_at_fork(
    before=GATE.before_fork,
    after_in_parent=GATE.after_fork_in_parent,
    after_in_child=GATE.after_fork_in_child,
)

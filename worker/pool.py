"""The blocking prefork pool, made to survive a pool process SIGKILLed while it holds one of
the pool's pipe locks (design.md § "The embedded default's pool").

Celery runs billiard's blocking pool when the broker has no event loop (``filesystem://``,
the embedded default): the pool processes share one job pipe and one result pipe, each
guarded by a semaphore. An idle pool process waits for its next job *inside* the job pipe's
read lock (``SimpleQueue.get_payload``). SIGKILLed there (the OOM killer, an operator, a
crash test), it never releases the semaphore, and every other pool process, including each
one forked to replace it, waits for it forever: the worker goes on receiving messages and
never runs another. The result pipe's write lock has the same hole, for the instant a pool
process writes a result.

``KillSafePool`` swaps those two semaphores for ``ProcessLock``: a POSIX record lock
(``fcntl.lockf``), which the kernel releases when its holder dies. A job still in the pipe when
its reader died is read by the next pool process. The event-loop pool (Redis, RabbitMQ) gives
each pool process pipes of its own and is left alone.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from typing import Any

from billiard.pool import Pool as BlockingPool
from celery.concurrency.prefork import TaskPool

#: How often a timed ``ProcessLock.acquire`` tries again (billiard only times its acquires
#: at shutdown).
_RETRY = 0.01


class ProcessLock:
    """A lock between the processes of one pool that dies with its holder.

    A POSIX record lock on an anonymous file that every pool process inherits: it excludes
    other processes and the kernel drops it when the holder exits, however it exits. Within
    a process a ``threading.Lock`` excludes other threads (record locks do not), made anew in
    each process that uses it, so a thread of the parent that held it at a fork never leaves
    it held in the child.
    """

    def __init__(self) -> None:
        # Open for the pool's life: every process of it inherits the descriptor.
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 - not a block's file
        self._pid = os.getpid()
        self._threads = threading.Lock()

    def _local(self) -> threading.Lock:
        if self._pid != os.getpid():
            self._pid, self._threads = os.getpid(), threading.Lock()
        return self._threads

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        """``multiprocessing.Lock.acquire``'s signature and meaning."""
        local = self._local()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not local.acquire(block, -1 if timeout is None else timeout):
            return False
        try:
            if block and timeout is None:
                fcntl.lockf(self._file, fcntl.LOCK_EX)
                return True
            while True:
                try:
                    fcntl.lockf(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except OSError:
                    if not block or (deadline is not None and time.monotonic() >= deadline):
                        local.release()
                        return False
                    time.sleep(_RETRY)
        except BaseException:
            local.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self._file, fcntl.LOCK_UN)
        self._local().release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class KillSafePool(BlockingPool):
    """billiard's blocking pool whose shared pipe locks die with their holder."""

    def _setup_queues(self) -> None:
        super()._setup_queues()
        # The locks a pool process holds: the job pipe's read lock (while it waits for a
        # job) and the result pipe's write lock (while it writes a result). The parent alone
        # writes jobs and reads results.
        self._inqueue._rlock = ProcessLock()
        self._outqueue._wlock = ProcessLock()


class LedgerTaskPool(TaskPool):
    """Celery's prefork pool, its blocking variant ``KillSafePool``."""

    BlockingPool = KillSafePool


def use_kill_safe_pool(worker: Any) -> None:
    """At ``worker_init``, before the pool is built: a worker on Celery's own prefork pool
    builds ``LedgerTaskPool`` instead (any other pool, ``-P threads`` or a custom one, is
    left as it is)."""
    if getattr(worker, "pool_cls", None) is TaskPool:
        worker.pool_cls = LedgerTaskPool

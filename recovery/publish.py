"""Re-sends the broker must confirm: the sweep's resumes and a task's own WAIT re-queue.

A re-send replaces a message that is gone (the sweep re-enqueues interrupted work) or about
to be acked (a WAIT re-queues itself, then its delivery is acked). Counting one as sent when
the broker never took it would lose the task: the sweep would report it resumed while its lease
runs out, and the WAIT would ack the only copy. So these publishes wait for the broker's
answer:

- RabbitMQ (``amqp``): AMQP ``basic.publish`` is asynchronous, so the connection is put in
  publisher-confirm mode (kombu's ``confirm_publish``): each publish waits for the broker's
  ``basic.ack``, and a ``basic.nack`` or a closed channel raises;
- Redis and the other virtual transports: the publish is a command whose reply already says
  the broker took it (``LPUSH``, a file written), so the app's own connection is used.

One confirming connection per app and process, made on first use, never inherited across fork
(a socket shared by two processes corrupts both) and replaced after a failure. It is kept here,
keyed by the app (``Confirming``), never set on the app: the worker's one attribute on an app
is its ``LedgerRuntime`` (design.md § "Layout and the one import name"), which recovery cannot
import, and which reports this state as its ``publisher``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celery_ledger.recovery.ports import Publisher

_lock = threading.Lock()


@dataclass
class Confirming:
    """The confirmed-publish state of one app: whether its broker needs confirms (asked once,
    the same in every process), and this process's confirming connection."""

    #: Whether publishes on the app's broker are fire-and-forget unless confirmed (AMQP);
    #: None until first asked.
    needed: bool | None = None
    #: (pid, connection, the lock its publishes hold): made in the process that uses it, so a
    #: forked pool process, seeing another pid, makes its own (and a lock no thread holds).
    connection: tuple[int, Any, threading.Lock] | None = None

    def open_here(self) -> bool:
        """Whether this process holds a confirming connection."""
        return self.connection is not None and self.connection[0] == os.getpid()


#: App -> its ``Confirming``; an app that is garbage-collected drops its entry.
_confirming: weakref.WeakKeyDictionary[Any, Confirming] = weakref.WeakKeyDictionary()
#: id -> (app, its ``Confirming``) for a stand-in that cannot be weakly referenced (kept
#: alive, so that its id is never reused).
_pinned: dict[int, tuple[Any, Confirming]] = {}


def confirming(app: Publisher) -> Confirming:
    """``app``'s confirmed-publish state (made on first use). Celery's ``current_app`` proxy
    stands for the app it proxies."""
    unwrap = getattr(app, "_get_current_object", None)
    target: Any = unwrap() if callable(unwrap) else app
    with _lock:
        try:
            state = _confirming.get(target)
            if state is None:
                state = _confirming[target] = Confirming()
        except TypeError:  # no weak reference to it (a stand-in)
            state = _pinned.setdefault(id(target), (target, Confirming()))[1]
        return state


def confirms_needed(app: Publisher) -> bool:
    """Whether publishes on ``app``'s broker are fire-and-forget unless confirmed (AMQP)."""
    try:
        conn = app.connection_for_write()
        try:
            return str(conn.transport.driver_type) == "amqp"
        finally:
            conn.release()
    except Exception:  # noqa: BLE001 - an unknown transport: publish as the app does
        return False


@contextlib.contextmanager
def confirmed(app: Publisher) -> Iterator[Any]:
    """A connection whose publishes the broker confirms (None: the app's own will do).

    Pass it on as ``send_task(..., connection=conn)`` / ``apply_async(connection=conn)``. A
    publish on it that the broker refuses raises (``amqp.exceptions.MessageNacked``, or the
    channel error), and the connection is dropped so the next re-send opens a fresh one.
    """
    if not _needs_confirms(app):
        yield None
        return
    conn, lock = _connection(app)
    with lock:
        try:
            yield conn
        except BaseException:
            _drop(app, conn)
            raise


def _needs_confirms(app: Publisher) -> bool:
    state = confirming(app)
    if state.needed is None:
        state.needed = confirms_needed(app)
    return state.needed


def _connection(app: Publisher) -> tuple[Any, threading.Lock]:
    state = confirming(app)
    with _lock:
        cached = state.connection
        if cached is None or cached[0] != os.getpid():
            options = dict(app.conf.broker_transport_options or {}, confirm_publish=True)
            conn = app.connection_for_write(transport_options=options)
            cached = state.connection = (os.getpid(), conn, threading.Lock())
        return cached[1], cached[2]


def _drop(app: Publisher, conn: Any) -> None:
    state = confirming(app)
    with _lock:
        cached = state.connection
        if cached is not None and cached[1] is conn:
            state.connection = None
    with contextlib.suppress(Exception):
        conn.close()


def close(app: Publisher) -> None:
    """Close ``app``'s confirming connection in this process, if it has one."""
    cached = confirming(app).connection
    if cached is not None and cached[0] == os.getpid():
        _drop(app, cached[1])


class Batch:
    """Re-sends of one sweep over one producer (and so one connection), confirmed as above.

    ``send_task`` without a producer acquires one from the app's pool for every message, and
    a confirmed re-send builds a producer on the confirming connection each time; a sweep of a
    thousand entries paid that a thousand times. A batch takes the producer once and passes it
    to every ``send_task``. Where kombu can defer publishes (``Producer.batch``, kombu 5.7:
    Redis, as one pipeline without retries), the sends are buffered and ``flush()`` writes them
    in one round trip; it raises when the broker did not take them, and then no send since the
    last flush may be counted as sent. Elsewhere (RabbitMQ: each publish waits for its
    confirm) every ``send_task`` is sent when it returns, and ``flush()`` does nothing.

    A send that raises is that send's failure (the caller contains it per entry). Unbuffered,
    the producer (and a confirming connection) is dropped then, so the next send starts on a
    fresh one. Use as a context manager; leaving it flushes what is left.
    """

    #: Commands kombu may buffer before it flushes on its own; above any chunk a caller
    #: flushes itself, so that each flush is the caller's and its failure is reported.
    MAX_BUFFERED = 100_000

    def __init__(self, app: Publisher) -> None:
        self.app = app
        self._stack: contextlib.ExitStack | None = None
        self._producer: Any = None
        self._deferred: Any = None
        #: Queues (by the name the send gave, None for the default) declared on this producer.
        self._declared: set[Any] = set()

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._close(failed=exc_type is not None)

    @property
    def deferred(self) -> bool:
        """Whether sends wait for ``flush()`` (known once the first send opened the batch)."""
        return self._deferred is not None

    def send_task(self, name: str, **options: Any) -> None:
        """``app.send_task(name, **options)`` on the batch's producer.

        The first send to a queue declares it, as ``send_task`` always does; later sends to
        the same queue on the same producer pass ``declare=[]``: kombu would only find it in
        its per-connection cache of declared entities, after copying and binding the queue
        again (a fifth of ``send_task``'s CPU in a sweep of a thousand).
        """
        producer = self._open()
        queue = options.get("queue")
        if producer is not None:
            options["producer"] = producer
            if queue in self._declared:
                options["declare"] = []
        try:
            self.app.send_task(name, **options)
        except BaseException:
            if self._deferred is None:
                self._close(failed=True)
            raise
        if producer is not None:
            self._declared.add(queue)

    def flush(self) -> None:
        """Write the buffered sends; raises if the broker may not have taken them all."""
        if self._deferred is None:
            return
        try:
            self._deferred.flush()
        except BaseException:
            self._close(failed=True)
            raise

    def _open(self) -> Any:
        if self._stack is None:
            stack = contextlib.ExitStack()
            try:
                connection = stack.enter_context(confirmed(self.app))
                acquire = getattr(self.app, "producer_or_acquire", None)
                if connection is not None:
                    self._producer = self.app.amqp.Producer(connection, auto_declare=False)
                elif acquire is not None:
                    self._producer = stack.enter_context(acquire())
                    if getattr(self._producer, "supports_batch_publish", False):
                        self._deferred = stack.enter_context(
                            self._producer.batch(max_size=self.MAX_BUFFERED)
                        )
                else:  # an app without a producer pool: let send_task do as it does
                    self._producer = None
            except BaseException:
                stack.close()
                self._producer = self._deferred = None
                raise
            self._stack = stack
        return self._producer

    def _close(self, *, failed: bool = False) -> None:
        stack, self._stack = self._stack, None
        self._producer = self._deferred = None
        self._declared = set()
        if stack is None:
            return
        if failed:
            # Through confirmed()'s except clause (the confirming connection is dropped) and
            # kombu's batch (what is still buffered is discarded, never half-sent later).
            with contextlib.suppress(BaseException):
                stack.__exit__(RuntimeError, RuntimeError("re-send failed"), None)
            return
        stack.close()

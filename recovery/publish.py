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
(a socket shared by two processes corrupts both) and replaced after a failure.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


def confirms_needed(app: Any) -> bool:
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
def confirmed(app: Any) -> Iterator[Any]:
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


def _needs_confirms(app: Any) -> bool:
    cached = getattr(app, "_ledger_confirms_needed", None)
    if cached is None:
        cached = confirms_needed(app)
        app._ledger_confirms_needed = cached
    return bool(cached)


def _connection(app: Any) -> tuple[Any, threading.Lock]:
    with _lock:
        cached = getattr(app, "_ledger_confirmed", None)
        if cached is None or cached[0] != os.getpid():
            options = dict(app.conf.broker_transport_options or {}, confirm_publish=True)
            conn = app.connection_for_write(transport_options=options)
            cached = (os.getpid(), conn, threading.Lock())
            app._ledger_confirmed = cached
        return cached[1], cached[2]


def _drop(app: Any, conn: Any) -> None:
    with _lock:
        cached = getattr(app, "_ledger_confirmed", None)
        if cached is not None and cached[1] is conn:
            app._ledger_confirmed = None
    with contextlib.suppress(Exception):
        conn.close()


def close(app: Any) -> None:
    """Close ``app``'s confirming connection in this process, if it has one."""
    cached = getattr(app, "_ledger_confirmed", None)
    if cached is not None and cached[0] == os.getpid():
        _drop(app, cached[1])

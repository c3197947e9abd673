"""Operator actions as Celery events: ``task-ledger-released`` and ``task-ledger-marked-dead``.

A release or a ``mark-dead`` happens in the CLI's process or in Flower's, not in a worker, so
no task event would tell Flower's task list about it: a task released ``completed`` would stay
``LEDGER-BLOCKED`` there for good. The operator's process sends the event itself, about the
entry's task id, the way a worker sends ``task-ledger-*`` (fire-and-forget, ``retry=False``;
failing to send never fails the action). Off when ``ledger_send_events`` is explicitly False.
The event carries the key, the fence, the verdict and who acted; never the reason text.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ledger import runtime

log = logging.getLogger(__name__)


def announce(app: Any, kind: str, *, task_id: str, key: str, fence: int, **fields: Any) -> None:
    """Send ``task-ledger-<kind>`` for ``task_id``; best effort, never raises."""
    try:
        if runtime.settings_for(app).send_events is False:
            return
        with app.connection_for_write() as conn:
            # Bounded: a broker that is down must not hold up the operator's command (kombu
            # otherwise retries the connection without end when the channel is first used).
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.5, timeout=5)
            dispatcher = app.events.Dispatcher(conn, enabled=True)
            try:
                dispatcher.send(
                    f"task-ledger-{kind}", uuid=task_id, key=key, fence=fence, retry=False, **fields
                )
            finally:
                dispatcher.close()
    except Exception as exc:  # noqa: BLE001 - monitoring never fails an operator's action
        log.debug("could not send task-ledger-%s for key=%s: %r", kind, key, exc)

"""The one way recovery sends a task again: its message, built from the entry's envelope.

Every path that re-sends goes through ``message``: the sweep's resume (interrupted entries,
publish intents whose message was lost), the boot sweep, the overdue-retry re-send and the
wake pass. Each once carried its own subset of the producer's message; a task that Celery had
discarded as expired came back without its ``expires`` and charged the card. Now each carries
the whole envelope (``ledger.envelope``) and the entry's deadline, so the re-sent message is
the one the producer meant:

| path | caller | what it sends |
|---|---|---|
| resume (sweep, boot sweep) | ``resume_entry``, ``resume_batch`` | envelope, deadline |
| overdue retry | ``resume.resend_retry`` | the retry's envelope, deadline |
| wake (held countdown, sleep) | ``wake.wake_entry`` | envelope, deadline |

| outbox child (``self.send``) | ``outbox.send_child`` | the child's envelope; see below |

An outbox child's envelope is the signature the step recorded. Its message is not marked as the
ledger's re-send: it is the child's first, whose publisher records the child's intent; and it
keeps the child's own ``countdown`` and ``expires``, as the step gave them.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery_ledger.ledger import Envelope, wire
from celery_ledger.recovery.ports import Publisher
from celery_ledger.recovery.publish import Batch


def message(
    task_id: str,
    envelope: Envelope,
    *,
    deadline_at: float | None = None,
    extra_headers: dict[str, Any] | None = None,
    redelivery: bool = True,
) -> dict[str, Any]:
    """The ``send_task`` options (besides the task name) that send ``envelope`` again under
    ``task_id``: its arguments, routing, priority, limits, the user's headers, its place in a
    canvas, its retry count, and the deadline as both the ``ledger_deadline`` header (read by
    the claim on the database clock) and Celery's ``expires`` (so a worker discards it, as
    Celery would, if it waits in a backlog past its deadline).

    ``redelivery=False`` (an outbox child's publish): the message is that child's first, with
    no entry yet, so it is not marked as the ledger's re-send and its publisher records its
    intent as any publish does."""
    options = dict(envelope.options)
    headers: dict[str, Any] = {
        **dict(options.pop("headers", None) or {}),
        **(extra_headers or {}),
    }
    if redelivery:
        headers[wire.REDELIVERY] = True
    if envelope.ledger_key is not None:
        headers[wire.KEY] = envelope.ledger_key
    sent: dict[str, Any] = {"task_id": task_id, **options, "headers": headers}
    if envelope.queue:
        sent["queue"] = envelope.queue
    if envelope.retries:
        sent["retries"] = envelope.retries
    if deadline_at is not None:
        headers[wire.DEADLINE] = deadline_at
        sent["expires"] = datetime.fromtimestamp(deadline_at, tz=timezone.utc)
    # Its place in a canvas: the rest of its chain, its callbacks, its chord and group.
    sent.update(envelope.canvas)
    sent["args"] = list(envelope.args)
    sent["kwargs"] = dict(envelope.kwargs)
    return sent


def send_on(
    batch: Batch,
    name: str,
    task_id: str,
    envelope: Envelope,
    *,
    deadline_at: float | None = None,
    extra_headers: dict[str, Any] | None = None,
) -> None:
    """Send ``envelope`` again on a batch's producer (one connection for a whole sweep).

    Confirmed by the broker (``recovery.publish``): a re-send it never took raises here and is
    not counted as sent; the lease the caller's compare-and-set took brings the entry back to
    the next sweep.
    """
    options = message(task_id, envelope, deadline_at=deadline_at, extra_headers=extra_headers)
    batch.send_task(name, **options)


def send(
    app: Publisher,
    name: str,
    task_id: str,
    envelope: Envelope,
    *,
    deadline_at: float | None = None,
    extra_headers: dict[str, Any] | None = None,
) -> None:
    """``send_on`` a batch of one, flushed."""
    with Batch(app) as batch:
        send_on(
            batch,
            name,
            task_id,
            envelope,
            deadline_at=deadline_at,
            extra_headers=extra_headers,
        )
        batch.flush()

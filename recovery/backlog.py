"""Re-sends that know the original message may still be queued.

A publish intent, or a resume, whose lease lapses before any worker claims it proves only that
no worker took the message *yet*: the message may be lost (``filesystem://`` after a kill, a
Redis restart without persistence), or it may wait behind a backlog. Re-sending it every lease
period while a backlog lasts added a copy of every waiting task each period: a backlog that
multiplies itself (50 tasks became 320 messages in 16 s with 2 s leases). Two rules stop that,
for an entry no attempt ever claimed (``executions == 0``; one that ran was lost with its
worker, and its resume is not a guess):

- **The broker's own evidence.** Before re-sending, the sweep asks the broker how many messages
  wait in the entry's queue (a passive declare: ``LLEN`` on Redis, the message count on
  RabbitMQ). A queue that holds messages may hold this one: the entry is *deferred*, its lease
  taken again without a send (event ``deferred``). An empty queue means the message is gone:
  it is re-sent. A broker that cannot say (an error, a transport without counts) is no
  evidence: the re-send goes ahead, under the back-off.
- **Growing back-off.** Each lease taken for such an entry lasts as long as the entry has
  already waited (at least one lease, at most ``RESEND_BACKOFF_CAP``): doubling, so a backlog
  of D seconds costs at most log2(D / lease) blind re-sends, not D / lease.

Neither rule delays the recovery of work a worker had claimed, and a deferred entry is still
found by every sweep: when its queue drains and its message was lost, the next lapse re-sends
it.
"""

from __future__ import annotations

import logging
import math

from celery_ledger.recovery.ports import Publisher

log = logging.getLogger(__name__)

#: The longest lease a deferred or blindly re-sent entry takes (seconds): a message lost
#: behind a long backlog is re-sent at most this long after the backlog's evidence went away.
RESEND_BACKOFF_CAP = 3600.0


def backoff_lease(lease_seconds: float, waited: float) -> float:
    """The lease for an entry no attempt claimed yet that has waited ``waited`` seconds: the
    next power of two of ``waited``, within [``lease_seconds``, ``RESEND_BACKOFF_CAP``].
    Powers of two, so that a sweep's entries fall in a few groups (one statement each)."""
    if waited <= lease_seconds:
        return lease_seconds
    doubled = 2.0 ** math.ceil(math.log2(waited))
    return max(lease_seconds, min(doubled, RESEND_BACKOFF_CAP))


class QueueDepths:
    """The broker's count of waiting messages per queue, asked once per queue per sweep."""

    def __init__(self, app: Publisher) -> None:
        self.app = app
        self._seen: dict[str, int | None] = {}

    def of(self, queue: str | None) -> int | None:
        """Messages waiting in ``queue`` (None: the task's default queue); None when the
        broker cannot say."""
        conf = getattr(self.app, "conf", None)
        name = queue or getattr(conf, "task_default_queue", None)
        if not name:
            return None
        if name not in self._seen:
            self._seen[name] = _ask(self.app, name)
        return self._seen[name]


def _ask(app: Publisher, queue: str) -> int | None:
    try:
        with app.connection_for_write() as conn:
            # passive: never create the queue; a missing one raises (RabbitMQ closes the
            # channel), and this connection is thrown away with it.
            ok = conn.default_channel.queue_declare(queue=queue, passive=True)
        return int(ok.message_count)
    except Exception as exc:  # noqa: BLE001 - no evidence: the re-send goes ahead
        log.debug("queue depth of %s unknown: %r", queue, exc)
        return None

"""The handover of a concurrency key's free slots (docs/concurrency.md), and its wake.

A waiter the ledger serves (a holder's ``LedgerStore.settle_in_slot``, or ``hand_over``) is
``sleeping`` and due now; it is sent by the durable-time pass's own wake (``wake.wake_entry``:
the CAS to running under the resume marker, then the stored envelope, whose claim passes the
admission gate and finds the slot its own). Who sends it:

- the worker, right after the settle of a task that held a slot, which served the waiters in
  its own transaction (``wake_granted``), or after a run that ended without a settle
  (``hand_over``; ``celery_ledger.concurrency``);
- the sweep, after it interrupted expired leases (``hand_over_all``): the backstop for a
  holder that died (its slot came back with the interrupt) and for a worker that died after
  its settle, before it sent the waiters it served. The sweep's wake pass sends those.

A wake that fails (a broker refusal, this process dying) leaves the waiter due: the next
sweep's wake sends it. A lost race with another waker is nothing: exactly one CAS wins.
"""

from __future__ import annotations

import logging

from celery_ledger.ledger import EntryStatus, LedgerUnavailable, SnapshotCipher
from celery_ledger.ledger.slots import Granted
from celery_ledger.recovery.handoff import ResumeOutcome
from celery_ledger.recovery.ports import Publisher, SlotStore
from celery_ledger.recovery.wake import wake_entry

log = logging.getLogger(__name__)


def hand_over(
    store: SlotStore,
    app: Publisher,
    concurrency_key: str,
    *,
    limit: int | None,
    lease_seconds: float,
    actor: str,
    cipher: SnapshotCipher | None = None,
) -> int:
    """Serve the oldest waiters of ``concurrency_key`` with its free slots and send them now.
    Returns how many were sent (the others are due: the sweep sends them)."""
    granted = store.hand_over(concurrency_key, limit=limit, actor=actor)
    return wake_granted(
        store, app, granted, lease_seconds=lease_seconds, actor=actor, cipher=cipher
    )


def wake_granted(
    store: SlotStore,
    app: Publisher,
    granted: list[Granted],
    *,
    lease_seconds: float,
    actor: str,
    cipher: SnapshotCipher | None = None,
) -> int:
    """Send each served waiter (``wake.wake_entry``), contained per entry; returns how many
    were sent. An unavailable ledger ends it: the sweep sends the rest."""
    sent = 0
    for g in granted:
        try:
            outcome = wake_entry(
                store,
                app,
                g.key,
                g.fence,
                EntryStatus.SLEEPING,
                g.snapshot,
                task_id=g.task_id,
                lease_seconds=lease_seconds,
                actor=actor,
                cipher=cipher,
            )
        except LedgerUnavailable:
            raise
        except Exception:
            log.exception(
                "could not wake key=%s fence=%s for its slot; the sweep will", g.key, g.fence
            )
            continue
        sent += outcome is ResumeOutcome.RESUMED
    return sent


__all__ = ["hand_over", "wake_granted"]

"""The hand-off every recovery path shares, before it sends an entry back to Celery.

The sweep's resume (``sweep``), the overdue-retry re-send and the wake pass (``wake``) each
read the entry's argument snapshot (``read_snapshot``), park an entry whose snapshot no process
can read (``park_unreadable``), settle ``expired`` instead of sending what is past its deadline
(``expire_passed``), and report a ``ResumeOutcome``. They live here, not in ``sweep``, so that
``wake`` need not import ``sweep`` (which runs the wake pass) for them: a cycle that an import
inside ``run_sweep`` once hid.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum

from kombu.utils.json import loads

from celery_ledger.ledger import (
    ArgumentSnapshot,
    EntryStatus,
    SnapshotCipher,
    open_snapshot,
)
from celery_ledger.ledger.admission import expired_failure
from celery_ledger.recovery.ports import ResumeQueries, TimeQueries

log = logging.getLogger(__name__)


class ResumeOutcome(str, Enum):
    """What ``resume_entry`` did with one interrupted entry."""

    #: Re-enqueued with its original task id and argument snapshot.
    RESUMED = "resumed"
    #: Parked for an operator: a crash loop (the ledger's crash-loop rule), or an argument
    #: snapshot no process can read.
    BLOCKED = "blocked"
    #: No argument snapshot to re-send from: reported, never guessed; it stays interrupted.
    NO_SNAPSHOT = "no-snapshot"
    #: Another resumer (a sweep, a claim) moved the entry first, or the broker refused the
    #: message; the lease recovery took brings it back to the next sweep.
    LOST_RACE = "lost-race"
    #: No worker claimed it yet and its queue holds messages: its message likely still
    #: waits there. Its lease is taken again (backing off) and nothing is sent.
    DEFERRED = "deferred"


class UnreadableSnapshot(ValueError):
    """Raised when a stored argument snapshot cannot be decoded (the reason says why)."""


def read_snapshot(text: str, cipher: SnapshotCipher | None = None) -> ArgumentSnapshot:
    """The ``ArgumentSnapshot`` that a stored snapshot (kombu's JSON, sealed or not) holds.

    Raises:
        UnreadableSnapshot: it does not decode (too deeply nested, not JSON, not an object).
        SnapshotSealError: it is sealed and ``cipher`` cannot open it.
    """
    text = open_snapshot(text, cipher)
    try:
        # The worker encoded it with kombu's JSON (celery_ledger.codec.encode_snapshot).
        data = loads(text)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return ArgumentSnapshot.from_data(data)
    except RecursionError:
        raise UnreadableSnapshot("nested too deeply for any Python process to decode") from None
    except Exception as exc:  # noqa: BLE001 - whatever the decoder says, it is unreadable
        raise UnreadableSnapshot(f"{type(exc).__name__}: {str(exc)[:200]}") from None


def park_unreadable(
    store: ResumeQueries,
    key: str,
    task_id: str,
    fence: int,
    reason: str,
    *,
    status: EntryStatus,
    actor: str,
) -> ResumeOutcome:
    """Park ``key`` ``blocked`` with ``reason`` (its snapshot cannot be read) while it is still
    ``status`` at ``fence``: BLOCKED, or LOST_RACE when it moved on.

    Why parked: nothing can ever re-send it (no process decodes it, the broker's copy
    included), so an operator must decide, and ``show`` tells them why.
    """
    if not store.block(key, fence, reason, actor=actor, from_status=status):
        return ResumeOutcome.LOST_RACE
    log.warning("blocked key=%s task_id=%s fence=%s: %s", key, task_id, fence + 1, reason)
    return ResumeOutcome.BLOCKED


def expire_passed(store: TimeQueries, keys: Sequence[str], *, actor: str) -> set[str]:
    """Settle ``expired`` those of ``keys`` (about to be sent again) whose deadline passed and
    that no live attempt holds (``LedgerStore.expire_passed``); returns their keys."""
    done = store.expire_passed(
        keys, expired_failure("the deadline passed before it could be sent again"), actor=actor
    )
    for key in done:
        log.warning("expired key=%s: its deadline passed before recovery could re-send it", key)
    return done

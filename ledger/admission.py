"""The admission gate: one rule for whether a delivery is admitted and whether an effect begins.

The rule: **nothing is admitted, and no effect begins, while a cancellation is pending, once
the deadline has passed on the database clock, or for a tombstone.** It is asked at every door:

- **a claim** (a first delivery, a publish intent's, a retry's, a takeover's, a resume's, a
  wake's): ``HotPath.claim`` asks ``refusal`` of the row it locked, and a new row's insert
  returns whether its deadline passed;
- **an effect step's ``started`` write**: ``open_predicates`` in the write's own ``WHERE``
  (``statements.live_entry``);
- **a transaction step's commit** (SQLAlchemy, Django): the same predicates, in the commit's
  own fenced write (``TransactionSteps``).

A claim that is refused settles the entry ``cancelled`` or ``expired`` in the claim's own
transaction and answers RETURN with the stored failure: the delivery raises ``TaskCancelled``
or ``TaskExpired`` and runs nothing, so a body without steps is stopped here, before it runs.
A tombstone is settled already, so the claim's RETURN gate refuses it without asking.

**Deadlines only tighten.** Every write of a deadline stores the earliest of the one stored and
the one offered (``earliest``), never a later one: a resume, a retry or a re-send that carries
no deadline, or a later one, cannot give an expired task more time.

**One clock.** A relative deadline (Celery's numeric ``expires`` as the producer passed it, the
task's ``deadline`` option) becomes an absolute time on the database clock in the statement
that stores it. An absolute one (an ``expires`` datetime, the ``ledger_deadline`` header) keeps
the producer's meaning: the producer's clock named that instant (docs/design.md, "Deadlines").
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from sqlalchemy import Float, case, cast

from celery_ledger.ledger.errors import (
    SHORT_MESSAGE_CHARS,
    KeyPruned,
    TaskCancelled,
    TaskExpired,
    stored_failure,
)
from celery_ledger.ledger.schema import entries


class Refusal(str, Enum):
    """Why the gate refused a delivery or an effect; the value is the status it settles."""

    #: A cancellation is pending (``request_cancel``: the CLI's ``cancel``, ``revoke()``).
    CANCELLED = "cancelled"
    #: The deadline passed on the database clock.
    EXPIRED = "expired"


def refusal(
    cancel_requested_at: float | None, deadline: float | None, now: float
) -> Refusal | None:
    """What the gate says of an entry whose row the caller holds locked: its pending
    cancellation, else its deadline (``deadline``, already tightened) against ``now`` (the
    database clock read in the same statement). None: admitted."""
    if cancel_requested_at is not None:
        return Refusal.CANCELLED
    if deadline is not None and deadline <= now:
        return Refusal.EXPIRED
    return None


def open_predicates(now: Any) -> list[Any]:
    """The gate as SQL predicates on the entries row, for a write that lets an effect begin
    (a ``started`` row, a transaction step's commit): no cancellation pending and the deadline
    (if any) still ahead of ``now`` (the database clock)."""
    return [
        entries.c.cancel_requested_at.is_(None),
        entries.c.deadline_at.is_(None) | (entries.c.deadline_at > now),
    ]


def earliest_of(*values: float | None) -> float | None:
    """The earliest of the deadlines that are given (None: none is)."""
    given = [v for v in values if v is not None]
    return min(given) if given else None


def earliest(stored: Any, offered: Any) -> Any:
    """SQL: the earlier of two deadline expressions, either of which may be NULL (neither
    ``LEAST`` on PostgreSQL nor ``min`` on SQLite treats NULL as "no deadline" the same way,
    hence the ``CASE``)."""
    return case(
        (stored.is_(None), offered),
        (offered.is_(None), stored),
        (offered < stored, offered),
        else_=stored,
    )


def offered_deadline(base: Any, at: Any, after: Any) -> Any:
    """SQL: the deadline a write offers: the earlier of ``at`` (an absolute time) and ``base``
    + ``after`` (``after`` seconds past the entry's creation, or past now for a new row), each
    a bind parameter that may be NULL. Typed casts: PostgreSQL cannot type a bare NULL
    parameter in ``$1 IS NULL``."""
    at_ = cast(at, Float)
    after_ = cast(after, Float)
    return earliest(at_, case((after_.is_(None), None), else_=base + after_))


# -- the failures a refused delivery raises --------------------------------------------------


def cancelled_failure(why: str) -> str:
    """The stored ``TaskCancelled`` of a cancellation settled outside any attempt."""
    return stored_failure(TaskCancelled(why[:SHORT_MESSAGE_CHARS]))


def expired_failure(why: str) -> str:
    """The stored ``TaskExpired`` of a deadline that passed outside any attempt."""
    return stored_failure(TaskExpired(why[:SHORT_MESSAGE_CHARS]))


def refused_failure(why: Refusal, detail: str) -> str:
    """The stored failure of a delivery the gate refused."""
    if why is Refusal.CANCELLED:
        return cancelled_failure(detail)
    return expired_failure(detail)


#: The stored failure of a tombstone that is not ``completed``.
PRUNED_FAILURE = stored_failure(
    KeyPruned(
        "this key settled (failed, cancelled or expired) and was pruned after the retention "
        "window; a late delivery does not run it again (ledger_tombstone_days)"
    )
)

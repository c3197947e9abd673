"""Durable signals (design.md § "Durable signals"): a payload sent to an entry, taken by exactly
one ``wait_for`` of its name.

- ``send_signal``: record the payload under the entry's row lock; an entry asleep in a wait
  for that name is made due now, so that the sweep's wake (``recovery.wake``) sends it.
- ``take_signal``: what the ``wait``-th wait for a name gets: the signal it took before (a
  replay), else the oldest no wait took, else a timeout once its deadline passed, else
  nothing yet. The unique (key, name, wait) index makes the take exactly once: a second
  taker for the same wait loses on the index and reads the first one's row.
- ``due_if_signalled``: the wait's own check after it settled ``sleeping``, closing the race
  with a signal sent while the attempt was still running.

A waiting entry is ``sleeping`` with its reason ``signal:<name>`` and ``due_at`` the wait's
deadline: no state of its own, so the sweep, ``resume``, ``cancel`` and the claim treat it
as any sleeper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, exists, insert, select, update
from sqlalchemy.exc import IntegrityError

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.errors import EntryNotFound, SignalRefused
from celery_ledger.ledger.schema import entries, signals
from celery_ledger.ledger.states import EntryStatus

#: The longest signal name: it is stored in the entry's reason while a wait sleeps.
MAX_SIGNAL_NAME_CHARS = 200

#: How far back a signal sets a waiting entry's due time: the wake that follows compares
#: ``due_at < now`` on a clock that SQLite reads to the millisecond, so "due now" is a
#: moment that has passed on every clock the ledger runs on.
_DUE_NOW_BACK_SECONDS = 1.0


def wait_reason(name: str) -> str:
    """The reason an entry asleep in ``wait_for(name)`` carries."""
    return f"signal:{name}"


def check_signal_name(name: Any) -> str:
    """``name`` if it can name a signal: a non-blank printable string of at most
    ``MAX_SIGNAL_NAME_CHARS``.

    Raises:
        ValueError: it cannot.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a signal name is a non-blank string, not {name!r}")
    if len(name) > MAX_SIGNAL_NAME_CHARS or not name.isprintable():
        raise ValueError(
            f"a signal name is printable and at most {MAX_SIGNAL_NAME_CHARS} characters"
        )
    return name


@dataclass(frozen=True)
class Signalled:
    """A signal recorded: the entry it went to, and whether it made a waiting entry due."""

    key: str
    task_name: str
    task_id: str
    fence: int
    status: EntryStatus
    due_now: bool


@dataclass(frozen=True)
class Taken:
    """What a wait got: a signal's stored payload (sealed or not), or its timeout."""

    payload: str | None
    timed_out: bool


@dataclass(frozen=True)
class SignalRecord:
    """One row of ``ledger_signals``, for ``show`` and the Ledger page (payload as stored)."""

    name: str
    payload: str | None
    sent_by: str | None
    sent_at: float
    wait: int | None
    taken_at: float | None
    timed_out: bool


class SignalQueries(StoreCore):
    """Queries of durable signals: send, take, the waiting entry's wake."""

    def send_signal(self, key: str, name: str, payload: str, *, by: str) -> Signalled:
        """Record signal ``name`` with ``payload`` (JSON text, sealed or not) for ``key``, in
        one transaction under the entry's row lock, with its ``signalled`` event. An entry
        asleep in a wait for ``name`` (``wait_reason``) with no pending cancellation is made
        due now; the caller wakes it, else the next sweep does.

        The row lock orders the send against the wait's own settle: either the send sees
        the entry asleep and makes it due, or the wait's check after its settle
        (``due_if_signalled``) sees the signal.

        Raises:
            EntryNotFound: no entry has this key.
            SignalRefused: the entry is settled (completed, failed, cancelled, expired):
                no wait is left to take the signal; nothing is written.
        """
        check_signal_name(name)
        with self._txn() as conn:
            row = conn.execute(
                select(entries).where(entries.c.key == key).with_for_update()
            ).one_or_none()
            if row is None:
                raise EntryNotFound(f"no ledger entry with key {key}; the signal was not kept")
            found = EntryStatus(row.status)
            if found.settled or row.tombstone_at is not None:
                raise SignalRefused(
                    f"key {key} is {found.value}: no wait is left to take signal {name!r}; "
                    "the signal was not kept"
                )
            now = db_now()
            conn.execute(
                insert(signals).values(key=key, name=name, payload=payload, sent_by=by, sent_at=now)
            )
            waiting = and_(
                entries.c.status == EntryStatus.SLEEPING.value,
                entries.c.reason == wait_reason(name),
                entries.c.cancel_requested_at.is_(None),
            )
            upd = (
                update(entries)
                .where(entries.c.key == key, entries.c.fence == row.fence)
                .values(
                    due_at=case((waiting, now - _DUE_NOW_BACK_SECONDS), else_=entries.c.due_at),
                    updated_at=now,
                )
                .returning(*sql.RETURNED)
            )
            self._write_with_event(
                conn, sql.with_event(self.dialect, upd), {}, Note("signalled", by, name)
            )
            due_now = (
                found is EntryStatus.SLEEPING
                and row.reason == wait_reason(name)
                and row.cancel_requested_at is None
            )
            return Signalled(key, row.task_name, row.task_id, row.fence, found, due_now)

    def take_signal(self, key: str, name: str, wait: int, *, deadline: float) -> Taken | None:
        """What the ``wait``-th wait of ``key`` for ``name`` gets, in one transaction: the
        signal it took before (its replay), else the oldest signal no wait took (now its),
        else, once ``deadline`` passed on the database clock, a timeout (recorded, so that a
        replay times out too whatever arrives later), else None: nothing yet.

        Not fenced: the take belongs to the wait (key, name, occurrence), not to an attempt,
        and every attempt that reaches that wait gets the same answer. Two concurrent takers
        of one wait (a superseded attempt and its successor) race on the unique
        (key, name, wait) index; the loser reads the winner's row.
        """
        try:
            return self._take(key, name, wait, deadline)
        except IntegrityError:
            # Another taker of this very wait committed first: its row is the answer.
            return self._take(key, name, wait, deadline)

    def _take(self, key: str, name: str, wait: int, deadline: float) -> Taken | None:
        mine = and_(signals.c.key == key, signals.c.name == name)
        with self._txn() as conn:
            taken = conn.execute(
                select(signals.c.payload, signals.c.timed_out).where(mine, signals.c.wait == wait)
            ).one_or_none()
            if taken is not None:
                return Taken(taken.payload, bool(taken.timed_out))
            pending = conn.execute(
                select(signals.c.id, signals.c.payload)
                .where(mine, signals.c.wait.is_(None))
                .order_by(signals.c.id)
                .limit(1)
                .with_for_update()
            ).one_or_none()
            now = db_now()
            if pending is not None:
                # Under the row lock: no other wait takes this row; another taker of this
                # same wait that took another row makes the index refuse this one.
                conn.execute(
                    update(signals)
                    .where(signals.c.id == pending.id)
                    .values(wait=wait, taken_at=now)
                )
                return Taken(pending.payload, False)
            passed = conn.execute(select(now >= deadline)).scalar_one()
            if not passed:
                return None
            conn.execute(
                insert(signals).values(
                    key=key, name=name, sent_at=now, wait=wait, taken_at=now, timed_out=1
                )
            )
            return Taken(None, True)

    def due_if_signalled(self, key: str, fence: int, name: str) -> bool:
        """Make ``key`` due now if it is asleep at ``fence`` in a wait for ``name`` and a
        signal of that name is pending (one statement). Returns whether it did."""
        pending = exists().where(
            signals.c.key == key, signals.c.name == name, signals.c.wait.is_(None)
        )
        upd = (
            update(entries)
            .where(
                entries.c.key == key,
                entries.c.fence == fence,
                entries.c.status == EntryStatus.SLEEPING.value,
                entries.c.reason == wait_reason(name),
                entries.c.cancel_requested_at.is_(None),
                pending,
            )
            .values(due_at=db_now() - _DUE_NOW_BACK_SECONDS)
        )
        with self._one_statement() as conn:
            return conn.execute(upd).rowcount == 1

    def signals_of(self, key: str, *, limit: int = 100) -> list[SignalRecord]:
        """The signals of ``key``, oldest first, payloads as stored (read-only)."""
        with self._read() as conn:
            rows = conn.execute(
                select(signals).where(signals.c.key == key).order_by(signals.c.id).limit(limit)
            ).all()
        return [
            SignalRecord(
                r.name, r.payload, r.sent_by, r.sent_at, r.wait, r.taken_at, bool(r.timed_out)
            )
            for r in rows
        ]


__all__ = [
    "MAX_SIGNAL_NAME_CHARS",
    "SignalQueries",
    "SignalRecord",
    "Signalled",
    "Taken",
    "check_signal_name",
    "wait_reason",
]

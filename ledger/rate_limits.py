"""Fleet-wide rate limits (design.md § "Fleet-wide rate limits"): a token bucket in the database.

A limit (``ledger_rate_limit="10/s"``, or ``"5/m per customer_id"``) is one bucket per task, or
per task and value of the named argument. The bucket is a generic cell rate algorithm (GCRA)
with a capacity of one token, as Celery's own per-worker ``rate_limit``: its row holds ``tat``,
the database time at which its next token is due. **A claim that would run takes a token**
(``take_token``) in one statement, an ``INSERT … ON CONFLICT DO UPDATE … RETURNING`` on the
bucket's row: PostgreSQL locks the row for the update and SQLite writes one at a time, so two
workers can never both take one token, and the database clock decides (the statement's own
``db_now_stable``, read once), never a worker's. The guarantee: **in any window of W seconds
of database time, at most rate × W + 1 claims of one bucket are admitted**, whatever the
number of workers, processes, and crashes.

A claim that finds no token is **held** (``hold_for_token``): its entry goes ``scheduled``
with a reason and a due time, and a row in ``ledger_rate_holds`` says since when. No worker
slot is held, no loop polls: the delivery sends itself again for its due time, and the sweep's
durable-time pass wakes the entry if that message is lost.

**Order.** A delivery held for the first time gets the next free *slot* of the bucket's queue
(``queue_end``, one token interval after the last held one), so held deliveries are due one
per token, in the order their claims arrived. While any is held, a new delivery does not take
a token ahead of them: it queues at the end. A held delivery, once due, still takes a live
token like any claim (admitting a stale reservation would let a batch of late wakes through
at once); when it finds none (it came before the token, or another took it), it is held again
until the token is due, keeping no queue place of its own: the order is FIFO except between
deliveries whose wakes were late by more than a token interval.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Float, Integer, String, case, delete, func, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import StoreCore
from celery_ledger.ledger.dbclock import db_now_stable
from celery_ledger.ledger.dialect import Dialect
from celery_ledger.ledger.schema import entries, rate_buckets, rate_holds
from celery_ledger.ledger.states import EntryStatus
from celery_ledger.ledger.values import RESUME_OWNER, TokenAsk

B = sql.B

#: Seconds per unit of a limit's text (Celery's ``rate_limit`` units).
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_FORM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([smh])\s*(?:per\s+([A-Za-z_]\w*)\s*)?$")


@dataclass(frozen=True)
class RateLimit:
    """A parsed ``ledger_rate_limit``: how many per second, and the argument it is per."""

    #: As the task wrote it (``"5/m per customer_id"``): shown to operators.
    text: str
    per_second: float
    #: The argument whose value names the bucket; None: one bucket for the task.
    argument: str | None = None

    @property
    def interval(self) -> float:
        """Seconds between two tokens."""
        return 1.0 / self.per_second

    @property
    def rate(self) -> str:
        """The rate alone (``"5/m"``), without the argument."""
        return self.text.split(" per ")[0].strip()


def parse_rate_limit(text: str) -> RateLimit:
    """Parse ``"10/s"``, ``"5/m"``, ``"100/h"``, optionally ``"… per <argument>"``.

    Raises:
        ValueError: the text is not of that form, or its rate is not positive.
    """
    found = _FORM.match(text) if isinstance(text, str) else None
    if found is None:
        raise ValueError(
            f"ledger_rate_limit={text!r} is not of the form '10/s', '5/m', '100/h' or "
            "'5/m per <argument name>'"
        )
    count, unit, argument = float(found[1]), found[2], found[3]
    if count <= 0:
        raise ValueError(f"ledger_rate_limit={text!r}: the rate must be positive")
    return RateLimit(" ".join(text.split()), count / _UNITS[unit], argument)


@dataclass(frozen=True)
class Token:
    """The answer of ``take_token``: admitted, or held until ``due_at`` (database clock)."""

    admitted: bool
    due_at: float
    now: float


def _later(a: Any, b: Any) -> Any:
    """SQL: the later of two times (neither NULL), the same on both dialects."""
    return case((a > b, a), else_=b)


def take_token_statement(dialect: Dialect) -> Any:
    """The bucket's one statement (``take_token``); bind parameters ``bucket``, ``interval``,
    ``claimant`` (unique per call) and ``queued`` (1: the delivery was held before)."""
    now = db_now_stable()
    interval = B("interval", Float)
    b = rate_buckets.c
    free = b.tat <= now
    admit = free & ((B("queued", Integer) == 1) | (b.queue_end <= now))
    return (
        dialect.insert(rate_buckets)
        .values(name=B("bucket", String), tat=now + interval, queue_end=now, admitted=B("claimant"))
        .on_conflict_do_update(
            index_elements=[b.name],
            set_={
                "tat": case((admit, now + interval), else_=b.tat),
                # A delivery held for the first time takes the slot after the last held one.
                "queue_end": case(
                    (admit, b.queue_end),
                    (B("queued", Integer) == 1, b.queue_end),
                    else_=_later(_later(b.queue_end, b.tat), now) + interval,
                ),
                "admitted": case((admit, B("claimant", String)), else_=b.admitted),
            },
        )
        .returning(b.tat, b.queue_end, b.admitted, now.label("now"))
    )


def token_params(ask: TokenAsk, *, queued: bool) -> dict[str, Any]:
    """The bind parameters of ``take_token_statement`` for one claim (a fresh ``claimant``)."""
    return {
        "bucket": ask.bucket,
        "interval": ask.interval,
        "claimant": uuid.uuid4().hex,
        "queued": 1 if queued else 0,
    }


def read_token(row: Any, params: dict[str, Any], ask: TokenAsk) -> Token:
    """The ``Token`` a row returned by ``take_token_statement`` (tat, queue_end, admitted,
    now) means for the claim that sent ``params``."""
    tat, queue_end, admitted, now = row[0], row[1], row[2], row[3]
    if admitted == params["claimant"]:
        return Token(True, now, now)
    due = tat if params["queued"] else queue_end - ask.interval
    return Token(False, max(due, now), now)


def take_token(conn: Connection, dialect: Dialect, ask: TokenAsk, *, queued: bool) -> Token:
    """Atomically take a token of ``ask.bucket`` if one is due, else reserve the delivery's
    wait (one statement, in the caller's transaction; the bucket's row is created on first
    use).

    ``queued``: the delivery was held before (it may take the token though others wait).
    Returns the ``Token``: admitted, or the database time its token is due (the bucket's
    next token for a queued delivery, its queue slot for a new one). Never raises for a lost
    race: two claims that race for one token are ordered by the row lock, and the second is
    told when its own is due.
    """
    params = token_params(ask, queued=queued)
    row = conn.execute(take_token_statement(dialect), params).one()
    return read_token(row, params, ask)


def is_held(conn: Connection, key: str) -> bool:
    """Whether ``key`` was held for a token and not admitted since (in the caller's
    transaction)."""
    return conn.execute(select(rate_holds.c.key).where(rate_holds.c.key == key)).first() is not None


def end_hold(conn: Connection, key: str) -> None:
    """Forget ``key``'s hold: its claim took a token (in the caller's transaction)."""
    conn.execute(delete(rate_holds).where(rate_holds.c.key == key))


def hold_statement(dialect: Dialect, *, ran: int) -> Any:
    """The entry's side of a hold: ``scheduled`` until its token (``due``) with ``why``, no
    owner, no lease; fenced on (key, fence). ``ran``: 1 when the claim counted an execution
    that never ran (the new entry's insert), which the hold takes back."""
    upd = (
        update(entries)
        .where(entries.c.key == B("k"), entries.c.fence == B("f"))
        .values(
            status=EntryStatus.SCHEDULED.value,
            due_at=B("due", Float),
            reason=B("why", String),
            owner=RESUME_OWNER,
            owner_boot=None,
            owner_pid=None,
            lease_until=None,
            executions=entries.c.executions - ran,
            updated_at=db_now_stable(),
            # Out of ``running``: a slot of its concurrency key is held while running only
            # (``ledger.slots``); a stale one would be trusted by the wake's claim.
            slot_at=None,
        )
        .returning(*sql.RETURNED)
    )
    return sql.with_event(dialect, upd)


def record_hold(conn: Connection, dialect: Dialect, key: str, ask: TokenAsk, due: float) -> None:
    """The hold's own row: since when (kept across re-holds), until when, how often."""
    h = rate_holds.c
    conn.execute(
        dialect.insert(rate_holds)
        .values(
            key=key,
            bucket=ask.bucket,
            rate=ask.rate,
            held_since=db_now_stable(),
            due_at=due,
            holds=1,
        )
        .on_conflict_do_update(
            index_elements=[h.key],
            set_={"bucket": ask.bucket, "due_at": due, "holds": h.holds + 1},
        )
    )


def hold_reason(ask: TokenAsk, due: float, now: float) -> str:
    """Why the entry is held, for ``show``/``list`` and the Ledger page."""
    return (
        f"rate limit {ask.rate} ({ask.bucket}): waiting for a token, due in "
        f"{max(due - now, 0.0):.3f}s"
    )


@dataclass(frozen=True)
class HeldForToken:
    """An entry held for a token, for ``list``, ``stats`` and the Ledger page."""

    key: str
    task_name: str
    task_id: str
    bucket: str
    rate: str
    held_since: float
    due_at: float
    holds: int


class RateLimitQueries(StoreCore):
    """Operator reads of rate limits (mixed into the store over ``StoreCore``)."""

    def held_for_tokens(self, *, limit: int = 100, bucket: str | None = None) -> list[HeldForToken]:
        """Entries held for a token now (``scheduled`` with a hold row), longest held first
        (read-only)."""
        return self._held(None if bucket is None else rate_holds.c.bucket == bucket, limit=limit)

    def _held(self, where: Any, *, limit: int) -> list[HeldForToken]:
        h = rate_holds.c
        query = (
            select(
                h.key,
                entries.c.task_name,
                entries.c.task_id,
                h.bucket,
                h.rate,
                h.held_since,
                h.due_at,
                h.holds,
            )
            .join(entries, entries.c.key == h.key)
            .where(entries.c.status == EntryStatus.SCHEDULED.value)
            .order_by(h.held_since)
            .limit(limit)
        )
        if where is not None:
            query = query.where(where)
        with self._read() as conn:
            return [HeldForToken(*r) for r in conn.execute(query).all()]

    def token_holds(self, keys: list[str]) -> dict[str, HeldForToken]:
        """The holds of those of ``keys`` held for a token now (read-only)."""
        if not keys:
            return {}
        return {h.key: h for h in self._held(rate_holds.c.key.in_(keys), limit=len(keys))}

    def held_for_tokens_by_bucket(self) -> dict[str, tuple[int, float]]:
        """Per bucket: how many entries are held for a token, and since when the oldest
        (read-only)."""
        h = rate_holds.c
        query = (
            select(h.bucket, func.count(), func.min(h.held_since))
            .join(entries, entries.c.key == h.key)
            .where(entries.c.status == EntryStatus.SCHEDULED.value)
            .group_by(h.bucket)
        )
        with self._read() as conn:
            return {r[0]: (int(r[1]), float(r[2])) for r in conn.execute(query).all()}

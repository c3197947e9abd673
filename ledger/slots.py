"""Concurrency keys (docs/concurrency.md): at most N entries of one key run at once, fleet-wide.

A task with ``concurrency_key=`` and ``concurrency_limit=N`` claims through ``claim_with_slot``
instead of the one-statement claim: a new key in one unit of work on the hot path's cursor
(``_claim_new_with_slot``, its statements compiled once), an existing key in the claim's slower
transaction, with the same statements. Every decision about a key's slots first locks that
key's row of ``ledger_concurrency_keys`` (an upsert: the row lock on PostgreSQL; on SQLite
BEGIN IMMEDIATE serializes every writer anyway), so counting the holders and taking a slot are
one decision, and two claims of one key never both see a free slot.

- **Who holds a slot**: an entry of the key with ``slot_at`` set that is ``running`` (an
  attempt, or the resume marker of a wake), or ``sleeping`` in the slot wait after a
  handover made it due (``holding``). Every write that moves an entry out of ``running``
  clears ``slot_at`` (the settle, the interrupt, a refusal or block at the claim, a rate
  limit's hold); a status any other path leaves is not counted either way, so a stale
  ``slot_at`` can only make fewer run, never more.
- **The claim** (``claim_with_slot``): the ordinary gates first (``ClaimGates``, the
  admission gate among them), under the key's lock; a delivery that would run takes a slot
  when fewer than N are held and no one waits ahead of it. Otherwise its entry is parked
  ``sleeping`` with the reason ``slot:<key>`` and ``waiting_since`` (gate HOLD: acked, no
  worker slot held, nothing polls).
- **The handover**: under the key's lock, the free slots go to the oldest waiters
  (``waiting_since``, then key: first come, first served), each made due now, so that the
  sweep's own wake (``recovery.wake.wake_entry``) sends it; its claim finds the slot its own
  and RUNs. A holder's settle does it in the settle's own transaction, which locks the key
  first as a claim does (``settle_handing_over``): a claim that counted the holder before
  the settle has parked by the time the settle looks for waiters, so it is served. A run
  that ended without a settle (stopped, superseded) calls ``hand_over`` afterwards; the
  sweep calls it for every key with waiters after it interrupted expired leases
  (``hand_over_all``), the backstop for a holder that died and for a wake never sent.
- **A dead holder** keeps its slot exactly as long as its lease: the interrupt (sweep, boot
  sweep, the worker-lost fast path, ``mark-dead``) bumps the fence and clears ``slot_at``
  in one statement, so its zombie is fenced out before its slot is handed on. No TTL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    String,
    and_,
    case,
    exists,
    func,
    literal,
    or_,
    select,
    update,
)

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.admission import Refusal, refusal
from celery_ledger.ledger.claim_gates import CLAIM_IS_INTENT, ClaimGates
from celery_ledger.ledger.core import Note
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.dialect import Dialect
from celery_ledger.ledger.fastpath import Pipelined
from celery_ledger.ledger.rate_limits import take_token
from celery_ledger.ledger.schema import concurrency_keys, entries
from celery_ledger.ledger.statements import B
from celery_ledger.ledger.states import EntryStatus, Gate
from celery_ledger.ledger.values import Claim, ClaimRequest, SlotAsk

#: The longest concurrency key (the column's width).
MAX_CONCURRENCY_KEY_CHARS = 255

#: How far back a handover sets a waiter's due time (as ``signals``: "due now" must have
#: passed on every clock the ledger runs on, SQLite's milliseconds among them).
_DUE_NOW_BACK_SECONDS = 1.0

_RUNNING = EntryStatus.RUNNING.value
_SLEEPING = EntryStatus.SLEEPING.value
_RUNS = (Gate.RUN, Gate.TAKEOVER)


def slot_reason(concurrency_key: str) -> str:
    """The reason an entry waiting for a slot of ``concurrency_key`` carries."""
    return f"slot:{concurrency_key}"


def _reason_sql(concurrency_key: Any) -> Any:
    """``slot_reason`` of a string, or of a bound parameter (SQL)."""
    if isinstance(concurrency_key, str):
        return slot_reason(concurrency_key)
    return literal("slot:", String) + concurrency_key


@dataclass(frozen=True)
class Granted:
    """A waiter a handover gave a slot: made due now, for ``recovery.wake.wake_entry``."""

    key: str
    task_id: str
    fence: int
    snapshot: str | None


@dataclass(frozen=True)
class SlotKey:
    """One concurrency key as ``stats``, Flower and ``doctor`` show it."""

    key: str
    limit: int
    holding: int
    waiting: int
    #: When its longest waiter started waiting (database clock); None: nobody waits.
    oldest_since: float | None


def holding(concurrency_key: Any) -> Any:
    """SQL: the entries holding a slot of ``concurrency_key`` (see the module docstring)."""
    return and_(
        entries.c.concurrency_key == concurrency_key,
        entries.c.slot_at.is_not(None),
        or_(
            entries.c.status == _RUNNING,
            and_(entries.c.status == _SLEEPING, entries.c.reason == _reason_sql(concurrency_key)),
        ),
    )


def waiting(concurrency_key: Any = None) -> Any:
    """SQL: the entries waiting for a slot (of ``concurrency_key``, or of any key)."""
    cond = and_(
        entries.c.waiting_since.is_not(None),
        entries.c.slot_at.is_(None),
        entries.c.status == _SLEEPING,
    )
    if concurrency_key is None:
        return cond
    return and_(entries.c.concurrency_key == concurrency_key, cond)


def lock_key(
    conn: Connection, dialect: Dialect, concurrency_key: str, limit: int | None, *, lazy: bool
) -> int:
    """Lock ``concurrency_key``'s row (created if missing) until the caller's transaction
    ends, storing ``limit`` when given; returns the limit to apply (0: the key was never
    claimed, so nothing can wait for it). ``lazy``: the transaction commits without waiting
    for the flush (asked in this same statement where the database can: no round trip more).

    The lock comes first, and every count of the key's slots is a statement after it: under
    READ COMMITTED that statement's snapshot sees what the previous holder of the lock
    committed (a count inside this statement would not, had it waited for the lock).
    """
    now = db_now()
    if limit is None:
        stmt: Any = (
            update(concurrency_keys)
            .where(concurrency_keys.c.concurrency_key == concurrency_key)
            .values(updated_at=now)
            .returning(concurrency_keys.c.slot_limit)
        )
    else:
        stmt = (
            dialect.insert(concurrency_keys)
            .values(concurrency_key=concurrency_key, slot_limit=limit, updated_at=now)
            .on_conflict_do_update(
                index_elements=[concurrency_keys.c.concurrency_key],
                set_={"slot_limit": limit, "updated_at": now},
            )
            .returning(concurrency_keys.c.slot_limit)
        )
    if lazy and dialect.lazy_statement is not None:
        stmt = dialect.lazy_statement(stmt)
    found = conn.execute(stmt).first()
    return int(found[0]) if found is not None else 0


# -- the hot path's statements (bind parameters ``ck``: the key, ``k``: the entry, ``lim``) ------


@cache
def lock_statement(dialect: Dialect) -> Any:
    """``lock_key`` with a limit, as one statement of the hot path."""
    ins = dialect.insert(concurrency_keys).values(
        concurrency_key=B("ck", String), slot_limit=B("lim", Integer), updated_at=db_now()
    )
    return ins.on_conflict_do_update(
        index_elements=[concurrency_keys.c.concurrency_key],
        set_={"slot_limit": ins.excluded.slot_limit, "updated_at": ins.excluded.updated_at},
    ).returning(concurrency_keys.c.slot_limit)


@cache
def count_statement(dialect: Dialect) -> Any:
    """The slots of ``ck`` held by other entries than ``k``, and whether others wait."""
    ck, others = B("ck", String), entries.c.key != B("k", String)
    return select(
        select(func.count()).where(holding(ck), others).scalar_subquery(),
        exists().where(waiting(ck), others),
    )


@cache
def take_statement(dialect: Dialect) -> Any:
    """Entry ``k`` takes a slot of ``ck``."""
    return (
        update(entries)
        .where(entries.c.key == B("k", String))
        .values(concurrency_key=B("ck", String), slot_at=db_now(), waiting_since=None)
    )


@cache
def park_statement(dialect: Dialect) -> Any:
    """Entry ``k``, claimed at fence ``f``, waits for a slot of ``ck``; with its event."""
    now = db_now()
    upd = (
        update(entries)
        .where(entries.c.key == B("k", String), entries.c.fence == B("f", Integer))
        .values(
            status=_SLEEPING,
            reason=_reason_sql(B("ck", String)),
            concurrency_key=B("ck", String),
            slot_at=None,
            waiting_since=now,
            due_at=None,
            lease_until=None,
            # The claim counted a run of the body that this delivery does not make.
            executions=entries.c.executions - 1,
            renewed_at=case((entries.c.interruptions > 0, entries.c.renewed_at), else_=None),
            updated_at=now,
        )
        .returning(*sql.RETURNED)
    )
    return sql.with_event(dialect, upd)


@cache
def grant_statement(dialect: Dialect) -> Any:
    """The ``n`` oldest waiters of ``ck`` (first come, first served; a cancelled one is left
    to its cancellation) take a slot and are made due now; with their events."""
    now, ck = db_now(), B("ck", String)
    oldest = (
        select(entries.c.key)
        .where(waiting(ck), entries.c.cancel_requested_at.is_(None))
        .order_by(entries.c.waiting_since, entries.c.key)
        .limit(B("n", Integer))
        .scalar_subquery()
    )
    upd = (
        update(entries)
        .where(entries.c.key.in_(oldest), waiting(ck))
        .values(slot_at=now, waiting_since=None, due_at=now - _DUE_NOW_BACK_SECONDS)
        .returning(*sql.RETURNED, entries.c.snapshot)
    )
    return sql.with_event(dialect, upd)


@cache
def anyone_waits_statement(dialect: Dialect) -> Any:
    """Whether anyone waits for a slot of ``ck``."""
    return select(exists().where(waiting(B("ck", String))))


class SlotGates(ClaimGates):
    """The claim of a task with a concurrency key, the handover of freed slots, and what
    operators read of the keys."""

    def claim_with_slot(self, req: ClaimRequest, ask: SlotAsk) -> tuple[Claim, bool]:
        """``HotPath.claim`` for a task with a concurrency key, in one transaction under the
        key's lock: the ordinary gates, then the slot (RUN/TAKEOVER when it takes or holds
        one; HOLD when its entry is parked in the slot wait). Returns the claim, and whether
        it is a new entry whose deadline had passed (the caller settles it ``expired``, in
        a unit of work of its own). Never raises for a lost race.
        """
        # Durable exactly when the one-statement claim it replaces is (``_lazy``).
        lazy = self._lazy(req.side_effect in CLAIM_IS_INTENT)
        # With a rate limit too, a new entry takes its token in the slower transaction.
        new = self._claim_new_with_slot(req, ask, lazy) if req.rate is None else None
        if new is not None:
            return new
        for _ in range(3):
            with self._txn() as conn:
                limit = lock_key(conn, self.dialect, ask.key, ask.limit, lazy=lazy)
                decided = self._claim_locked(conn, req)
                if decided is None:
                    continue  # pruned between the insert and the read: insert again
                claim, expired_new = decided
                if claim.found is None and req.rate is not None and not expired_new:
                    # A new entry: the rate limit's gate, as an existing one's claim asks it
                    # (``ClaimGates._token_gate``), before the slot's.
                    claim = self._token_for_new_in(conn, req, claim)
                if claim.gate in _RUNS and not expired_new:
                    claim = self._slot_gate(conn, req, ask.key, limit, claim)
                return claim, expired_new
        raise RuntimeError(f"claim of {req.key} did not converge")  # pragma: no cover

    def _token_for_new_in(self, conn: Connection, req: ClaimRequest, claim: Claim) -> Claim:
        """A new entry's token (``req.rate``), on ``conn``: the claim as it is when one was
        taken, else the entry held until its token is due and HOLD."""
        assert req.rate is not None
        token = take_token(conn, self.dialect, req.rate, queued=False)
        if token.admitted:
            return claim
        return self._hold_new_for_token(conn, req, claim.fence, token)

    def _slot_hot(self, build: Any) -> Any:
        return self.fast.compiled(("slot", build.__name__), partial(build, self.dialect))

    def _claim_new_with_slot(
        self, req: ClaimRequest, ask: SlotAsk, lazy: bool
    ) -> tuple[Claim, bool] | None:
        """The claim of a new key with a concurrency key, as one unit of work on the hot
        path's cursor (its statements compiled once): lock the key, insert the entry, count,
        take a slot or park. None: the key has an entry (nothing but the key's lock row was
        written); the slow transaction decides it."""
        keyed = {"ck": ask.key, "k": req.key}
        # Pipelined (``FastPath.pipelined``): the lock, the insert and the count go out
        # together, then the take or the park with the COMMIT: two round trips on PostgreSQL.
        # The server runs them in order, so the count's snapshot follows the lock.
        with self.fast.pipelined(lazy=lazy) as unit:
            if self.dialect.autocommit:
                unit.cur.execute("BEGIN")  # one transaction, as ``LinkQueries.settle_with_links``
            lock = unit.send(self._slot_hot(lock_statement), {"ck": ask.key, "lim": ask.limit})
            params = req.insert_params(req.owner.node, req.owner.boot, req.owner.pid, executions=1)
            inserted = self._send_with_event(
                unit, self._hot("claim"), params, Note("claimed", req.owner.node)
            )
            counted = unit.send(self._slot_hot(count_statement), keyed)
            limit = int(lock.fetchone()[0])
            rows = inserted()
            held, ahead = counted.fetchone()[:2]
            result = None
            if rows:
                fence = int(rows[0][2])
                claim = Claim(Gate.RUN, req.key, fence)
                if refusal(None, rows[0][4], rows[0][5]) is Refusal.EXPIRED:
                    result = claim, True
                elif int(held) < limit and not ahead:
                    unit.send(self._slot_hot(take_statement), keyed)
                    result = claim, False
                else:
                    note = self._wait_note(ask.key, int(held), limit, bool(ahead), req)
                    self._send_with_event(
                        unit, self._slot_hot(park_statement), {**keyed, "f": fence}, note
                    )
                    result = _parked(req, ask.key, fence, None), False
            if self.dialect.autocommit:
                unit.cur.execute("COMMIT")
        return result

    def _wait_note(self, ckey: str, held: int, limit: int, ahead: bool, req: ClaimRequest) -> Note:
        why = f"{held} of {limit} slots of {ckey} held" + ("; others wait" if ahead else "")
        return Note("slot-wait", req.owner.node, why)

    def _claim_locked(self, conn: Connection, req: ClaimRequest) -> tuple[Claim, bool] | None:
        """The claim's insert, else its gates, on ``conn``; with whether a new entry's deadline
        had passed already (``HotPath._expire_new`` settles it)."""
        params = req.insert_params(req.owner.node, req.owner.boot, req.owner.pid, executions=1)
        note = Note("claimed", req.owner.node)
        rows = self._write_with_event(conn, sql.claim_insert(self.dialect), params, note)
        if rows:
            expired = refusal(None, rows[0][4], rows[0][5]) is Refusal.EXPIRED
            return Claim(Gate.RUN, req.key, int(rows[0][2])), expired
        claim = self._claim_existing_txn(conn, req)
        return None if claim is None else (claim, False)

    def _slot_gate(
        self, conn: Connection, req: ClaimRequest, ckey: str, limit: int, claim: Claim
    ) -> Claim:
        """Under the key's lock, for a claim that would run: keep the slot the entry holds,
        take a free one, or park the entry in the slot wait (HOLD)."""
        # A slot is trusted only on an entry that was running: the resume marker of a
        # handover's wake, or a holder whose lease lapsed (this claim takes over its own
        # slot). Any other status left running through a write that cleared it.
        if claim.found is EntryStatus.RUNNING:
            row = conn.execute(
                select(entries.c.slot_at, entries.c.concurrency_key).where(entries.c.key == req.key)
            ).one()
            if row.slot_at is not None and row.concurrency_key == ckey:
                return claim
        keyed = {"ck": ckey, "k": req.key}
        held, ahead = conn.execute(count_statement(self.dialect), keyed).one()[:2]
        if int(held) < limit and not ahead:
            conn.execute(take_statement(self.dialect), keyed)
            return claim
        note = self._wait_note(ckey, int(held), limit, bool(ahead), req)
        params = {**keyed, "f": claim.fence}
        self._write_with_event(conn, park_statement(self.dialect), params, note)
        return _parked(req, ckey, claim.fence, claim.found)

    def settle_handing_over(
        self,
        ask: SlotAsk,
        key: str,
        settle: Callable[[Pipelined], Callable[[], list[Any]]],
        *,
        lazy: bool,
        actor: str | None,
    ) -> tuple[list[Any], list[Granted]]:
        """Run ``settle`` (it sends a write that moves entry ``key`` out of ``running``,
        clearing its slot, and returns how to read its rows) and hand the key's free slots to
        its oldest waiters, in one unit of work that locks ``ask.key`` first, as every claim
        of the key does.

        The lock orders this settle with the key's claims, so a waiter cannot slip between
        them: a claim that counted this entry as a holder before the settle parks before the
        settle's count of the waiters (which then serves it), and a claim that locks after
        it sees the slot free. Pipelined (``FastPath.pipelined``): the lock, the settle and
        the count go out together, then the COMMIT (with the grant when someone waits): two
        round trips on PostgreSQL. Returns ``settle``'s rows (none: superseded, nothing
        handed over) and the waiters served, for the caller to wake (``recovery.slots``).
        """
        keyed = {"ck": ask.key, "k": key}
        with self.fast.pipelined(lazy=lazy) as unit:
            if self.dialect.autocommit:
                unit.cur.execute("BEGIN")  # one transaction, as ``_claim_new_with_slot``
            lock = unit.send(self._slot_hot(lock_statement), {"ck": ask.key, "lim": ask.limit})
            settled = settle(unit)
            counted = unit.send(self._slot_hot(count_statement), keyed)
            limit = int(lock.fetchone()[0])
            rows = settled()
            held, ahead = counted.fetchone()[:2]
            granted: list[Granted] = []
            free = limit - int(held)
            if rows and ahead and free > 0:
                note = Note("slot-granted", actor, f"a slot of {ask.key} is free")
                grant = self._slot_hot(grant_statement)
                granted = _served(
                    self._send_with_event(unit, grant, {"ck": ask.key, "n": free}, note)()
                )
            if self.dialect.autocommit:
                unit.cur.execute("COMMIT")
        return rows, granted

    def hand_over(
        self, concurrency_key: str, *, limit: int | None = None, actor: str | None = None
    ) -> list[Granted]:
        """Give the free slots of ``concurrency_key`` to its oldest waiters, in one
        transaction under the key's lock (``limit``: the task's, else the one stored). Each
        waiter is made due now; the caller wakes it (``recovery.wake.wake_entry``), else the
        sweep does. Returns the waiters served (none when no slot is free: a lost race with
        another handover is that)."""
        # Nobody waits, nothing to serve: one read on the waiters' index, no lock. A claim
        # that parks after this read, having counted a holder that has let go since, is
        # served by the key's next settle or by the sweep (a settle's own handover,
        # ``settle_handing_over``, takes the lock first and cannot miss it).
        anyone = self._slot_hot(anyone_waits_statement)
        with self.fast.cursor(lazy=True) as cur:
            cur.execute(anyone.sql, anyone.params({"ck": concurrency_key}))
            if not cur.fetchone()[0]:
                return []
        with self._txn() as conn:
            # A handover lets no effect begin (as a settle): it need not wait for the flush.
            n = lock_key(conn, self.dialect, concurrency_key, limit, lazy=self._lazy(False))
            return self._grant(conn, concurrency_key, n, actor)

    def _grant(self, conn: Connection, ckey: str, limit: int, actor: str | None) -> list[Granted]:
        held = conn.execute(select(func.count()).where(holding(ckey))).scalar_one()
        free = limit - held
        if free <= 0:
            return []
        note = Note("slot-granted", actor, f"a slot of {ckey} is free")
        served = self._write_with_event(
            conn, grant_statement(self.dialect), {"ck": ckey, "n": free}, note
        )
        return _served(served)

    def hand_over_all(self, *, limit: int = 500, actor: str = "sweep") -> list[Granted]:
        """The sweep's backstop: ``hand_over`` for each key that has waiters (up to ``limit``
        keys, one transaction each). Returns every waiter served."""
        with self._read() as conn:
            keys = list(
                conn.execute(
                    select(entries.c.concurrency_key).where(waiting()).distinct().limit(limit)
                ).scalars()
            )
        granted: list[Granted] = []
        for ckey in keys:
            granted += self.hand_over(ckey, actor=actor)
        return granted

    def slot_keys(self, *, limit: int = 100) -> list[SlotKey]:
        """The concurrency keys that have waiters, longest wait first, up to ``limit``, with
        their limit and holders (read-only)."""
        with self._read() as conn:
            rows = conn.execute(
                select(
                    entries.c.concurrency_key,
                    func.count().label("waiting"),
                    func.min(entries.c.waiting_since).label("oldest"),
                )
                .where(waiting())
                .group_by(entries.c.concurrency_key)
                .order_by(func.min(entries.c.waiting_since))
                .limit(limit)
            ).all()
            found = []
            for r in rows:
                ckey = r.concurrency_key
                held = conn.execute(select(func.count()).where(holding(ckey))).scalar_one()
                cap = conn.execute(
                    select(concurrency_keys.c.slot_limit).where(
                        concurrency_keys.c.concurrency_key == ckey
                    )
                ).scalar_one_or_none()
                found.append(SlotKey(ckey, int(cap or 0), int(held), int(r.waiting), r.oldest))
        return found


def _served(rows: list[Any]) -> list[Granted]:
    """The waiters ``grant_statement`` served, from its rows: ``RETURNED``, then the snapshot
    (a lazy twin may add a column after it)."""
    return [Granted(r[0], r[1], int(r[2]), r[len(sql.RETURNED)]) for r in rows]


def _parked(req: ClaimRequest, ckey: str, fence: int, found: EntryStatus | None) -> Claim:
    return Claim(Gate.HOLD, req.key, fence, found=found, reason=slot_reason(ckey))


__all__ = [
    "MAX_CONCURRENCY_KEY_CHARS",
    "Granted",
    "SlotGates",
    "SlotKey",
    "holding",
    "lock_key",
    "slot_reason",
    "waiting",
]

"""What every ledgered task does: claim, renew the lease, write replay rows, settle.

Claim (new key), lease renewal, step writes and settle run on the hot path's raw cursors
(``StoreCore.fast``), one statement each on PostgreSQL; only the claim of an existing key takes
the slower ``SELECT … FOR UPDATE`` transaction (``claim_gates``, the base of ``HotPath``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from sqlalchemy import delete, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.admission import Refusal, expired_failure, refusal
from celery_ledger.ledger.claim_gates import CLAIM_IS_INTENT
from celery_ledger.ledger.core import Note
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.fastpath import Pipelined
from celery_ledger.ledger.identity import is_declared
from celery_ledger.ledger.links import link_rows
from celery_ledger.ledger.outbox import Child
from celery_ledger.ledger.rate_limits import (
    read_token,
    take_token_statement,
    token_params,
)
from celery_ledger.ledger.schema import entries, steps
from celery_ledger.ledger.slots import Granted, SlotGates
from celery_ledger.ledger.states import EntryStatus, Gate, StepStatus
from celery_ledger.ledger.values import (
    RESUME_OWNER,
    Claim,
    ClaimRequest,
    SlotAsk,
    StepRecord,
)


class HotPath(SlotGates):
    """Claim, renew, write steps, settle: the store methods every ledgered task calls.

    The claim of a key that has an entry, decided under its row lock, is ``ClaimGates``
    (``claim_gates``); the claim of a task with a concurrency key is ``SlotGates``
    (``slots``).
    """

    # -- claim ----------------------------------------------------------------------------

    def prepare_for_fork(self) -> None:
        """Before a worker forks its pool: compile the hot path's statements and open (then
        close) one connection of its engine, which initializes the engine's dialect. Every
        pool process keeps them (``StoreCore._open_engine``), shared copy-on-write, instead
        of building its own (measured: about 5 MiB of private memory per pool process). A
        store never prepared (a client, or a worker whose ledger was down at start) keeps
        building fresh engines in each child.

        Raises:
            LedgerUnavailable: the database cannot be reached.
        """
        fast = self.fast
        for key in sql.HOT:
            self._hot(key)
        with fast.cursor():
            pass
        fast.close()  # the parent runs no task: no session of its own stays open for it
        self._forkable = True

    def claim(self, req: ClaimRequest) -> Claim:
        """Atomically create the entry, or decide what the existing entry means for this delivery.

        Any number of concurrent claims of a new key yield exactly one RUN (the primary key
        decides); the rest see the winner's row and get WAIT. An existing key is decided under
        its row lock, in one transaction, and every transition it makes is fenced by that lock
        (the fence grows by one). Every gate is appended to the events. Returns the ``Claim``;
        never raises for a lost race.

        A task with a concurrency key (``req.slot``) claims in one transaction under its
        key's lock instead (``SlotGates.claim_with_slot``): HOLD when it waits for a slot.
        """
        if req.slot is not None:
            slotted, expired_new = self.claim_with_slot(req, req.slot)
            return self._expire_new(req, slotted.fence) if expired_new else slotted
        for _ in range(3):
            inserted = self._insert_new(req)
            if inserted is not None:
                fence, deadline_passed = inserted
                if deadline_passed:
                    return self._expire_new(req, fence)
                if req.rate is not None:
                    return self._token_for_new(req, fence)
                return Claim(Gate.RUN, req.key, fence)
            with self._txn() as conn:
                claim = self._claim_existing_txn(conn, req)
            if claim is not None:
                return claim
            # The row vanished between our insert and our read (pruned): insert again.
        raise RuntimeError(f"claim of {req.key} did not converge")  # pragma: no cover

    def _insert_new(self, req: ClaimRequest) -> tuple[int, bool] | None:
        # The claim of a non_idempotent or irreversible task is its intent when the body has
        # no steps (design.md § "Durability follows effects"): it waits for the flush. Other classes
        # may re-run: it need not.
        rows = self._insert_entry(
            req,
            req.owner.node,
            req.owner.boot,
            req.owner.pid,
            executions=1,
            event="claimed",
            lazy=self._lazy(req.side_effect in CLAIM_IS_INTENT),
        )
        if not rows:
            return None
        deadline, now = rows[0][4], rows[0][5]
        return int(rows[0][2]), refusal(None, deadline, now) is Refusal.EXPIRED

    def _expire_new(self, req: ClaimRequest, fence: int) -> Claim:
        """The admission gate on a new entry: its delivery came with a deadline that had
        passed when the row was written. It settles ``expired`` (fenced) and RETURNs the
        failure, so that nothing runs; rare, so a second statement is spent only here."""
        why = f"{req.task_name}[{req.task_id}]: the deadline passed before it ran"
        error = expired_failure(why)
        self.settle(req.key, fence, EntryStatus.EXPIRED, error=error, actor=req.owner.node)
        return Claim(Gate.RETURN, req.key, fence, error=error)

    def _token_for_new(self, req: ClaimRequest, fence: int) -> Claim:
        """The rate limit on a new entry: take a token (one statement on the hot path's raw
        cursor, as durable as the claim's insert), else hold the entry (its insert counted an
        execution that never ran: taken back) until the token is due, and answer HOLD. A
        second round trip, spent only by limited tasks: the bucket is a row of its own."""
        assert req.rate is not None
        stmt = self.fast.compiled("token", partial(take_token_statement, self.dialect))
        params = token_params(req.rate, queued=False)
        with self.fast.cursor(lazy=self._lazy(req.side_effect in CLAIM_IS_INTENT)) as cur:
            cur.execute(stmt.sql, stmt.params(params))
            token = read_token(cur.fetchone(), params, req.rate)
        if token.admitted:
            return Claim(Gate.RUN, req.key, fence)
        with self._txn() as conn:
            return self._hold_new_for_token(conn, req, fence, token)

    def record_intent(self, req: ClaimRequest) -> bool:
        """Record a task at publish time, before any worker has it (one statement, atomic).

        The entry is ``running`` under the resume marker with a lease of
        ``req.lease_seconds`` and no execution: the first claim runs it (RUN, not TAKEOVER);
        if the message is lost before any claim (``filesystem://`` forgets what a killed
        worker had fetched), the lease expires and the sweep re-enqueues it like any
        interrupted entry. Returns False if the key already has an entry (nothing written).
        """
        return bool(self._insert_entry(req, RESUME_OWNER, None, None, executions=0, event="queued"))

    def _insert_entry(
        self,
        req: ClaimRequest,
        owner: str,
        boot: str | None,
        pid: int | None,
        *,
        executions: int,
        event: str,
        lazy: bool = False,
    ) -> list[Any]:
        """The claim's insert (``sql.claim_insert``): a new running entry, or no row if the
        key exists. A claim owns it with one execution; a publish intent with none."""
        return self._fast_write(
            "claim",
            req.insert_params(owner, boot, pid, executions=executions),
            Note(event, req.owner.node),
            lazy=lazy,
        )

    def args_hash_of(self, key: str) -> str | None:
        """The ``args_hash`` the entry of ``key`` was claimed (or published) with; None when
        there is no entry (read-only)."""
        with self._read() as conn:
            return conn.execute(
                select(entries.c.args_hash).where(entries.c.key == key)
            ).scalar_one_or_none()

    def withdraw_intent(self, key: str, task_id: str, *, actor: str | None, why: str) -> bool:
        """Delete the publish intent of ``task_id`` whose publish failed, in one statement
        (atomic with its ``withdrawn`` event).

        Only an intent that no claim touched goes: ``executions = 0`` (no attempt ran the
        body), the resume marker as owner (no claim owns it), the same task id (not another
        publish of the key). A claim or a takeover that got there first wins the race: nothing
        is deleted and this returns False. An intent the sweep already re-sent is deleted
        too: its message then claims a new entry, exactly as it would have claimed this one.
        """
        stmt = (
            delete(entries)
            .where(
                entries.c.key == key,
                entries.c.task_id == task_id,
                entries.c.executions == 0,
                entries.c.owner == RESUME_OWNER,
            )
            .returning(*sql.RETURNED)
        )
        with self._one_statement() as conn:
            rows = self._write_with_event(
                conn, sql.with_event(self.dialect, stmt), {}, Note("withdrawn", actor, why)
            )
        return bool(rows)

    def peek_status(self, key: str) -> tuple[EntryStatus, float | None] | None:
        """Read the entry's status and seconds left on its lease (no lock, no write)."""
        with self._read() as conn:
            row = conn.execute(
                select(entries.c.status, (entries.c.lease_until - db_now()).label("left")).where(
                    entries.c.key == key
                )
            ).one_or_none()
        return None if row is None else (EntryStatus(row.status), row.left)

    # -- lease ----------------------------------------------------------------------------

    def renew_lease(self, key: str, fence: int, lease_seconds: float) -> bool:
        """Atomically extend the lease to db-now + ``lease_seconds``, fenced (one statement).

        Returns False when the fence moved (superseded) or the entry is no longer running;
        nothing is written then.
        """
        stmt = self._hot("renew")
        with self.fast.cursor(lazy=self._lazy(False)) as cur:
            cur.execute(stmt.sql, stmt.params({"k": key, "f": fence, "lease": lease_seconds}))
            return bool(cur.rowcount == 1)

    def hold_intents(self, keys: list[str], lease_seconds: float) -> list[str]:
        """Set the lease of publish intents that a worker has received to db-now +
        ``lease_seconds`` (one statement, atomic); returns the keys it held.

        Only an entry that is still an intent is touched: running under the resume marker and
        never executed. Once a claim has run it (or the sweep interrupted it) the key is not
        returned, and its holder stops holding it. The fence is left alone: nothing runs
        under a hold, and the claim RUNs an intent whatever its lease.
        """
        if not keys:
            return []
        with self._one_statement() as conn:
            rows = conn.execute(
                update(entries)
                .where(
                    entries.c.key.in_(keys),
                    entries.c.status == EntryStatus.RUNNING.value,
                    entries.c.owner == RESUME_OWNER,
                    entries.c.executions == 0,
                )
                .values(lease_until=db_now() + lease_seconds)
                .returning(entries.c.key)
            ).all()
        return [r.key for r in rows]

    # -- replay rows ----------------------------------------------------------------------

    def write_step(
        self,
        key: str,
        fence: int,
        ident: tuple[str, str, int],
        *,
        seq: int,
        status: StepStatus,
        output: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Upsert one replay row, fenced on the entry, in one statement (atomic).

        ``started`` records intent before an effect; ``completed`` records the output (after
        a ``started`` row or directly for read/idempotent steps); ``not_executed`` records a
        proven non-execution. A completed row is never overwritten. A ``started`` write onto
        an existing row from a new fence, or after a not_executed verdict, counts one more
        attempt of the step's body (``not_executed`` counts one more authorized attempt). So
        does a new ``started`` row at a step name and position (``occurrence``) where a row
        of another input started or completed: the same step, run a second time with a
        drifted input (the runtime refuses to; this keeps the duplicate-execution rate honest
        if anything ever does). Returns False when this attempt was superseded, or when the
        row is completed already (nothing is written either way).
        """
        name, ihash, occurrence = ident
        # A started row new at its position while another input's row may have run there:
        # counted as a second execution (see ``sql.step_upsert``). A declared identity has no
        # position to share.
        at_position = status is StepStatus.STARTED and not is_declared(ihash)
        params = {
            "key": key,
            "name": name,
            "input_hash": ihash,
            "occurrence": occurrence,
            "seq": seq,
            "status": status.value,
            "output": output,
            "error": error,
            "fence": fence,
            "authorized": 1 if status is StepStatus.NOT_EXECUTED else 0,
        }
        started = status is StepStatus.STARTED
        stmt = self._hot(("step", started, at_position))
        # A started row lets its effect begin: it waits for the flush (design.md § "Durability
        # follows effects").
        with self.fast.cursor(lazy=self._lazy(started)) as cur:
            cur.execute(stmt.sql, stmt.params(params))
            return cur.fetchone() is not None

    def record_external_ref(
        self, key: str, fence: int, ident: tuple[str, str, int], ref: str
    ) -> bool:
        """Store a provider handle on a started step, fenced, in one statement (atomic).

        Returns False if superseded (nothing is written then).

        Raises:
            ValueError: the attempt is current but the step has no replay row (a step that
                records no intent); nothing is written.
        """
        name, ihash, occurrence = ident
        with self._one_statement() as conn:
            res = conn.execute(
                update(steps)
                .where(
                    steps.c.key == key,
                    steps.c.name == name,
                    steps.c.input_hash == ihash,
                    steps.c.occurrence == occurrence,
                    steps.c.key.in_(sql.live_entry(key, fence)),
                )
                .values(external_ref=ref)
            )
        if res.rowcount == 1:
            return True
        # Not written: the fence moved (an expected lost race), or there is no row to hold the
        # reference (a usage error, which must not pass for "superseded"). Read which.
        with self._read() as conn:
            live = conn.execute(
                select(entries.c.key).where(
                    entries.c.key == key,
                    entries.c.fence == fence,
                    entries.c.status == EntryStatus.RUNNING.value,
                )
            ).first()
        if live is None:
            return False
        raise ValueError(
            f"step {name!r} #{occurrence} of {key} has no started row to hold an external "
            "reference (it records no intent)"
        )

    def load_steps(self, key: str) -> tuple[StepRecord, ...]:
        """Every replay row of ``key`` in one query, in execution order (read-only)."""
        with self._read() as conn:
            return self._load_steps(conn, key)

    # -- settle ---------------------------------------------------------------------------

    def settle(
        self,
        key: str,
        fence: int,
        status: EntryStatus,
        *,
        result: str | None = None,
        error: str | None = None,
        reason: str | None = None,
        actor: str | None = None,
        due_in: float | None = None,
        due_at: float | None = None,
        snapshot: str | None = None,
    ) -> bool:
        """Move a running entry to ``status`` (completed, failed, retrying or blocked), fenced.

        ``retrying`` may say when the retry is due (``due_in`` seconds from now on the
        database clock, or ``due_at`` seconds since the epoch) and with which arguments
        (``snapshot``): a retry not claimed by then is re-sent by the sweep
        (``resend_retry``). Every other settle clears the due time.

        Atomic with its audit event (one statement on PostgreSQL). Returns False when this
        attempt was superseded; nothing is written then.

        Raises:
            ValueError: ``status`` is running or interrupted (not a settlement), or a due time
                or snapshot is given for another status than retrying.
        """
        hot, params, note, lazy = self._settle_parts(
            key, fence, status, result, error, reason, actor, due_in, due_at, snapshot
        )
        return bool(self._fast_write(hot, params, note, lazy=lazy))

    def settle_in_slot(
        self,
        ask: SlotAsk,
        key: str,
        fence: int,
        status: EntryStatus,
        *,
        links: Sequence[Child] = (),
        result: str | None = None,
        error: str | None = None,
        reason: str | None = None,
        actor: str | None = None,
        due_in: float | None = None,
        due_at: float | None = None,
        snapshot: str | None = None,
    ) -> list[Granted] | None:
        """``settle`` (``settle_with_links`` with ``links``) of an entry that holds a slot of
        ``ask.key``, and the handover of the key's free slots to its oldest waiters, in one
        transaction under the key's lock (``SlotGates.settle_handing_over``).

        Returns the waiters served, for the caller to wake; None when this attempt was
        superseded (nothing written, nothing handed over).

        Raises:
            ValueError: as ``settle`` and ``settle_with_links``.
        """
        hot, params, note, lazy = self._settle_parts(
            key, fence, status, result, error, reason, actor, due_in, due_at, snapshot
        )
        if links:
            if status not in (EntryStatus.COMPLETED, EntryStatus.FAILED):
                raise ValueError(f"a settle records links when completed or failed, not {status}")
            record, children = link_rows(self.fast, self.dialect, key, fence, links)

        def write(unit: Pipelined) -> Callable[[], list[Any]]:
            sent = self._send_with_event(unit, self._hot(hot), params, note)
            if not links:
                return sent
            rows = sent()  # the links are recorded only by a settle that wrote
            if rows:
                unit.cur.executemany(record.sql, children)
            return lambda: rows

        # With links, the outbox rows wait for the flush, as ``settle_with_links``.
        rows, granted = self.settle_handing_over(
            ask, key, write, lazy=lazy and not links, actor=actor
        )
        return granted if rows else None

    def _settle_parts(
        self,
        key: str,
        fence: int,
        status: EntryStatus,
        result: str | None,
        error: str | None,
        reason: str | None,
        actor: str | None,
        due_in: float | None,
        due_at: float | None,
        snapshot: str | None,
    ) -> tuple[Any, dict[str, Any], Note, bool]:
        """A settle's statement key, parameters, event and durability (``settle``)."""
        if status in (EntryStatus.RUNNING, EntryStatus.INTERRUPTED):
            raise ValueError(f"settle cannot move an entry to {status.value}")
        waits = (due_in, due_at, snapshot) != (None, None, None)
        if waits and status not in (
            EntryStatus.RETRYING,
            # a long retry countdown held by the ledger (design.md § "Durable time")
            EntryStatus.SCHEDULED,
            EntryStatus.SLEEPING,  # ``self.sleep()`` (design.md § "Durable time")
        ):
            raise ValueError(
                f"only a retrying settle has a due time or a new snapshot, not {status.value}"
            )
        params = {
            "k": key,
            "f": fence,
            "to_status": status.value,
            "new_result": result,
            "new_error": error,
            "new_reason": reason,
            "due_in": due_in,
            "due_abs": due_at,
            "new_snapshot": snapshot,
        }
        # A settle lets no effect begin; a lost one is recovered by replay or blocks
        # (design.md § "Durability follows effects"). A block is rare and is what an operator
        # acts on: it waits.
        lazy = self._lazy(status is EntryStatus.BLOCKED)
        return ("settle", status.settled), params, Note("settled", actor, reason or error), lazy

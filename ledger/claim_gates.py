"""The claim of a key that already has an entry: which gate, decided under the entry's row lock.

``HotPath.claim`` inserts a new key on the fast path, one statement; only when the key exists
does it take this slower transaction, which locks the row (``SELECT … FOR UPDATE``) and
decides, in this order, what the entry means for the delivery that asks:

1. the gates that leave the entry as it is (``_standing_gate``): CONFLICT, RETURN, BLOCK,
   HOLD, and WAIT for an attempt that still holds its lease;
2. RUN or TAKEOVER for a delivery that would run (``_run_gate``);
3. the admission gate (``admission``): a pending cancellation or a passed deadline settles the
   entry instead (``_refuse_in_claim``);
4. the crash-loop rule (``crashloop``): a takeover past ``max_interruptions`` parks it
   (``_block_in_claim``);
5. the rate limit (``rate_limits``), for a task that has one: the claim takes a token, or the
   entry is held ``scheduled`` until its token is due (``_token_gate``, HOLD);
6. the claim's own write (``sql.claim_takeover``): the fence grows by one.

Every transition is fenced by the row lock, and every gate appends its event.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, String, literal, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.admission import Refusal, earliest_of, refusal, refused_failure
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.crashloop import crash_loop_reason
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.death import last_sign_of_life
from celery_ledger.ledger.rate_limits import (
    Token,
    end_hold,
    hold_reason,
    hold_statement,
    is_held,
    record_hold,
    take_token,
)
from celery_ledger.ledger.schema import entries, steps
from celery_ledger.ledger.states import EntryStatus, Gate, StepStatus
from celery_ledger.ledger.values import (
    NO_ARGS_HASH,
    RESUME_OWNER,
    Claim,
    ClaimRequest,
    StepRecord,
)

#: Side-effect classes whose claim is the intent of a body without steps (design.md §
#: "Durability follows effects"): their claim waits for the flush, the others' need not.
CLAIM_IS_INTENT = frozenset({"non_idempotent", "irreversible"})


class ClaimGates(StoreCore):
    """The claim of an existing key (``HotPath.claim``'s locked transaction), and the replay
    rows a claim hands to the attempt it lets run."""

    def _claim_existing_txn(self, conn: Connection, req: ClaimRequest) -> Claim | None:
        """Decide the claim of ``req.key``, whose entry exists, under its row lock (in the
        caller's transaction). Returns None when the row is gone (pruned since the insert
        found it): the caller inserts again."""
        row = conn.execute(
            select(
                entries,
                (entries.c.lease_until - db_now()).label("remaining"),
                db_now().label("now"),
            )
            .where(entries.c.key == req.key)
            .with_for_update()
        ).one_or_none()
        if row is None:
            return None
        found = EntryStatus(row.status)
        standing = self._standing_gate(conn, req, row, found)
        if standing is not None:
            return standing
        gate, interruptions = _run_gate(row, found)
        # The admission gate (``admission``), asked of every delivery that would run: a
        # retry's, a takeover's, a resume's, a wake's. The deadline only tightens.
        rel = None if req.deadline_after is None else row.created_at + req.deadline_after
        deadline = earliest_of(row.deadline_at, req.deadline_at, rel)
        refused = refusal(row.cancel_requested_at, deadline, row.now)
        if refused is not None:
            return self._refuse_in_claim(conn, req, row, refused, deadline)
        fence = row.fence + 1
        if gate is Gate.TAKEOVER:
            reason = crash_loop_reason(interruptions, req.max_interruptions)
            if reason is not None:
                self._block_in_claim(conn, req, fence, interruptions, reason)
                return Claim(Gate.BLOCK, req.key, fence, found=found, reason=reason)
        if req.rate is not None:
            held = self._token_gate(conn, req, row, gate)
            if held is not None:
                return held
        return self._take_in_claim(conn, req, row, gate, fence, interruptions, deadline)

    def _standing_gate(
        self, conn: Connection, req: ClaimRequest, row: Any, found: EntryStatus
    ) -> Claim | None:
        """The gates that leave the entry as it is, only their event written: CONFLICT,
        RETURN (settled), BLOCK, HOLD (design.md § "Durable time": the ledger sends it when
        due), WAIT (an attempt of another boot, or of this one, holds a live lease). None:
        the delivery would run."""

        def decided(gate: Gate, event: str, detail: str | None = None, **kw: Any) -> Claim:
            seen = (req.key, req.task_id, row.fence, row.status)
            self._append_events(conn, Note(event, req.owner.node, detail), [seen])
            return Claim(gate, req.key, row.fence, found=found, **kw)

        if _conflicts(row.args_hash, req):
            detail = f"args_hash {req.args_hash} != {row.args_hash}"
            return decided(Gate.CONFLICT, "conflict", detail)
        if found.settled:
            return decided(Gate.RETURN, "returned", result=row.result, error=row.error)
        if found is EntryStatus.BLOCKED:
            return decided(Gate.BLOCK, "block-gate", reason=row.reason)
        if found.waits_for_time:
            # Held for a token (``_token_gate``): once due, on to the run gate to take it;
            # before, this copy of the delivery sends itself again for the due time.
            token_wait = _token_wait(conn, req, row, found)
            if token_wait is None or token_wait > 0:
                detail = f"{found.value} until {row.due_at}"
                return decided(Gate.HOLD, "held", detail, token_due_in=token_wait)
        if found is EntryStatus.RUNNING and row.owner != RESUME_OWNER:
            lease_live = row.remaining is not None and row.remaining > 0
            previous_boot = row.owner == req.owner.node and row.owner_boot != req.owner.boot
            if lease_live and not previous_boot:
                return decided(Gate.WAIT, "waited", lease_remaining=float(row.remaining))
        return None

    def _token_gate(
        self, conn: Connection, req: ClaimRequest, row: Any, gate: Gate
    ) -> Claim | None:
        """The rate limit's gate, under the claim's row lock: take a token of the task's
        bucket (None: admitted), or hold the entry until its token is due and answer HOLD.

        A takeover is not held: the attempt it replaces may have died in the body, and only
        a takeover decides what that body left ambiguous. Its entry stays as it is (its lease
        lapsed or lapses), and the delivery is sent again for its token's due time: the
        bucket's next token, as a held delivery's, not a place at the end of the queue. It
        keeps no place (nothing is held), so taking a new one on each claim would let two
        takeovers push each other back for ever.
        """
        assert req.rate is not None
        held = is_held(conn, req.key)
        queued = held or gate is Gate.TAKEOVER
        token = take_token(conn, self.dialect, req.rate, queued=queued)
        if token.admitted:
            if held:
                end_hold(conn, req.key)
            return None
        if gate is not Gate.TAKEOVER:
            self._hold_for_token(conn, req, row.fence, token, ran=0)
        return token_hold(req, row.fence, token, found=EntryStatus(row.status))

    def _hold_new_for_token(
        self, conn: Connection, req: ClaimRequest, fence: int, token: Token
    ) -> Claim:
        """Hold a new entry (its insert counted an execution that never ran: taken back)
        until ``token`` is due, in the caller's transaction; its HOLD claim."""
        self._hold_for_token(conn, req, fence, token, ran=1)
        return token_hold(req, fence, token)

    def _hold_for_token(
        self, conn: Connection, req: ClaimRequest, fence: int, token: Token, *, ran: int
    ) -> bool:
        """Hold the entry at ``fence`` ``scheduled`` until ``token.due_at``, with its reason
        and its hold row (in the caller's transaction; fenced, atomic with its ``held``
        event). Returns False when the fence moved (nothing written)."""
        assert req.rate is not None
        why = hold_reason(req.rate, token.due_at, token.now)
        params = {"k": req.key, "f": fence, "due": token.due_at, "why": why}
        note = Note("held", req.owner.node, why)
        rows = self._write_with_event(conn, hold_statement(self.dialect, ran=ran), params, note)
        if rows:
            record_hold(conn, self.dialect, req.key, req.rate, token.due_at)
        return bool(rows)

    def _take_in_claim(
        self,
        conn: Connection,
        req: ClaimRequest,
        row: Any,
        gate: Gate,
        fence: int,
        interruptions: int,
        deadline: float | None,
    ) -> Claim:
        """Hand the entry to this delivery's attempt at ``fence`` (RUN or TAKEOVER), under the
        claim's row lock, and return the claim with the replay rows the attempt starts from."""
        found = EntryStatus(row.status)
        params = {
            "k": req.key,
            "new_fence": fence,
            "new_task_id": req.task_id,
            "new_args_hash": req.args_hash,
            "new_snapshot": req.snapshot if req.snapshot is not None else row.snapshot,
            "new_owner": req.owner.node,
            "new_owner_boot": req.owner.boot,
            "new_owner_pid": req.owner.pid,
            "lease": req.lease_seconds,
            "new_interruptions": interruptions,
            "new_group_id": req.group_id,
            "new_parent_id": req.parent_id,
            "new_deadline": deadline,
        }
        event = (
            "claimed" if row.executions == 0 else "takeover" if gate is Gate.TAKEOVER else "rerun"
        )
        note = Note(event, req.owner.node, f"from {found.value}")
        self._write_with_event(conn, sql.claim_takeover(self.dialect), params, note)
        return Claim(
            gate,
            req.key,
            fence,
            found=found,
            steps=self._load_steps(conn, req.key),
            executions=row.executions,
            # Read before this claim's own renewal stamp replaced them (``death``).
            prior_alive_at=last_sign_of_life(row, req.lease_seconds),
            prior_lease=row.lease_seconds,
            dead_fence=row.dead_fence,
            now=row.now,
        )

    def _refuse_in_claim(
        self, conn: Connection, req: ClaimRequest, row: Any, why: Refusal, deadline: float | None
    ) -> Claim:
        """Settle an entry the admission gate refused (``why``), under the claim's row lock,
        and RETURN its failure. A step that started and never completed may have executed:
        the reason says so, for the operator who reads ``show``."""
        if why is Refusal.CANCELLED:
            detail = f"cancelled by {row.cancel_by}: {row.cancel_reason}; this delivery did not run"
        else:
            detail = "the deadline passed before this delivery ran"
        error = refused_failure(why, f"{req.task_name}[{req.task_id}] key {req.key}: {detail}")
        started = conn.execute(
            select(steps.c.name)
            .where(steps.c.key == req.key, steps.c.status == StepStatus.STARTED.value)
            .limit(1)
        ).scalar_one_or_none()
        reason = None
        if started is not None:
            reason = (
                f"{detail}; step {started!r} started and never completed: it may have "
                "executed (see its external reference)"
            )
        fence = row.fence + 1
        upd = (
            update(entries)
            .where(entries.c.key == req.key)
            .values(
                status=why.value,
                fence=fence,
                error=error,
                reason=reason,
                lease_until=None,
                slot_at=None,
                due_at=None,
                deadline_at=deadline,
                settled_at=db_now(),
                updated_at=db_now(),
            )
            .returning(
                entries.c.key,
                literal(req.task_id, String).label("task_id"),
                entries.c.fence,
                entries.c.status,
            )
        )
        note = Note(why.value, req.owner.node, f"refused at the claim: {reason or detail}")
        self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note)
        return Claim(
            Gate.RETURN, req.key, fence, found=EntryStatus(row.status), error=error, reason=reason
        )

    def _block_in_claim(
        self, conn: Connection, req: ClaimRequest, fence: int, interruptions: int, reason: str
    ) -> None:
        """Park a crash loop the claim found (under the claim's row lock). The event carries
        the claiming task id, which the entry keeps as it was."""
        upd = (
            update(entries)
            .where(entries.c.key == req.key)
            .values(
                status=EntryStatus.BLOCKED.value,
                fence=fence,
                reason=reason,
                interruptions=interruptions,
                lease_until=None,
                slot_at=None,
                updated_at=db_now(),
            )
            .returning(
                entries.c.key,
                literal(req.task_id, String).label("task_id"),
                entries.c.fence,
                entries.c.status,
            )
        )
        note = Note("blocked", req.owner.node, reason)
        self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note)

    def _load_steps(self, conn: Connection, key: str) -> tuple[StepRecord, ...]:
        """Every replay row of ``key``, in execution order (``HotPath.load_steps`` reads them
        alone, a claim with the entry it hands over)."""
        rows = conn.execute(
            select(steps).where(steps.c.key == key).order_by(steps.c.seq, steps.c.occurrence)
        ).all()
        return tuple(
            StepRecord(
                name=r.name,
                input_hash=r.input_hash,
                occurrence=r.occurrence,
                seq=r.seq,
                status=StepStatus(r.status),
                fence=r.fence,
                output=r.output,
                external_ref=r.external_ref,
                error=r.error,
                attempts=r.attempts,
                authorized=r.authorized,
                started_at=r.started_at,
                completed_at=r.completed_at,
            )
            for r in rows
        )


def _run_gate(row: Any, found: EntryStatus) -> tuple[Gate, int]:
    """RUN or TAKEOVER for a delivery that ``_standing_gate`` let through (a retrying, an
    interrupted, or a running entry whose attempt is gone), and the entry's interruptions,
    counting the loss of that attempt."""
    if found is EntryStatus.RETRYING:
        return Gate.RUN, row.interruptions
    interruptions = row.interruptions
    if found is EntryStatus.RUNNING and row.owner != RESUME_OWNER:
        interruptions += 1  # the attempt that held it is gone: count the loss here
    if row.executions == 0:
        # A publish intent (or its resume) that no attempt ran yet: a first run, with
        # nothing that could be ambiguous and no crash to count.
        return Gate.RUN, interruptions
    if row.due_at is not None:
        # The wake of a clean settle: re-run it as the retry it is, never take it over.
        # ``begin_wake`` keeps the due time the entry was woken for, and only a claim
        # that hands the entry to an attempt clears it (``sql.claim_takeover``). So a
        # due time on a running or interrupted entry proves that no attempt has run the
        # body since one settled it ``scheduled`` (a held ``self.retry``) or ``sleeping``:
        # an end as clean as a ``retrying`` settle, which left no body to doubt. RUN, as
        # for ``retrying``: completed steps replay, and a started one is still decided
        # before the body (``Ambiguity.before_body`` looks at every step it loads).
        # A lost wake message: the resume marker's lease lapses, the sweep interrupts
        # the entry (no interruption counted: nothing ran) and resumes it; neither
        # touches the due time, so the claim of the re-sent message, or of the late
        # original, still RUNs it. Exactly one claim does, under this row lock; any
        # other finds the due time cleared and a live lease (WAIT) or a settled entry.
        # An attempt that claimed the wake and then died cleared it: its takeover
        # decides a possibly ambiguous body as before.
        return Gate.RUN, interruptions
    return Gate.TAKEOVER, interruptions


def _token_wait(conn: Connection, req: ClaimRequest, row: Any, found: EntryStatus) -> float | None:
    """Seconds until the token of a ``scheduled`` entry a rate limit held is due (<= 0: due
    now); None when the entry is not held for a token."""
    if req.rate is None or found is not EntryStatus.SCHEDULED or row.due_at is None:
        return None
    if not is_held(conn, req.key):
        return None
    return float(row.due_at - row.now)


def _conflicts(stored: str, req: ClaimRequest) -> bool:
    """Whether a delivery's arguments conflict with the entry's (gate CONFLICT).

    Other arguments under one key are a conflict, except where they may change: the entry
    holds no hash (``NO_ARGS_HASH``, written before task-id keyed entries were hashed), or
    the delivery says they may (``ClaimRequest.args_may_change``: a retry of an entry keyed
    by its task id). The claim then stores the new hash with the fence it takes.
    """
    return stored != req.args_hash and stored != NO_ARGS_HASH and not req.args_may_change


def token_hold(
    req: ClaimRequest, fence: int, token: Token, *, found: EntryStatus | None = None
) -> Claim:
    """The HOLD claim of a delivery that found no token: why, and when its token is due."""
    assert req.rate is not None
    why = hold_reason(req.rate, token.due_at, token.now)
    return Claim(
        Gate.HOLD, req.key, fence, found=found, reason=why, token_due_in=token.due_at - token.now
    )

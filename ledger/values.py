"""Frozen values the store takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_ledger.ledger.envelope import ArgumentSnapshot, Envelope
from celery_ledger.ledger.states import EntryStatus, Gate, StepState, StepStatus

#: Owner name written by recovery when it re-enqueues an entry: the next claim of that entry
#: takes it over at once instead of waiting for the lease recovery holds for it.
RESUME_OWNER = "celery-ledger:resume"

#: ``args_hash`` that entries keyed by their task id held before the arguments were hashed for
#: them too: "no hash", so it conflicts with nothing (the next claim that writes the entry
#: stores the real one).
NO_ARGS_HASH = "task-id"

#: The external reference of a transaction step's ``started`` row. Such a row is written only
#: for the first step of an entry that has no replay row yet, so that a crash inside it does
#: not make the body look stepless (a stepless body that ran is ambiguous). It is never
#: ambiguous itself: the step's writes commit with its ``completed`` row or not at all.
TRANSACTION_STEP_REF = "celery-ledger:transaction-step"

#: Statuses an operator may release. Never completed (it has a result), never failed with a
#: live attempt; a running entry only once its lease expired.
RELEASABLE = (
    EntryStatus.BLOCKED,
    EntryStatus.INTERRUPTED,
    EntryStatus.RUNNING,
    EntryStatus.FAILED,
    EntryStatus.RETRYING,
)

#: Why a tombstone (``tombstone_at``: retention pruned a settled entry's steps, events and
#: snapshot) is never released (design.md § "One envelope, one admission gate"): its completed steps
#: are forgotten, so a re-run would
#: run the whole body again, and the duplicate-execution rate could not see it.
TOMBSTONE_NOT_RELEASABLE = (
    "a tombstone: retention pruned it and forgot its steps, so a re-run could repeat a "
    "completed effect; it is not releasable (publish a new task for new work)"
)

#: In a blocked reason: the ambiguous effect step returned, and only its output could not be
#: stored (over ``ledger_max_result_bytes``, a socket, a generator). It executed, so a
#: ``not-executed`` release would run it again: ``show``, the CLI's ``release`` and Flower's
#: release form warn with ``STEP_RETURNED_WARNING`` (``step_returned``).
STEP_RETURNED = "returned, and only its output could not be stored"

#: What an operator is told about an entry blocked on a step that returned.
STEP_RETURNED_WARNING = (
    "its step returned (only its output could not be stored): it executed, and a "
    "not-executed release runs it again; release it --verified completed"
)


def step_returned(reason: str | None) -> bool:
    """Whether a blocked ``reason`` says its step returned (``STEP_RETURNED``)."""
    return reason is not None and STEP_RETURNED in reason


@dataclass(frozen=True)
class Owner:
    """Who runs an attempt: the Celery node name, that node's boot id, the process id."""

    node: str
    boot: str
    pid: int


@dataclass(frozen=True)
class SlotAsk:
    """What a claim asks of a concurrency key (``ledger.slots``): its name and the limit."""

    key: str
    limit: int


@dataclass(frozen=True)
class TokenAsk:
    """What a claim of a rate-limited task asks of its bucket (``rate_limits``): the bucket's
    name, the seconds between two tokens, the limit as written (``"5/s"``)."""

    bucket: str
    interval: float
    rate: str


@dataclass(frozen=True)
class ClaimRequest:
    """Everything ``LedgerStore.claim`` needs to decide a gate."""

    key: str
    task_name: str
    task_id: str
    args_hash: str
    snapshot: str | None
    side_effect: str
    owner: Owner
    lease_seconds: float
    #: An entry interrupted more often than this is blocked as a crash loop at its next claim.
    max_interruptions: int = 5
    #: The arguments may differ from the entry's (a retry, or the ledger's own re-send, of an
    #: entry keyed by its task id: ``retry(args=...)`` may change them). The claim then takes
    #: the new ``args_hash`` instead of answering CONFLICT.
    args_may_change: bool = False
    #: Where Celery's canvas put this delivery: its group (or chord header) id, and the task
    #: that published it. Stored on the entry for ``show``; never part of its identity.
    group_id: str | None = None
    parent_id: str | None = None
    #: The delivery's absolute deadline, seconds since the epoch (Celery's ``expires``, the
    #: ``ledger_deadline`` header). The claim stores the earliest deadline it knows and
    #: refuses the delivery once it passed (``admission``).
    deadline_at: float | None = None
    #: The task's ``deadline`` option: seconds after the entry was created (database clock).
    deadline_after: float | None = None
    #: The task's concurrency key and limit (docs/concurrency.md); None: it has none.
    slot: SlotAsk | None = None
    #: The task's ``ledger_rate_limit``: a claim that would run takes a token of this bucket,
    #: or is held until its token is due (gate HOLD with ``Claim.token_due_in``).
    rate: TokenAsk | None = None

    def insert_params(
        self, owner: str, boot: str | None, pid: int | None, *, executions: int
    ) -> dict[str, Any]:
        """The bind parameters of ``statements.claim_insert`` for this request."""
        return {
            "key": self.key,
            "task_name": self.task_name,
            "task_id": self.task_id,
            "side_effect": self.side_effect,
            "args_hash": self.args_hash,
            "snapshot": self.snapshot,
            "owner": owner,
            "owner_boot": boot,
            "owner_pid": pid,
            "lease": self.lease_seconds,
            "executions": executions,
            "group_id": self.group_id,
            "parent_id": self.parent_id,
            "dl_at": self.deadline_at,
            "dl_after": self.deadline_after,
        }


@dataclass(frozen=True)
class StepRecord:
    """One replay row."""

    name: str
    input_hash: str
    occurrence: int
    seq: int
    status: StepStatus
    fence: int
    output: str | None = None
    external_ref: str | None = None
    error: str | None = None
    attempts: int = 1
    authorized: int = 0
    started_at: float | None = None
    completed_at: float | None = None

    @property
    def ident(self) -> tuple[str, str, int]:
        return (self.name, self.input_hash, self.occurrence)

    @property
    def transaction_marker(self) -> bool:
        """A transaction step's ``started`` row (``TRANSACTION_STEP_REF``)."""
        return self.external_ref == TRANSACTION_STEP_REF

    @property
    def ambiguous(self) -> bool:
        """Started and never completed: the attempt that started it may or may not have made
        its effect. A transaction step's marker never is: its writes commit with its
        ``completed`` row or not at all. (While that attempt still holds a live lease the
        step may simply be running: ``state``.)"""
        return self.status is StepStatus.STARTED and not self.transaction_marker

    @property
    def may_have_run(self) -> bool:
        """Whether its effect may have happened: completed, or ambiguous."""
        return self.status is StepStatus.COMPLETED or self.ambiguous

    def state(self, live_lease: bool) -> StepState:
        """What an operator is told of this row, given whether the attempt that holds the
        entry (``Entry.live_lease``) is still alive."""
        if self.status is StepStatus.COMPLETED:
            return StepState.COMPLETED
        if self.status is StepStatus.NOT_EXECUTED:
            return StepState.NOT_EXECUTED
        if live_lease:
            return StepState.RUNNING
        if self.transaction_marker:
            return StepState.NOT_EXECUTED  # nothing of it committed: it runs again
        return StepState.AMBIGUOUS


@dataclass(frozen=True)
class Claim:
    """The outcome of a claim: the gate, the fence to write with, what the entry held."""

    gate: Gate
    key: str
    fence: int
    #: Status found before this claim (None for a new entry).
    found: EntryStatus | None = None
    result: str | None = None
    error: str | None = None
    reason: str | None = None
    #: For WAIT: seconds left on the other attempt's lease.
    lease_remaining: float | None = None
    #: For HOLD over a rate limit: seconds until the token is due (database clock); the
    #: delivery sends itself again for then.
    token_due_in: float | None = None
    #: For TAKEOVER and re-runs of ``retrying``: every replay row, loaded in the claim.
    steps: tuple[StepRecord, ...] = ()
    #: How many attempts ran the body before this one.
    executions: int = 0
    #: For TAKEOVER and re-runs: what the claim knew of the earlier attempts before it took
    #: the entry: their last sign of life (a claim, a renewal, a refused write; database
    #: clock), the lease it was renewed under, the fence up to which they are known dead
    #: (``mark-dead``, the worker-lost fast path, a boot sweep), and the database clock then.
    #: A reconciler's ``not_executed`` is trusted only past that sign's grace (``Ambiguity``).
    prior_alive_at: float | None = None
    prior_lease: float | None = None
    dead_fence: int | None = None
    now: float | None = None


@dataclass(frozen=True)
class Entry:
    """A whole ledger entry, as operators and recovery see it."""

    key: str
    task_name: str
    task_id: str
    status: EntryStatus
    fence: int
    side_effect: str
    args_hash: str
    snapshot: str | None
    owner: str | None
    owner_boot: str | None
    owner_pid: int | None
    lease_until: float | None
    result: str | None
    error: str | None
    reason: str | None
    executions: int
    interruptions: int
    created_at: float
    updated_at: float
    settled_at: float | None
    released_by: str | None
    released_reason: str | None
    released_at: float | None
    released_from: str | None
    #: ``executions`` when the last release was made: a second release waits for it to move.
    released_executions: int | None = None
    #: When recovery acts on an entry that waits for a time (database clock): a ``retrying``
    #: entry whose retry has not been claimed by then is re-sent. None when it waits for none.
    due_at: float | None = None
    #: ``mark-dead``: every attempt up to this fence is asserted dead (None: no assertion).
    dead_fence: int | None = None
    dead_by: str | None = None
    dead_reason: str | None = None
    dead_at: float | None = None
    #: The last refused write of a superseded attempt ("seen alive at"), its fence and worker.
    seen_alive_at: float | None = None
    seen_alive_fence: int | None = None
    seen_alive_owner: str | None = None
    #: design.md § "Durable time": a cancellation asked for (database clock), by whom and why.
    cancel_requested_at: float | None = None
    cancel_by: str | None = None
    cancel_reason: str | None = None
    #: design.md § "Durable time": no effect step starts after this (database clock).
    deadline_at: float | None = None
    #: design.md § "Durable time": pruned to a tombstone; the settled time (``settled_at`` is then
    #: None).
    tombstone_at: float | None = None
    #: The Celery group this task was published in, and the task that published it.
    group_id: str | None = None
    parent_id: str | None = None
    #: design.md § "One envelope, one admission gate": an attempt's last sign of life (claim or
    #: lease renewal, database clock) and
    #: the lease it took; the interrupt leaves both (``mark-dead`` reads them).
    renewed_at: float | None = None
    lease_seconds: float | None = None
    #: docs/concurrency.md: the entry's concurrency key, when it took (or was handed) a slot
    #: of it, and since when it waits for one (``sleeping``, reason ``slot:<key>``).
    concurrency_key: str | None = None
    slot_at: float | None = None
    waiting_since: float | None = None

    def lease_left(self, now: float) -> float | None:
        """Seconds left on the lease at ``now`` (database clock); negative once it expired."""
        return None if self.lease_until is None else self.lease_until - now

    def live_lease(self, now: float) -> bool:
        """Running under a lease that has not expired: an attempt may be in the body now."""
        left = self.lease_left(now)
        return self.status is EntryStatus.RUNNING and left is not None and left > 0

    @property
    def released_pending(self) -> bool:
        """Released, and no attempt has run the body since: the store's one-shot rule."""
        return self.released_executions is not None and self.executions == self.released_executions

    def release_refused(self, now: float) -> str | None:
        """Why an operator's release would be refused at ``now``, or None when it would not be
        for the entry's state (the store decides again under the row lock)."""
        if self.status not in RELEASABLE:
            return f"{self.status.value}: there is nothing to release"
        if self.tombstone_at is not None:
            return f"{self.status.value}, {TOMBSTONE_NOT_RELEASABLE}"
        if self.live_lease(now):
            return "running with a live lease: wait for it to expire or for the sweep"
        if self.released_pending:
            return f"released already by {self.released_by} and not run since: release is one-shot"
        return None

    @property
    def release_warning(self) -> str | None:
        """What to say beside a release: blocked on a step that returned (``step_returned``),
        a not-executed release would run it again."""
        if self.status is EntryStatus.BLOCKED and step_returned(self.reason):
            return STEP_RETURNED_WARNING
        return None

    @classmethod
    def from_row(cls, row: Any) -> Entry:
        data = dict(row._mapping)
        data["status"] = EntryStatus(data["status"])
        return cls(**data)


@dataclass(frozen=True)
class EventRecord:
    """One line of the audit trail."""

    id: int
    key: str
    task_id: str | None
    fence: int | None
    event: str
    status: str | None
    actor: str | None
    detail: str | None
    at: float


@dataclass(frozen=True)
class Interrupted:
    """An entry a sweep marked interrupted (or found so), with the fence it now carries."""

    key: str
    task_name: str
    task_id: str
    fence: int
    interruptions: int = 0
    has_snapshot: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    #: How many attempts claimed it: 0 for a publish intent, or a re-send, that no worker
    #: has claimed yet (its message may still wait in a queue: ``recovery.backlog``).
    executions: int = 1
    #: When the entry was created (database clock): how long it has waited.
    created_at: float | None = None

    @classmethod
    def from_row(cls, r: Any) -> Interrupted:
        """From a row with the entry's key, task name and id, fence, interruptions,
        ``has_snapshot``, executions and creation time (the sweep's reads and writes)."""
        return cls(
            r.key,
            r.task_name,
            r.task_id,
            r.fence,
            r.interruptions,
            bool(r.has_snapshot),
            executions=r.executions,
            created_at=r.created_at,
        )


@dataclass(frozen=True)
class Resuming:
    """An interrupted entry a resumer won (``begin_resume``): what it needs to re-send it."""

    task_name: str
    task_id: str
    #: The fence the CAS moved the entry to (the resume marker holds it until a claim).
    fence: int
    #: The argument snapshot to re-send (None: nothing to re-send from).
    snapshot: str | None
    #: Replay rows already completed, which the resumed attempt will short-circuit.
    completed_steps: int
    #: The entry's deadline (database clock), sent along with the envelope.
    deadline_at: float | None = None

    @classmethod
    def from_row(cls, row: Any) -> Resuming:
        """From a row returning the task name and id, fence, snapshot, ``completed_steps``
        and deadline (every compare-and-set that hands an entry to one re-sender)."""
        return cls(
            row.task_name,
            row.task_id,
            row.fence,
            row.snapshot,
            int(row.completed_steps),
            row.deadline_at,
        )


@dataclass(frozen=True)
class Overdue:
    """A ``retrying`` entry whose due time passed without a claim: its retry message may be
    lost (``SweepQueries.list_overdue_retries``)."""

    key: str
    task_name: str
    task_id: str
    fence: int
    #: When it was due (database clock, seconds since the epoch).
    due_at: float


__all__ = [
    "NO_ARGS_HASH",
    "RELEASABLE",
    "RESUME_OWNER",
    "STEP_RETURNED",
    "STEP_RETURNED_WARNING",
    "TOMBSTONE_NOT_RELEASABLE",
    "TRANSACTION_STEP_REF",
    "ArgumentSnapshot",
    "Claim",
    "ClaimRequest",
    "Entry",
    "Envelope",
    "EventRecord",
    "Interrupted",
    "Overdue",
    "Owner",
    "Resuming",
    "StepRecord",
    "step_returned",
]

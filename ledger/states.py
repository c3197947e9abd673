"""Entry states, claim gates, step states and side-effect classes: the ledger's vocabulary."""

from __future__ import annotations

from enum import Enum


class EntryStatus(str, Enum):
    """Where one effect identity (one ledger entry) stands."""

    #: An attempt holds the lease and may be running the body right now.
    RUNNING = "running"
    #: Settled with a result; every later delivery returns it.
    COMPLETED = "completed"
    #: Settled with an error; every later delivery raises it again.
    FAILED = "failed"
    #: The body asked for ``self.retry()``; completed steps are kept and replay.
    RETRYING = "retrying"
    #: The attempt is known or presumed gone; recovery may resume it.
    INTERRUPTED = "interrupted"
    #: Parked for an operator (ambiguous step, crash loop); never run automatically.
    BLOCKED = "blocked"
    #: Held by the ledger until ``due_at`` (a long countdown/ETA, or a long retry countdown):
    #: no broker holds a message for it; the sweep publishes it when due (design.md § "Durable
    #: time").
    SCHEDULED = "scheduled"
    #: The body called ``self.sleep()``: its attempt ended, the sweep re-sends it at ``due_at``
    #: and its completed steps replay (design.md § "Durable time").
    SLEEPING = "sleeping"
    #: Settled: cancelled by an operator (``celery-ledger cancel``) or ``revoke()``; every later
    #: delivery raises ``TaskCancelled`` (design.md § "Durable time").
    CANCELLED = "cancelled"
    #: Settled: its deadline (``expires``, ``deadline``) passed before it could finish; every
    #: later delivery raises ``TaskExpired`` (design.md § "Durable time").
    EXPIRED = "expired"

    @property
    def settled(self) -> bool:
        return self in (
            EntryStatus.COMPLETED,
            EntryStatus.FAILED,
            EntryStatus.CANCELLED,
            EntryStatus.EXPIRED,
        )

    @property
    def waits_for_time(self) -> bool:
        """Held until its ``due_at``: a delivery found meanwhile runs nothing (gate HOLD)."""
        return self in (EntryStatus.SCHEDULED, EntryStatus.SLEEPING)


class Gate(str, Enum):
    """What a claim decided for the delivery that asked."""

    #: New entry (or ``retrying``): run the body with this fence.
    RUN = "run"
    #: Settled already: return the stored result (or raise the stored failure).
    RETURN = "return"
    #: Another attempt holds a live lease: do not run beside it.
    WAIT = "wait"
    #: The previous attempt is gone (lease expired, interrupted): resume with replay.
    TAKEOVER = "takeover"
    #: Parked for an operator.
    BLOCK = "block"
    #: The business key was first claimed with different arguments.
    CONFLICT = "conflict"
    #: The entry is scheduled or sleeping: the ledger sends it when due; this delivery runs
    #: nothing and is acked (design.md § "Durable time").
    HOLD = "hold"


class StepStatus(str, Enum):
    """State of one replay row."""

    #: Intent written before an effect step ran; without ``completed`` it is ambiguous.
    STARTED = "started"
    #: The step returned; its output replays on resume.
    COMPLETED = "completed"
    #: Proven not executed (declared exception, reconciler or operator verdict): may run once more.
    NOT_EXECUTED = "not_executed"


class StepState(str, Enum):
    """What an operator is told of one replay row: its status read against the entry's lease.

    ``StepRecord.state`` decides it; the CLI's ``show`` and the Flower page print it.
    """

    #: The step returned; its output replays.
    COMPLETED = "completed"
    #: Proven not executed (or a transaction step whose writes did not commit): it runs again.
    NOT_EXECUTED = "not-executed"
    #: Started by the attempt that holds the entry's live lease: it may be running now.
    RUNNING = "running"
    #: Started, no completion recorded, and its attempt is gone: it may or may not have run.
    AMBIGUOUS = "ambiguous"


class SideEffect(str, Enum):
    """How a task's steps touch the outside world; decides what happens to an ambiguous step."""

    #: Reads only: re-run freely.
    READ = "read"
    #: Same effect however often it runs: re-run freely.
    IDEMPOTENT = "idempotent"
    #: The provider deduplicates on the stable key the step receives: re-run with the same key.
    KEYED = "keyed"
    #: Runs at most once; an ambiguous step goes to its reconciler, else blocks.
    NON_IDEMPOTENT = "non_idempotent"
    #: Like non_idempotent, but never re-run on ambiguity without an operator.
    IRREVERSIBLE = "irreversible"

    @property
    def writes_intent(self) -> bool:
        """Whether a step of this class records ``started`` before it runs."""
        return self in (SideEffect.KEYED, SideEffect.NON_IDEMPOTENT, SideEffect.IRREVERSIBLE)

    @property
    def rerun_when_ambiguous(self) -> bool:
        """Whether an ambiguous step of this class may simply run again."""
        return self in (SideEffect.READ, SideEffect.IDEMPOTENT, SideEffect.KEYED)


class Verdict(str, Enum):
    """A reconciler's or an operator's answer about an ambiguous step."""

    COMPLETED = "completed"
    NOT_EXECUTED = "not_executed"
    UNKNOWN = "unknown"

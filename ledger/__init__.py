"""celery-ledger's durable ledger: schema, store, identity, states, errors.

Knows nothing of Celery; a reader can test it with SQLAlchemy alone.
"""

from celery_ledger.ledger.crashloop import CrashLoop, crash_loop_reason
from celery_ledger.ledger.death import DeathSignal
from celery_ledger.ledger.errors import (
    DeathSignalRequired,
    EntryNotFound,
    Fenced,
    IdentityError,
    KeyConflict,
    LedgerBlocked,
    LedgerError,
    LedgerUnavailable,
    MalformedArguments,
    MalformedMessage,
    MarkDeadRefused,
    MissingKeyArgument,
    OperatorTextError,
    PayloadError,
    PayloadNotSerializable,
    PayloadTooLarge,
    ReferenceTooLong,
    ReleaseRefused,
    SchemaError,
    SchemaTooNew,
    SnapshotSealError,
)
from celery_ledger.ledger.identity import (
    canonical_json,
    declared_identity,
    entry_key,
    input_hash,
    is_declared,
    provider_key,
    step_provider_key,
)
from celery_ledger.ledger.links import LINKS_STEP, LinkQueries, Member, link_task_id
from celery_ledger.ledger.operator import (
    BODY_STEP,
    STEP_RETURNED,
    STEP_RETURNED_WARNING,
    LedgerStats,
    OperatorQueries,
    Release,
    step_returned,
)
from celery_ledger.ledger.operator_text import (
    MAX_RELEASE_BY_CHARS,
    MAX_RELEASE_REASON_CHARS,
    check_release_text,
)
from celery_ledger.ledger.outbox import (
    Child,
    OutboxMessage,
    OutboxQueries,
    child_task_id,
)
from celery_ledger.ledger.sealing import SnapshotCipher, cipher_from, is_sealed, open_snapshot
from celery_ledger.ledger.states import EntryStatus, Gate, SideEffect, StepStatus, Verdict
from celery_ledger.ledger.store import LedgerStore
from celery_ledger.ledger.transactions import TRANSACTION_STEP_REF, TransactionSteps
from celery_ledger.ledger.values import (
    NO_ARGS_HASH,
    RESUME_OWNER,
    ArgumentSnapshot,
    Claim,
    ClaimRequest,
    Entry,
    Envelope,
    EventRecord,
    Interrupted,
    Overdue,
    Owner,
    Resuming,
    StepRecord,
)

__all__ = [
    # Store
    "LedgerStore",
    "OperatorQueries",
    "OutboxQueries",
    "LedgerStats",
    "Release",
    "DeathSignal",
    "check_release_text",
    "MAX_RELEASE_BY_CHARS",
    "MAX_RELEASE_REASON_CHARS",
    "STEP_RETURNED",
    "STEP_RETURNED_WARNING",
    "step_returned",
    # Outbox
    "Child",
    "OutboxMessage",
    "child_task_id",
    "LINKS_STEP",
    "link_task_id",
    "LinkQueries",
    "Member",
    "TRANSACTION_STEP_REF",
    "TransactionSteps",
    # Values
    "ArgumentSnapshot",
    "Envelope",
    "Claim",
    "ClaimRequest",
    "Entry",
    "EventRecord",
    "Interrupted",
    "Overdue",
    "Resuming",
    "Owner",
    "StepRecord",
    "RESUME_OWNER",
    "NO_ARGS_HASH",
    "BODY_STEP",
    # Encryption at rest
    "SnapshotCipher",
    "cipher_from",
    "is_sealed",
    "open_snapshot",
    # States
    "EntryStatus",
    "Gate",
    "SideEffect",
    "StepStatus",
    "Verdict",
    # Identity
    "canonical_json",
    "entry_key",
    "input_hash",
    "provider_key",
    "step_provider_key",
    "declared_identity",
    "is_declared",
    # Crash loops
    "CrashLoop",
    "crash_loop_reason",
    # Errors
    "LedgerError",
    "LedgerUnavailable",
    "SchemaError",
    "SchemaTooNew",
    "IdentityError",
    "MissingKeyArgument",
    "MalformedArguments",
    "MalformedMessage",
    "PayloadError",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "KeyConflict",
    "LedgerBlocked",
    "ReleaseRefused",
    "OperatorTextError",
    "DeathSignalRequired",
    "MarkDeadRefused",
    "SnapshotSealError",
    "ReferenceTooLong",
    "EntryNotFound",
    "Fenced",
]

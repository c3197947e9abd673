"""celery-ledger's durable ledger: schema, store, identity, states, errors.

Knows nothing of Celery; a reader can test it with SQLAlchemy alone.
"""

from ledger.errors import (
    EntryNotFound,
    Fenced,
    IdentityError,
    KeyConflict,
    LedgerBlocked,
    LedgerError,
    LedgerUnavailable,
    PayloadError,
    PayloadNotSerializable,
    PayloadTooLarge,
    ReleaseRefused,
    SchemaError,
    SchemaTooNew,
)
from ledger.identity import canonical_json, entry_key, input_hash, provider_key
from ledger.operator import BODY_STEP, LedgerStats, OperatorQueries, Release
from ledger.states import EntryStatus, Gate, SideEffect, StepStatus, Verdict
from ledger.values import (
    RESUME_OWNER,
    Claim,
    ClaimRequest,
    Entry,
    EventRecord,
    Interrupted,
    Owner,
    Resuming,
    StepRecord,
)


class LedgerStore(OperatorQueries):
    """The ledger store: hot path (``ledger.store``), sweeps (``ledger.sweeps``) and operator
    queries (``ledger.operator``) over one engine per process."""


__all__ = [
    # Store
    "LedgerStore",
    "LedgerStats",
    "Release",
    # Values
    "Claim",
    "ClaimRequest",
    "Entry",
    "EventRecord",
    "Interrupted",
    "Resuming",
    "Owner",
    "StepRecord",
    "RESUME_OWNER",
    "BODY_STEP",
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
    # Errors
    "LedgerError",
    "LedgerUnavailable",
    "SchemaError",
    "SchemaTooNew",
    "IdentityError",
    "PayloadError",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "KeyConflict",
    "LedgerBlocked",
    "ReleaseRefused",
    "EntryNotFound",
    "Fenced",
]

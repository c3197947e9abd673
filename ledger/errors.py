"""The ledger's errors.

The tree::

    LedgerError
    ├── LedgerUnavailable        the database cannot be reached
    ├── SchemaError
    │   └── SchemaTooNew         the database was migrated by newer code
    ├── IdentityError            key material or arguments are not canonical JSON
    ├── PayloadError
    │   ├── PayloadNotSerializable
    │   └── PayloadTooLarge
    ├── KeyConflict              a business key reused with different arguments
    ├── LedgerBlocked            the entry is parked for an operator
    ├── ReleaseRefused           an operator release that is not allowed
    └── EntryNotFound

    Fenced (BaseException)       this attempt was superseded and must stop

``Fenced`` derives from ``BaseException`` on purpose: a task body that wraps its work in
``except Exception`` must not swallow the signal that it no longer owns the entry (the same
reason rq's ``ShutDownImminentException`` and asyncio's ``CancelledError`` sit outside
``Exception``).
"""

from __future__ import annotations


class LedgerError(Exception):
    """Root of every error the ledger raises on purpose."""


class LedgerUnavailable(LedgerError):
    """Raised when the ledger database cannot be reached or refuses the connection."""


class SchemaError(LedgerError):
    """Raised when the ledger schema is not usable by this code."""


class SchemaTooNew(SchemaError):
    """Raised when the database schema was written by a newer celery-ledger than this one."""


class IdentityError(LedgerError, ValueError):
    """Raised when key material or arguments cannot be turned into canonical JSON."""


class PayloadError(LedgerError):
    """Raised when a result or step output cannot be stored."""


class PayloadNotSerializable(PayloadError, TypeError):
    """Raised when a result or step output cannot be serialized."""


class PayloadTooLarge(PayloadError, ValueError):
    """Raised when a serialized result or step output exceeds the configured limit."""


class KeyConflict(LedgerError):
    """Raised when a business key was first claimed with different arguments."""


class LedgerBlocked(LedgerError):
    """Raised when the entry is parked for an operator; the body does not run."""


class ReleaseRefused(LedgerError):
    """Raised when an operator release is not allowed (settled, live lease, released already)."""


class EntryNotFound(LedgerError, KeyError):
    """Raised when no entry has the given key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "entry not found"


class Fenced(BaseException):
    """Raised inside an attempt whose fence was superseded: it may write nothing more."""

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

A database error becomes ``LedgerUnavailable`` in one place, ``as_unavailable``: the SQLAlchemy
path, the hot path's raw cursors and every connect go through ``translate_db_errors``, which asks
it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from sqlalchemy import exc as sa_exc


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


# -- database errors ---------------------------------------------------------------------------

#: PEP 249 error classes that mean "the ledger database cannot be reached, or not now": the
#: only ones that become ``LedgerUnavailable`` (and so retry the task later instead of failing
#: it). Matched by name on SQLAlchemy's wrappers and on the driver's own classes alike, so a
#: name added here widens the classification for every path at once.
UNAVAILABLE_ERRORS = ("OperationalError", "InterfaceError")

_SA_UNAVAILABLE = tuple(getattr(sa_exc, name) for name in UNAVAILABLE_ERRORS)


def as_unavailable(exc: BaseException, dbapi: ModuleType | None = None) -> LedgerUnavailable | None:
    """Classify a database error: the ``LedgerUnavailable`` it means, or None.

    ``exc`` is a SQLAlchemy ``DBAPIError`` (statements through SQLAlchemy, and every connect
    through a pool), or a raw error of the driver module ``dbapi`` (the hot path's cursors). The
    message carries the driver's own words, never SQLAlchemy's wrapper text.
    """
    if isinstance(exc, sa_exc.DBAPIError):
        if not isinstance(exc, _SA_UNAVAILABLE):
            return None
        cause: BaseException = exc.orig or exc
    elif dbapi is not None and isinstance(
        exc, tuple(getattr(dbapi, name) for name in UNAVAILABLE_ERRORS)
    ):
        cause = exc
    else:
        return None
    return LedgerUnavailable(f"ledger database unavailable: {cause}")


@contextmanager
def translate_db_errors(dbapi: ModuleType | None = None) -> Iterator[None]:
    """Raise what ``as_unavailable`` makes of a database error in the block; re-raise the rest.

    Raises:
        LedgerUnavailable: the database cannot be reached (the driver's error is its cause).
    """
    try:
        yield
    except Exception as exc:
        unavailable = as_unavailable(exc, dbapi)
        if unavailable is None:
            raise
        raise unavailable from exc

"""The ledger's errors.

The tree::

    LedgerError
    ├── LedgerUnavailable        the database cannot be reached or take a write
    ├── SchemaError
    │   └── SchemaTooNew         the database was migrated by newer code
    ├── IdentityError            key material or arguments are not canonical JSON
    │   ├── MissingKeyArgument   a call does not give an argument its business key names
    │   ├── MalformedArguments   a delivery's arguments cannot be keyed or stored
    │   └── MalformedMessage     a message's fields are of the wrong kind (args no list ...)
    ├── PayloadError
    │   ├── PayloadNotSerializable
    │   └── PayloadTooLarge
    ├── KeyConflict              a business key reused with different arguments
    ├── LedgerBlocked            the entry is parked for an operator
    ├── AdmissionRefused         the admission gate refused a delivery or its next effect
    │   ├── TaskCancelled        a cancellation was recorded (``cancel``, ``revoke()``)
    │   ├── TaskExpired          its deadline passed on the database clock
    │   └── KeyPruned            its key settled long ago and was pruned to a tombstone
    ├── ReleaseRefused           an operator release that is not allowed
    │   ├── OperatorTextError    its who or why is empty, too long or unprintable
    │   └── DeathSignalRequired  a not-executed release of an ambiguous step, no mark-dead
    ├── MarkDeadRefused          the old owner showed signs of life within the grace window
    ├── SnapshotSealError        a sealed snapshot cannot be opened, or a key is not usable
    ├── ReferenceTooLong         a key, prefix or task id to look up is longer than any stored
    ├── SignalRefused            a signal to a settled entry, or whose payload is not JSON
    └── EntryNotFound

    Fenced (BaseException)       this attempt was superseded and must stop

``Fenced`` derives from ``BaseException`` on purpose: a task body that wraps its work in
``except Exception`` must not swallow the signal that it no longer owns the entry (the same
reason rq's ``ShutDownImminentException`` and asyncio's ``CancelledError`` sit outside
``Exception``).

``TaskCancelled``, ``TaskExpired`` and ``KeyPruned`` are what a caller's ``AsyncResult.get()``
raises (exported as ``celery_ledger.TaskCancelled`` ...). The ledger stores them in settled
entries, so they live here, with the one writer of a stored failure (``stored_failure``, the
form of Celery's JSON ``prepare_exception``) and its reader's table of classes that moved
(``MOVED``): a row stored when they lived in ``celery_ledger.timing`` still raises them.

A database error becomes ``LedgerUnavailable`` in one place, ``as_unavailable``: the SQLAlchemy
path, the hot path's raw cursors and every connect go through ``translate_db_errors``, which asks
it. The rule: anything a driver raises is unavailability, except a bug in our SQL
(``BUG_ERRORS``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from sqlalchemy import exc as sa_exc


class LedgerError(Exception):
    """Root of every error the ledger raises on purpose."""


class LedgerUnavailable(LedgerError):
    """Raised when the ledger database cannot be reached, or cannot take a statement now
    (refused, read-only, corrupt, full): every driver error but a bug in our SQL."""


class SchemaError(LedgerError):
    """Raised when the ledger schema is not usable by this code."""


class SchemaTooNew(SchemaError):
    """Raised when the database schema was written by a newer celery-ledger than this one."""


class IdentityError(LedgerError, ValueError):
    """Raised when key material or arguments cannot be turned into canonical JSON."""


class MissingKeyArgument(IdentityError):
    """Raised when a call does not give an argument its business key is made of: without it,
    every such call would share one key (guarantees.md § "Bad input"). Nothing ran and nothing was
    recorded."""


class MalformedArguments(IdentityError):
    """Raised at a worker when a delivery's arguments cannot be keyed or stored: they do not
    fit the task's signature, its ``key_from`` raised on them, or they hold what JSON cannot
    keep (a lone surrogate). Nothing ran; the delivery's entry, keyed by its task id, ends
    ``failed`` with this reason, so that ``list`` and ``show`` find it (guarantees.md § "Bad
    input")."""


class MalformedMessage(IdentityError):
    """Raised in a worker's parent for a message whose fields are of the wrong kind: ``args``
    no list, ``kwargs`` no mapping, a ``timelimit`` that is no pair of numbers (guarantees.md § "Bad
    input").
    Nothing ran; its entry, keyed by its task id, ends ``failed`` with this reason."""


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


class AdmissionRefused(LedgerError):
    """Raised when the admission gate (``ledger.admission``) refused a delivery, or the next
    effect step of a running one: no effect ran after the refusal, and none will."""


class TaskCancelled(AdmissionRefused):
    """The task was cancelled (``celery-ledger cancel``, ``revoke()``); no further effect ran."""


class TaskExpired(AdmissionRefused):
    """The task's deadline (``expires``, ``deadline``) passed; no further effect ran."""


class KeyPruned(AdmissionRefused):
    """A late delivery of a key whose entry retention pruned to a tombstone: it settled failed,
    cancelled or expired long ago, and it is not run again."""


class ReleaseRefused(LedgerError):
    """Raised when an operator release is not allowed (settled, live lease, released already)."""


class OperatorTextError(ReleaseRefused, ValueError):
    """Raised when the who or why of a release is empty, too long, or not printable text."""


class DeathSignalRequired(ReleaseRefused):
    """Raised when a ``not-executed`` release of an ambiguous step waits for ``mark-dead``
    (``ledger_release_requires_death_signal``)."""


class MarkDeadRefused(LedgerError):
    """Raised when ``mark-dead`` is refused: the old owner renewed its lease, or tried to
    write, within the grace window (or the entry is completed)."""


class SnapshotSealError(LedgerError, ValueError):
    """Raised when a sealed (encrypted) argument snapshot cannot be opened here, or a
    ``ledger_snapshot_keys`` key is not a usable Fernet key."""


class ReferenceTooLong(LedgerError, ValueError):
    """Raised when a key, key prefix or task id to look an entry up by is longer than any
    stored one: bad input, answered before the database is asked (SQLite refuses a LIKE
    pattern over 50,000 bytes, which read as an outage)."""


class SignalRefused(LedgerError, ValueError):
    """Raised when a signal cannot be kept: its entry is settled (no wait is left to take
    it), or its payload is not JSON. Nothing is written."""


class EntryNotFound(LedgerError, KeyError):
    """Raised when no entry has the given key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "entry not found"


class Fenced(BaseException):
    """Raised inside an attempt whose fence was superseded: it may write nothing more."""


# -- the stored failure -----------------------------------------------------------------------

#: A failure too large for its limit keeps its type and at most this much of its text.
SHORT_MESSAGE_CHARS = 2000

#: Classes that moved, by the ``(exc_module, exc_type)`` a stored row names -> their module
#: now. A settled entry keeps its failure for the retention window (and a tombstone's longer),
#: so a row may name where a class lived when it was written.
MOVED = {
    ("celery_ledger.timing", "TaskCancelled"): __name__,
    ("celery_ledger.timing", "TaskExpired"): __name__,
    ("celery_ledger.timing", "KeyPruned"): __name__,
}


def stored_failure(
    exc: BaseException, *, limit: int | None = None, dumps: Callable[[Any], str] = json.dumps
) -> str:
    """``exc`` as the ledger stores a failure, the one writer of that form.

    The form is Celery's JSON ``prepare_exception``: ``exc_type`` (the class's qualified
    name), ``exc_message`` (its arguments, each one ``dumps`` cannot encode as its repr) and
    ``exc_module``; Celery's ``exception_to_python`` reads it back, and every later delivery of
    the key raises it again (gate RETURN). ``dumps`` is the JSON the caller stores with (the
    runtime passes kombu's, which keeps a datetime as Celery would). Over ``limit`` bytes
    (``ledger_max_exception_bytes``), or not encodable at all, it keeps the type's name and
    the first ``SHORT_MESSAGE_CHARS`` of its repr under ``builtins``, so that the settle that
    stores it is never stopped by an odd exception.

    Raises:
        PayloadTooLarge: even the short form exceeds ``limit``.
    """
    kind = type(exc)
    try:
        text = dumps(
            {
                "exc_type": getattr(kind, "__qualname__", kind.__name__),
                "exc_message": [_encodable(arg, dumps) for arg in exc.args],
                "exc_module": kind.__module__,
            }
        )
    except Exception:  # noqa: BLE001 - an odd exception must not stop the settle that stores it
        text = None
    if text is not None and (limit is None or len(text.encode("utf-8")) <= limit):
        return text
    short = json.dumps(
        {
            "exc_type": kind.__name__,
            "exc_message": [_repr(exc)[:SHORT_MESSAGE_CHARS]],
            "exc_module": "builtins",
        }
    )
    if limit is not None and len(short.encode("utf-8")) > limit:
        raise PayloadTooLarge(
            f"stored exception is {len(short.encode('utf-8'))} bytes serialized, over the limit "
            f"of {limit} bytes (ledger_max_exception_bytes)"
        )
    return short


def loadable_failure(data: Any) -> Any:
    """A stored failure (decoded) as ``exception_to_python`` should read it now: a class that
    moved (``MOVED``) is named where it lives. Anything else comes back as it is."""
    if not isinstance(data, dict):
        return data
    moved = MOVED.get((str(data.get("exc_module")), str(data.get("exc_type"))))
    return data if moved is None else {**data, "exc_module": moved}


def _encodable(arg: Any, dumps: Callable[[Any], str]) -> Any:
    try:
        dumps(arg)
    except Exception:  # noqa: BLE001 - what Celery's ensure_serializable does
        return _repr(arg)
    return arg


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not stop the settle
        return f"<unrepresentable {type(value).__name__}>"


# -- database errors ---------------------------------------------------------------------------

#: PEP 249 error classes that mean a bug in our SQL or in the data we sent: the statement is
#: wrong (ProgrammingError), or a value or constraint it carries is (DataError, IntegrityError,
#: NotSupportedError). Retrying would repeat what can never succeed, so these propagate.
BUG_ERRORS = ("ProgrammingError", "IntegrityError", "DataError", "NotSupportedError")

#: Every other PEP 249 class means the ledger cannot take the statement now, whatever the
#: statement: ``LedgerUnavailable`` (the body does not run, the message comes back with
#: backoff). OperationalError: unreachable, ended by the administrator (57P01), disk full
#: (53100, SQLITE_FULL), locked, serialization failure, statement timeout. InternalError:
#: read-only transaction (25006, a failover to a standby), data or index corrupted (XX001,
#: XX002). DatabaseError itself: what SQLite raises for a file that is not, or no longer, a
#: database (SQLITE_NOTADB, SQLITE_CORRUPT). InterfaceError: the driver lost its connection.
UNAVAILABLE_ERRORS = ("OperationalError", "InterfaceError", "InternalError", "DatabaseError")

#: SQLSTATEs a driver files under a bug class that still mean the database refuses us, not
#: that our SQL is wrong: 42501 insufficient_privilege (write access revoked: the same
#: "refuses writes" as a read-only standby).
REFUSED_SQLSTATES = frozenset({"42501"})

_SA_BUGS = tuple(getattr(sa_exc, name) for name in BUG_ERRORS)


def as_unavailable(exc: BaseException, dbapi: ModuleType | None = None) -> LedgerUnavailable | None:
    """Classify a database error: the ``LedgerUnavailable`` it means, or None.

    The rule: every driver error is unavailability except a bug in our SQL (``BUG_ERRORS``,
    less ``REFUSED_SQLSTATES``). When in doubt the ledger fails closed: a bug misread as an
    outage re-sends the task with backoff, loudly, and runs nothing; an outage misread as a bug
    would fail the task for good.

    ``exc`` is a SQLAlchemy ``DBAPIError`` (statements through SQLAlchemy, and every connect
    through a pool), or a raw error of the driver module ``dbapi`` (the hot path's cursors).
    Anything else (not a driver error) is None. The message carries the driver's own words,
    never SQLAlchemy's wrapper text.
    """
    if isinstance(exc, sa_exc.DBAPIError):
        cause: BaseException = exc.orig or exc
        bug = isinstance(exc, _SA_BUGS)
    elif dbapi is not None and isinstance(exc, dbapi.Error):  # PEP 249's root class
        cause = exc
        bug = isinstance(exc, tuple(getattr(dbapi, name) for name in BUG_ERRORS))
    else:
        return None
    if bug and getattr(cause, "sqlstate", None) not in REFUSED_SQLSTATES:
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

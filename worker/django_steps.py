"""Transaction steps on Django's connection: ``django_transaction_step`` inside
``transaction.atomic()``.

Most Celery shops write through Django's ORM, on Django's connection, not SQLAlchemy's. When
the ledger lives in Django's database (``ledger_url`` names the same PostgreSQL database or
SQLite file as ``DATABASES[using]``), a step's model writes and its ``completed`` row can
commit together: the step runs ``fn`` inside ``transaction.atomic(using=using)`` and writes the
row on Django's own DBAPI connection, with the hot path's compiled statement (the same one
``commit_step`` runs, on another cursor). So:

- a death anywhere before Django commits leaves neither the writes nor the row; the next
  attempt runs ``fn`` again;
- a fence that moved (a zombie attempt) writes no row; ``Fenced`` is raised inside the atomic
  block, which rolls the writes back;
- called inside an atomic block of the caller's, the step is a savepoint of it, and the row
  commits (or rolls back) with the caller's outer transaction; children sent with
  ``self.send`` are published on Django's ``on_commit``.

The driver must be the ledger's (psycopg 3 for PostgreSQL, ``sqlite3`` for SQLite). On SQLite,
give Django ``"OPTIONS": {"transaction_mode": "IMMEDIATE"}`` (Django 5.1+): a deferred
transaction that reads before it writes can fail to take the write lock while a ledger write
holds it. Django is imported only when a Django step runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_ledger.attempt import Attempt
from celery_ledger.codec import arguments_hash, decode, encode
from celery_ledger.crashpoints import crash_point


class _Refused(Exception):
    """The step's row was refused (the fence moved): leave the atomic block rolled back."""


def django_transaction_step(
    attempt: Attempt,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    using: str = "default",
) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``transaction.atomic(using=using)`` with the step's
    completed row written on Django's connection; on replay, the stored output.

    Raises:
        Fenced: this attempt was superseded (the atomic block rolled back).
        LedgerBlocked: the step's input drifted; the entry is parked.
    """
    from django.db import connections, transaction

    tx = attempt.transaction(name, arguments_hash([list(args), kwargs]))
    if tx.replayed:
        return tx.output
    conn = connections[using]
    sends = attempt.enter_transaction(tx.ident)
    try:
        with transaction.atomic(using=using):
            output = fn(*args, **kwargs)
            # Django refuses commit() and rollback() inside atomic() itself; set_rollback(True)
            # would roll the writes back with the row while the step returned as done.
            if transaction.get_rollback(using=using):
                attempt.transaction_ended(tx.ident, "transaction.set_rollback(True)")
            encoded = encode(
                output,
                limit=attempt.settings.max_result_bytes,
                what=f"output of transaction step {name!r}",
            )
            crash_point(attempt.settings, f"txn-written:{name}")
            conn.ensure_connection()
            if not attempt.complete_on_connection(
                conn.connection, tx.ident, tx.seq, encoded, sends
            ):
                raise _Refused  # rolls the atomic block back before the attempt stops
            if sends.children:
                transaction.on_commit(
                    lambda: attempt.publish_children(tx.ident, sends), using=using
                )
    except _Refused:
        # Inside the caller's own atomic block the outer transaction is still open; the
        # savepoint is rolled back and Fenced propagates through the caller's block.
        attempt.refuse_transaction(tx.ident)
    finally:
        attempt.leave_transaction()
    crash_point(attempt.settings, f"step-completed:{name}")
    return decode(encoded)

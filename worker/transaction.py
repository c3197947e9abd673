"""Transaction steps: ``with self.transaction("credit") as conn:`` and
``self.transaction_step("credit", fn, *args)``.

The block runs on a connection of the ledger's engine, inside a transaction; when it ends
without an exception, the step's ``completed`` row (its output, and the children it sent with
``self.send``) is written on the same connection and the transaction commits: the block's
writes and the row together, or neither (``celery_ledger.ledger.transactions`` has the
argument). A death anywhere inside commits nothing, and the next attempt runs the block again;
there is no ambiguous window and no reconciler. The condition: the application's tables live
in the ledger's database (or the ledger's tables in the application's: ``ledger_url``).

On replay (the row committed before), the block does not run: ``transaction_step`` returns the
stored output without calling ``fn``; the ``with`` form skips its block (see
``TransactionStep.__enter__``) and holds the stored output in ``.output``.

``session=True`` hands the block an ORM ``Session`` bound to that connection instead: it is
flushed before the row is written, and its ``commit()`` inside the block only flushes (the
session joined a transaction it did not begin; the step commits it).
"""

from __future__ import annotations

import contextlib
import sys
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from celery_ledger.codec import decode, encode
from celery_ledger.crashpoints import crash_point

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from celery_ledger.outbox import Sends
    from celery_ledger.replay import Ident
    from celery_ledger.settings import LedgerSettings


class TransactionOwner(Protocol):
    """What a transaction step needs from its attempt (``Attempt``; a protocol, so that the
    attempt, which makes transaction steps, and this module do not import each other)."""

    settings: LedgerSettings

    def open_transaction(self) -> AbstractContextManager[Any]: ...

    def enter_transaction(self, ident: Ident) -> Sends: ...

    def leave_transaction(self) -> None: ...

    def complete_transaction(
        self, conn: Any, ident: Ident, seq: int, encoded: str, sends: Sends
    ) -> bool: ...

    def refuse_transaction(self, ident: Ident) -> NoReturn: ...

    def transaction_ended(self, ident: Ident, how: str) -> NoReturn: ...

    def publish_children(self, ident: Ident, sends: Sends) -> None: ...


class _SkipBlock(Exception):
    """Raised on the first line of a replayed ``with`` block, which then never runs."""


class TransactionStep:
    """One transaction step: run it (``run`` / the ``with`` block) or replay it.

    ``output``: what the step returns: set it inside the ``with`` block to store a value; on
    replay it holds the stored value. ``replayed``: whether the step was replayed.
    """

    def __init__(
        self,
        attempt: TransactionOwner,
        ident: Ident,
        seq: int,
        *,
        replayed: str | None,
        session: bool,
    ) -> None:
        self._attempt = attempt
        self.ident = ident
        self._seq = seq
        self.replayed = replayed is not None
        self.output: Any = decode(replayed) if replayed is not None else None
        self._session = session
        self._stack: contextlib.ExitStack | None = None
        self._handle: Any = None
        self._conn: Any = None
        #: The transaction the step began on ``_conn``: the row is written only in it.
        self._began: Any = None
        self._sends: Sends | None = None
        self._trace: Any = None

    @property
    def name(self) -> str:
        return self.ident[0]

    @property
    def seq(self) -> int:
        """The step's execution order (its replay row's ``seq``)."""
        return self._seq

    # -- the function form ----------------------------------------------------------------

    def run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(conn_or_session, *args, **kwargs)`` in the transaction; its return value is
        the step's output. On replay, the stored output, and ``fn`` is not called."""
        if self.replayed:
            return self.output
        handle = self._open()
        try:
            self.output = fn(handle, *args, **kwargs)
        except BaseException:
            self._close()
            raise
        return self._commit()

    # -- the with form --------------------------------------------------------------------

    def __enter__(self) -> Any:
        if not self.replayed:
            return self._open()
        # Replay: the block must not run. Python cannot skip a with-block from __enter__, so
        # the caller's frame gets a trace function that raises on the block's first line, and
        # __exit__ swallows exactly that exception. Whatever tracer was installed before
        # (a debugger, coverage) is put back in __exit__.
        self._trace = sys.gettrace()
        sys.settrace(lambda *_: None)
        caller = sys._getframe(1)
        caller.f_trace_lines = True
        caller.f_trace = self._skip
        return None

    def _skip(self, frame: FrameType, event: str, arg: Any) -> Any:
        raise _SkipBlock

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self.replayed:
            sys.settrace(self._trace)
            frame = sys._getframe(1)
            frame.f_trace = None
            return exc_type is _SkipBlock
        if exc_type is not None:
            self._close()
            return False
        self._commit()
        return False

    # -- both -----------------------------------------------------------------------------

    def _open(self) -> Any:
        attempt = self._attempt
        stack = self._stack = contextlib.ExitStack()
        conn = self._conn = stack.enter_context(attempt.open_transaction())
        self._began = conn.get_transaction()
        self._sends = attempt.enter_transaction(self.ident)
        stack.callback(attempt.leave_transaction)
        if self._session:
            # The ORM only here: a worker that never asks for a Session never loads its modules
            # (6 MiB, in every process forked from the worker).
            from sqlalchemy.orm import Session

            session = Session(bind=conn)
            stack.callback(session.close)
            self._handle = session
            return session
        self._handle = conn
        return conn

    def _close(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()  # leaves the step, closes the session, rolls the connection back

    def _commit(self) -> Any:
        """Write the row and commit; returns what replay would return."""
        attempt = self._attempt
        assert self._stack is not None and self._sends is not None
        sends = self._sends
        try:
            if self._session:
                self._handle.flush()  # the Session's pending writes, before the row
            # A block that committed or rolled back the step's transaction wrote (or will
            # write) outside it: a row written now would count those writes as done with
            # it, and a death before the row would run the block, and its commit, again.
            began = self._began
            if not began.is_active or self._conn.get_transaction() is not began:
                attempt.transaction_ended(self.ident, "commit() or rollback() on its connection")
            encoded = encode(
                self.output,
                limit=attempt.settings.max_result_bytes,
                what=f"output of transaction step {self.name!r}",
            )
            crash_point(attempt.settings, f"txn-written:{self.name}")
            ok = attempt.complete_transaction(self._conn, self.ident, self._seq, encoded, sends)
        finally:
            self._close()
        if not ok:
            attempt.refuse_transaction(self.ident)
        crash_point(attempt.settings, f"step-completed:{self.name}")
        attempt.publish_children(self.ident, sends)
        self.output = decode(encoded)
        return self.output

"""What a step call does: place it in the replay book, run it or replay it, and keep what it
sent for the outbox.

``StepRunner`` is a role of ``Attempt`` (``worker/attempt.py``), which mixes it in: the runner
decides, in the order the attempt's module docstring argues (``started`` before the body,
``completed`` after), and every write it asks for is the attempt's, under its fence
(``_write``, ``write_completed``, ``write_marker``); the children it recorded are published
after their row commits (``publish_children``). This module imports
nothing of the attempt's: the members it uses are declared below, for the type checker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from celery_ledger import otel
from celery_ledger.codec import arguments_hash, decode, encode
from celery_ledger.crashpoints import crash_point
from celery_ledger.errors import (
    Drift,
    NestedStepError,
    SendRefused,
    StepUsageError,
    TransactionEndedError,
)
from celery_ledger.ledger import (
    LedgerStore,
    OutboxMessage,
    PayloadError,
    SideEffect,
    SnapshotCipher,
    StepRecord,
    StepStatus,
    cipher_from,
)
from celery_ledger.outbox import Sends
from celery_ledger.recovery.outbox import publish
from celery_ledger.replay import Ident, Identify, ReplayBook, check_step_name, identity_of
from celery_ledger.transaction import TransactionStep

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from celery_ledger.settings import LedgerSettings

log = logging.getLogger(__name__)

#: Child task names already warned about (``_warn_if_not_ledgered``): once per process.
_warned_children: set[str] = set()


class AttemptTask(Protocol):
    """What an attempt reads from its task (``LedgerTask``)."""

    name: str
    side_effect: str
    app: Any
    #: ``keyed`` tasks: how long the provider keeps an idempotency key (None: no window).
    provider_key_ttl: float | None


def _warn_if_not_ledgered(app: Any, name: str) -> None:
    """Warn once when a child sent through the outbox is a task this app knows and that is not
    ledgered: a re-publish (a crash between the publish and its mark) would run it twice,
    since only a ledgered child's claim deduplicates by task id. Warn once too when no task of
    that name is registered here: it may be another service's, so it is sent, but a typo
    would be published to a queue no worker runs it from, and lost."""
    if name in _warned_children:
        return
    task = (getattr(app, "tasks", None) or {}).get(name)
    # Duck-typed (``LedgerTask`` imports this module): a ledgered task has ``ledger_key``.
    if task is not None and callable(getattr(task, "ledger_key", None)):
        return
    _warned_children.add(name)
    if task is None:
        log.warning(
            "child task %s sent through the outbox: no app here registers it; it is "
            "published, and lost unless some worker runs a task of that name",
            name,
        )
        return
    log.warning(
        "child task %s sent through the outbox is not a LedgerTask: a crash between its "
        "publish and its mark publishes it twice, and nothing deduplicates it",
        name,
    )


class StepRunner:
    """The step calls of one attempt: ``step``, ``send``, ``transaction``."""

    # The attempt's state the runner reads and moves (``Attempt.__init__`` sets all of it).
    task: AttemptTask
    settings: LedgerSettings
    key: str
    fence: int
    task_id: str
    side_effect: SideEffect
    _replay: ReplayBook
    _seq: int
    #: The step whose body is running now (for record_external_ref / provider_key).
    current: Ident | None
    #: Whether ``current`` wrote a ``started`` row (the row an external ref goes on).
    _current_has_row: bool
    #: Set when an exception escaped from a started effect step: it may have crossed.
    ambiguous: Ident | None
    #: Set with ``ambiguous`` when that step returned and only its output could not be stored.
    unstored_output: str | None
    replayed: int
    #: The children the running step sends (``send``), recorded with its completed row.
    _sends: Sends | None
    _snapshot_cipher: SnapshotCipher | None
    _cipher_read: bool
    _store: LedgerStore
    #: The span hooks (``otel``): each step is a span.
    tracing: otel.Tracing

    if TYPE_CHECKING:  # the attempt's writes (``worker/attempt.py``)

        def _check_fence(self) -> None: ...

        def _fenced(self, ok: bool, what: str) -> None: ...

        def park(self, reason: str) -> NoReturn: ...

        def _write(
            self,
            ident: Ident,
            seq: int,
            status: StepStatus,
            *,
            output: str | None = None,
            error: str | None = None,
        ) -> bool: ...

        def write_completed(self, ident: Ident, seq: int, encoded: str, sends: Sends) -> None: ...

        def write_marker(self, ident: Ident, seq: int) -> None: ...

        def open_transaction(self) -> AbstractContextManager[Any]: ...

        def complete_transaction(
            self, conn: Any, ident: Ident, seq: int, encoded: str, sends: Sends
        ) -> bool: ...

        def refuse_transaction(self, ident: Ident) -> NoReturn: ...

    # -- a step ---------------------------------------------------------------------------

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        effect: bool | None = None,
        not_executed_on: tuple[type[BaseException], ...] = (),
        identify: Identify | None = None,
    ) -> Any:
        """Run ``fn`` as the named step, or return its stored output if it completed before.

        The step is its name and position, its input checked (``replay``); ``identify``
        declares which of its arguments identify it instead (``identity_of``).

        Raises:
            ValueError: a bad step name or ``identify`` (nothing was written or run).
            NestedStepError: called inside another step's function.
            LedgerBlocked: an effect step's input drifted; the entry is parked.
            Fenced: this attempt was superseded; the step did not run.
            PayloadError: the output cannot be stored; the step stays ambiguous.
        """
        self._may_start(name)
        writes_intent = self.side_effect.writes_intent if effect is None else effect
        with self.tracing.step(
            self, name, effect=writes_intent, not_executed_on=not_executed_on
        ) as span:
            input_hash = arguments_hash([list(args), kwargs])
            identity = None if identify is None else identity_of(name, fn, args, kwargs, identify)
            ident, row = self._placed(name, input_hash, identity, effect=writes_intent)
            replayed = row is not None and row.status is StepStatus.COMPLETED
            span.placed(ident, replayed=replayed)
            if row is not None and replayed:
                self.replayed += 1
                log.debug(
                    "step replayed key=%s task_id=%s fence=%s step=%s#%s",
                    self.key,
                    self.task_id,
                    self.fence,
                    name,
                    ident[2],
                )
                return decode(row.output)
            self._seq += 1
            seq = row.seq if row is not None else self._seq
            if writes_intent:
                self._fenced(self._write(ident, seq, StepStatus.STARTED), f"step {name} start")
                crash_point(self.settings, f"step-started:{name}")
            output, sends = self._call(ident, seq, fn, args, kwargs, writes_intent, not_executed_on)
            crash_point(self.settings, f"step-returned:{name}")
            try:
                encoded = encode(
                    output, limit=self.settings.max_result_bytes, what=f"output of step {name!r}"
                )
            except PayloadError as exc:
                if writes_intent:
                    self.ambiguous = ident
                    self.unstored_output = str(exc)
                raise
            self.write_completed(ident, seq, encoded, sends)
            crash_point(self.settings, f"step-completed:{name}")
            self.publish_children(ident, sends)
            # Return what replay would return, so the first run and a resume agree exactly.
            return decode(encoded)

    def _may_start(self, name: str) -> None:
        """Refuse a step that may not start: a bad name, a superseded attempt, a nested step.

        Raises:
            ValueError: a bad step name.
            Fenced: this attempt was superseded.
            NestedStepError: inside another step.
        """
        check_step_name(name)
        self._check_fence()
        if self.current is not None:
            raise NestedStepError(
                f"step {name!r} started inside step {self.current[0]!r}; steps do not nest"
            )

    def _placed(
        self, name: str, input_hash: str, identity: str | None, *, effect: bool
    ) -> tuple[Ident, StepRecord | None]:
        """The step's place in the replay book, and its row there if it has one.

        Raises:
            LedgerBlocked: its input drifted; the entry is parked.
            Fenced: parking was refused (superseded).
        """
        try:
            return self._replay.place(name, input_hash, identity=identity, effect=effect)
        except Drift as drift:
            self.park(drift.reason)

    def _call(
        self,
        ident: Ident,
        seq: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        writes_intent: bool,
        not_executed_on: tuple[type[BaseException], ...],
    ) -> tuple[Any, Sends]:
        """Run the step's function with the step marked running; returns its output and what
        it sent. An exception is classified on its way out: a declared ``not_executed_on``
        writes ``not_executed``; any other leaves an effect step ambiguous."""
        self.current = ident
        self._current_has_row = writes_intent
        sends = self._sends = Sends(self.key, ident[0], ident[2])
        try:
            return fn(*args, **kwargs), sends
        except StepUsageError:
            raise  # a programming error in the step's function: never ambiguous, never re-run
        except not_executed_on as exc:
            if writes_intent:
                self._fenced(
                    self._write(ident, seq, StepStatus.NOT_EXECUTED, error=repr(exc)),
                    f"step {ident[0]} not-executed",
                )
            raise
        except BaseException:
            if writes_intent:
                self.ambiguous = ident
            raise
        finally:
            self.current = None
            self._sends = None

    # -- the outbox -----------------------------------------------------------------------

    def send(self, sig: Any) -> str:
        """Record ``sig`` as a child of the running step; returns the child's task id.

        The child is published after the step's completed row commits (``outbox``).

        Raises:
            StepUsageError: outside a step.
            SendRefused: not a signature, an option the outbox cannot keep or no publish could
                send, arguments that cannot be stored (``Sends.add``).
        """
        if self._sends is None:
            raise StepUsageError(
                "send() records a child with the step that sends it: call it inside a step "
                "(self.step, self.transaction), not in the body itself"
            )
        try:
            child_id = self._sends.add(
                sig, limit=self.settings.max_snapshot_bytes, cipher=self._cipher()
            )
        except (TypeError, ValueError, PayloadError) as exc:
            # A programming error, the same on every run: the task fails naming it. Left as
            # it was, it escaped the step as any exception and blocked the entry as "may have
            # executed", and a not-executed release only blocked it again.
            raise SendRefused(f"{type(exc).__name__}: {exc}") from exc
        _warn_if_not_ledgered(self.task.app, sig.task)
        return child_id

    def publish_children(self, ident: Ident, sends: Sends) -> None:
        """Publish the children a step recorded, after its row committed (never raises for the
        broker: what is not confirmed waits for the sweep)."""
        if not sends.children:
            return
        messages = [
            OutboxMessage(
                child_id=c.child_id,
                parent_key=self.key,
                step=ident[0],
                occurrence=ident[2],
                n=c.n,
                task_name=c.task_name,
                payload=c.payload,
                fence=self.fence,
                created_at=0.0,
                published_at=None,
            )
            for c in sends.children
        ]
        name = ident[0]
        publish(
            self._store,
            self.task.app,
            messages,
            after_send=lambda: crash_point(self.settings, f"children-published:{name}"),
            cipher=self._cipher(),
        )

    def verdict_sends(self, ident: Ident, sigs: Sequence[Any]) -> Sends:
        """The children a reconciler returned with a ``completed`` verdict on ``ident``, as
        the step's own ``send`` calls would have recorded them: the same child ids (the n-th
        send of that step and occurrence), payloads sealed the same way.

        Raises:
            TypeError: one is not a task signature, or has an option the outbox cannot keep.
            ValueError: one has an option no publish could send (``outbox.check_options``).
            PayloadError: its arguments cannot be stored.
        """
        sends = Sends(self.key, ident[0], ident[2])
        for sig in sigs:
            sends.add(sig, limit=self.settings.max_snapshot_bytes, cipher=self._cipher())
            _warn_if_not_ledgered(self.task.app, sig.task)
        return sends

    def _cipher(self) -> SnapshotCipher | None:
        """The snapshot cipher (``ledger_snapshot_keys``) that seals the children's payloads."""
        if not self._cipher_read:
            self._snapshot_cipher = cipher_from(self.settings.snapshot_keys)
            self._cipher_read = True
        return self._snapshot_cipher

    # -- transaction steps ----------------------------------------------------------------

    def transaction(
        self, name: str, input_hash: str, *, identity: str | None = None, session: bool = False
    ) -> TransactionStep:
        """The transaction step ``name`` (``celery_ledger.transaction``): place it, and hand
        back what runs or replays it.

        Raises:
            ValueError: a bad step name.
            NestedStepError: inside another step.
            LedgerBlocked: its input drifted; the entry is parked.
            Fenced: this attempt was superseded.
        """
        self._may_start(name)
        # A transaction step counts as an effect for drift: its writes committed with its
        # row, so running it again under another input would write them twice.
        ident, row = self._placed(name, input_hash, identity, effect=True)
        if row is not None and row.status is StepStatus.COMPLETED:
            self.replayed += 1
            return TransactionStep(self, ident, 0, replayed=row.output, session=session)
        first = self._seq == 0 and row is None
        self._seq += 1
        seq = row.seq if row is not None else self._seq
        if first and self.side_effect.writes_intent:
            # No replay row yet: a crash inside would leave none, and the next attempt would
            # take the body for a stepless one that ran (ambiguous). One marker row, once
            # per entry, says a step was under way (``TRANSACTION_STEP_REF``).
            self.write_marker(ident, seq)
        return TransactionStep(self, ident, seq, replayed=None, session=session)

    def enter_transaction(self, ident: Ident) -> Sends:
        """Mark the transaction step ``ident`` as running (for ``send`` and nesting)."""
        self.current = ident
        self._current_has_row = False
        sends = self._sends = Sends(self.key, ident[0], ident[2])
        return sends

    def leave_transaction(self) -> None:
        self.current = None
        self._sends = None

    def transaction_ended(self, ident: Ident, how: str) -> NoReturn:
        """A transaction step's block ended the step's transaction (``how``): refuse to
        record the step. The row is not written, what is still open rolls back, and the task
        fails; what the block committed itself stays, and is not counted as the step done.

        Raises:
            TransactionEndedError: always.
        """
        raise TransactionEndedError(
            f"transaction step {ident[0]!r}: its block ended the step's transaction "
            f"({how}); the step commits its writes together with its row, so it was not "
            "recorded as done. Do not commit or roll back inside the block (a savepoint, "
            "begin_nested(), is fine)"
        )

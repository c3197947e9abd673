"""One attempt at a ledgered task: its fence, its replay rows, and the step runner.

A step is the unit of at-most-once. For an effect step the order of writes is the whole
safety argument:

1. ``started`` is written (fenced) *before* the body runs: from then on, a crash leaves a row
   that says "this may have happened", and nothing re-runs it blindly;
2. the body runs;
3. ``completed`` with the output is written (fenced): from then on, replay returns the output.

A crash between 1 and 3 is the ambiguous window; it is resolved by the side-effect class, a
reconciler, or an operator, never by guessing. Read/idempotent steps skip 1 (re-running them is
harmless) and write once.

Which row a step call is (its name and position, its input checked) is ``replay``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, NoReturn, Protocol, TypeVar

from celery_ledger.backoff import retry_while_unavailable
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
    BODY_STEP,
    Child,
    EntryStatus,
    Fenced,
    LedgerBlocked,
    LedgerStore,
    LedgerUnavailable,
    OutboxMessage,
    PayloadError,
    SideEffect,
    SnapshotCipher,
    StepRecord,
    StepStatus,
    Verdict,
    cipher_from,
    step_provider_key,
)
from celery_ledger.outbox import Sends
from celery_ledger.recovery.outbox import publish
from celery_ledger.redact import scrub_for_call
from celery_ledger.replay import Ident, Identify, ReplayBook, check_step_name, identity_of
from celery_ledger.settings import LedgerSettings
from celery_ledger.transaction import TransactionStep

log = logging.getLogger(__name__)

T = TypeVar("T")


#: The replay row of a body that records no steps (the body itself is the effect).
BODY_IDENT: Ident = (BODY_STEP, "", 0)

#: The attempt running in this thread/context (None outside a ledgered body).
current_attempt: ContextVar[Attempt | None] = ContextVar("ledger_attempt", default=None)


#: Child task names already warned about (``_warn_if_not_ledgered``): once per process.
_warned_children: set[str] = set()


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


class AttemptTask(Protocol):
    """What an attempt reads from its task (``LedgerTask``)."""

    name: str
    side_effect: str
    app: Any
    #: ``keyed`` tasks: how long the provider keeps an idempotency key (None: no window).
    provider_key_ttl: float | None


class EmitEvent(Protocol):
    """Sends a ``task-ledger-<kind>`` event for an entry (``LedgerTask._emit``)."""

    def __call__(self, kind: str, key: str, fence: int, **fields: Any) -> None: ...


class Attempt:
    """State of one run of a body under one fence; the only writer under that fence.

    Every fenced write of the attempt goes through its methods: step rows (``step``,
    ``record_verdict``, ``start_body``), the external reference, the lease (``renew_lease``)
    and the settle (``settle``, ``block``). A write the fence refuses marks the attempt
    superseded; a write the ledger cannot take is retried (``backoff``).
    """

    def __init__(
        self,
        task: AttemptTask,
        store: LedgerStore,
        settings: LedgerSettings,
        *,
        key: str,
        fence: int,
        task_id: str,
        lease_seconds: float,
        replay: tuple[StepRecord, ...] = (),
        actor: str | None = None,
        emit: EmitEvent | None = None,
    ) -> None:
        self.task = task
        self._store = store
        self.settings = settings
        self.key = key
        self.fence = fence
        self.task_id = task_id
        self.lease_seconds = lease_seconds
        #: Who settles (the worker's node name), stamped on the settle's audit event.
        self.actor = actor
        self.side_effect = SideEffect(task.side_effect)
        self._emit = emit
        self._replay = ReplayBook(replay)
        self._seq = max((r.seq for r in replay), default=0)
        self.superseded: str | None = None
        #: The step whose body is running now (for record_external_ref / provider_key).
        self.current: Ident | None = None
        #: Whether ``current`` wrote a ``started`` row (the row an external ref goes on).
        self._current_has_row = False
        #: Set when an exception escaped from a started effect step: it may have crossed.
        self.ambiguous: Ident | None = None
        #: Set with ``ambiguous`` when that step returned and only its output could not be
        #: stored (why not): it did execute, and its blocked reason says so.
        self.unstored_output: str | None = None
        #: The external references this attempt recorded (``record_external_ref``), for the
        #: reconciler of a step that then raised: its replay rows were read at the claim.
        self._refs: dict[Ident, str] = {}
        self.replayed = 0
        #: ``self.replace(sig)`` was called: the replacement, ``name[task id]``.
        self.replaced_by: str | None = None
        #: The children the running step sends (``send``), recorded with its completed row.
        self._sends: Sends | None = None
        self._snapshot_cipher: SnapshotCipher | None = None
        self._cipher_read = False

    def __repr__(self) -> str:
        return f"<Attempt key={self.key} task_id={self.task_id} fence={self.fence}>"

    def mark_superseded(self, why: str) -> None:
        if self.superseded is None:
            log.warning(
                "attempt superseded key=%s task_id=%s fence=%s: %s",
                self.key,
                self.task_id,
                self.fence,
                why,
            )
            self._seen_alive(why)
        self.superseded = why

    def _seen_alive(self, why: str) -> None:
        """Leave "seen alive at" on the entry: this superseded attempt is awake and tried to
        write (``mark-dead`` refuses on it). Once per attempt; best effort, since the attempt
        stops either way."""
        try:
            self._store.record_seen_alive(self.key, self.fence, owner=self.actor, what=why)
        except Exception as exc:  # noqa: BLE001 - a sign of life must not break the stop
            log.warning(
                "could not record the sign of life of key=%s task_id=%s fence=%s: %r",
                self.key,
                self.task_id,
                self.fence,
                exc,
            )

    def emit(self, kind: str, **fields: Any) -> None:
        """Send a ``task-ledger-<kind>`` event for this attempt's entry and fence."""
        if self._emit is not None:
            self._emit(kind, self.key, self.fence, **fields)

    def external_ref(self, ident: Ident) -> str | None:
        """The external reference of step ``ident``: recorded by this attempt, else the one
        its replay row had at the claim."""
        if ident in self._refs:
            return self._refs[ident]
        row = self._replay.get(ident)
        return row.external_ref if row is not None else None

    def replay_row(self, ident: Ident) -> StepRecord | None:
        """The replay row of ``ident`` as this attempt knows it (loaded at claim, or written
        since by ``record_verdict``)."""
        return self._replay.get(ident)

    def park(self, reason: str) -> NoReturn:
        """Park the entry ``blocked`` for an operator and stop the attempt.

        Raises:
            LedgerBlocked: the entry is parked (or the ledger stayed unreachable and the entry
                is left running for recovery, which will come to the same verdict).
            Fenced: this attempt was superseded; another one owns the entry.
        """
        if not self.block(reason):
            raise Fenced(f"key {self.key} fence {self.fence}: block refused")
        shown = self.scrub(reason)
        self.emit("blocked", reason=shown)
        raise LedgerBlocked(f"{self.task.name}[{self.task_id}] key {self.key}: {shown}")

    def scrub(self, text: str) -> str:
        """``text`` as it may leave the worker (a log line, an event, the exception Celery
        logs and stores), with this call's secret argument values scrubbed. The ledger keeps
        it whole; ``show`` and the page scrub it when they show it."""
        request = getattr(self.task, "request", None)
        return scrub_for_call(
            text,
            redact=self.settings.redact,
            task=self.task,
            args=getattr(request, "args", None),
            kwargs=getattr(request, "kwargs", None),
        )

    def _check_fence(self) -> None:
        if self.superseded is not None:
            raise Fenced(f"key {self.key} fence {self.fence} superseded: {self.superseded}")

    def _fenced(self, ok: bool, what: str) -> None:
        if not ok:
            self.mark_superseded(f"{what} refused: fence {self.fence} is no longer current")
            raise Fenced(f"key {self.key} fence {self.fence}: {what} refused")

    def _retrying(self, write: Callable[[], T], what: str) -> T:
        """``write()``, retried while the ledger is unreachable, for
        ``ledger_settle_retry_seconds``.

        Raises:
            LedgerUnavailable: still unreachable past that.
        """

        def warn(exc: LedgerUnavailable, delay: float) -> None:
            log.warning(
                "%s of key=%s task_id=%s fence=%s failed (%s); retrying in %.1fs",
                what,
                self.key,
                self.task_id,
                self.fence,
                exc,
                delay,
            )

        return retry_while_unavailable(
            write,
            seconds=self.settings.settle_retry_seconds,
            first_delay=self.settings.write_retry_delay,
            max_delay=self.settings.write_retry_delay_max,
            on_retry=warn,
        )

    # -- the step runner ------------------------------------------------------------------

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
        check_step_name(name)
        self._check_fence()
        if self.current is not None:
            raise NestedStepError(
                f"step {name!r} started inside step {self.current[0]!r}; steps do not nest"
            )
        writes_intent = self.side_effect.writes_intent if effect is None else effect
        input_hash = arguments_hash([list(args), kwargs])
        identity = None if identify is None else identity_of(name, fn, args, kwargs, identify)
        try:
            ident, row = self._replay.place(
                name, input_hash, identity=identity, effect=writes_intent
            )
        except Drift as drift:
            self.park(drift.reason)
        if row is not None and row.status is StepStatus.COMPLETED:
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
        self.current = ident
        self._current_has_row = writes_intent
        sends = self._sends = Sends(self.key, name, ident[2])
        try:
            output = fn(*args, **kwargs)
        except StepUsageError:
            raise  # a programming error in the step's function: never ambiguous, never re-run
        except not_executed_on as exc:
            if writes_intent:
                self._fenced(
                    self._write(ident, seq, StepStatus.NOT_EXECUTED, error=repr(exc)),
                    f"step {name} not-executed",
                )
            raise
        except BaseException:
            if writes_intent:
                self.ambiguous = ident
            raise
        finally:
            self.current = None
            self._sends = None
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
        try:
            # The children the step sent are recorded in the same write (a transaction when
            # there are any): a crash before it loses both, after it keeps both.
            done = self._retrying(
                lambda: self._store.complete_step(
                    self.key, self.fence, ident, seq=seq, output=encoded, children=sends.children
                ),
                f"step {name} write",
            )
        except LedgerUnavailable:
            self.ambiguous = ident  # it ran; the ledger could not be told
            raise
        self._fenced(done, f"step {name} complete")
        crash_point(self.settings, f"step-completed:{name}")
        self.publish_children(ident, sends)
        # Return what replay would return, so the first run and a resume agree exactly.
        return decode(encoded)

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
        check_step_name(name)
        self._check_fence()
        if self.current is not None:
            raise NestedStepError(
                f"step {name!r} started inside step {self.current[0]!r}; steps do not nest"
            )
        try:
            # A transaction step counts as an effect for drift: its writes committed with its
            # row, so running it again under another input would write them twice.
            ident, row = self._replay.place(name, input_hash, identity=identity, effect=True)
        except Drift as drift:
            self.park(drift.reason)
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
            self._fenced(
                self._retrying(
                    lambda: self._store.write_transaction_marker(
                        self.key, self.fence, ident, seq=seq
                    ),
                    f"step {name} marker",
                ),
                f"step {name} marker",
            )
        return TransactionStep(self, ident, seq, replayed=None, session=session)

    def open_transaction(self) -> AbstractContextManager[Any]:
        """A connection of the ledger's engine in a new transaction (``step_transaction``)."""
        return self._store.step_transaction()

    def enter_transaction(self, ident: Ident) -> Sends:
        """Mark the transaction step ``ident`` as running (for ``send`` and nesting)."""
        self.current = ident
        self._current_has_row = False
        sends = self._sends = Sends(self.key, ident[0], ident[2])
        return sends

    def leave_transaction(self) -> None:
        self.current = None
        self._sends = None

    def complete_on_connection(
        self, dbapi: Any, ident: Ident, seq: int, encoded: str, sends: Sends
    ) -> bool:
        """Write the step's completed row (and its children) on a DBAPI connection in its
        open transaction, which the caller commits (Django's, in ``django_steps``). Returns
        False when the fence moved: the caller rolls back, then ``refuse_transaction``.

        Raises:
            Fenced: this attempt was superseded before (nothing written).
        """
        self._check_fence()
        return self._store.complete_on_dbapi(
            dbapi, self.key, self.fence, ident, seq=seq, output=encoded, children=sends.children
        )

    def complete_transaction(
        self, conn: Any, ident: Ident, seq: int, encoded: str, sends: Sends
    ) -> bool:
        """Write the step's completed row (and its children) on ``conn`` and commit it.
        Returns False when the fence moved: nothing was committed (the caller's connection
        rolls back when it closes), and the caller then calls ``refuse_transaction``.

        Raises:
            Fenced: this attempt was superseded before (nothing written).
            LedgerUnavailable: the commit did not reach the database (it is not known whether
                it committed; the next attempt replays or re-runs accordingly).
        """
        self._check_fence()
        return self._store.commit_step(
            conn, self.key, self.fence, ident, seq=seq, output=encoded, children=sends.children
        )

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

    def refuse_transaction(self, ident: Ident) -> NoReturn:
        """A transaction step's row was refused (the fence moved): mark this attempt
        superseded and stop it. Called once the step's transaction rolled back, so that the
        sign of life ``mark_superseded`` leaves on the entry never waits for the step's own
        locks (SQLite's write lock).

        Raises:
            Fenced: always.
        """
        self._fenced(False, f"transaction step {ident[0]} complete")
        raise AssertionError("unreachable")  # pragma: no cover

    def _write(
        self,
        ident: Ident,
        seq: int,
        status: StepStatus,
        *,
        output: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Write a replay row, retrying an unreachable ledger for ``ledger_settle_retry_seconds``.

        A short outage must not turn into a failed task: the row is an upsert, so writing it
        again after a lost reply is harmless. Past the bound, ``LedgerUnavailable`` propagates
        and the task leaves the entry running for recovery (``LedgerTask._run_attempt``).
        """
        return self._retrying(
            lambda: self._store.write_step(
                self.key, self.fence, ident, seq=seq, status=status, output=output, error=error
            ),
            f"step {ident[0]} write",
        )

    # -- writes made outside a step: ambiguity resolution and the body row -----------------

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

    def record_verdict(
        self,
        ident: Ident,
        verdict: Verdict,
        output: str | None = None,
        *,
        sends: Sends | None = None,
    ) -> None:
        """Write what a reconciler proved about an ambiguous step: ``completed`` with its
        (encoded) output, which replays from now on, or ``not_executed``, which authorizes
        one re-run.

        A ``completed`` verdict's ``sends`` (``verdict_sends``: the children the step would
        have sent) are recorded with its row in one transaction (``store.complete_step``, as
        the step itself records them) and published after it commits (``publish_children``):
        the step's body will not run again to send them.

        Raises:
            Fenced: this attempt was superseded; nothing was written.
            LedgerUnavailable: the ledger stayed unreachable.
        """
        status = StepStatus.COMPLETED if verdict is Verdict.COMPLETED else StepStatus.NOT_EXECUTED
        children = sends.children if sends is not None else []
        if children and status is not StepStatus.COMPLETED:
            raise ValueError("only a completed verdict carries children")
        row = self._replay.get(ident)
        seq = row.seq if row else 0
        if children:
            done = self._retrying(
                lambda: self._store.complete_step(
                    self.key, self.fence, ident, seq=seq, output=output, children=children
                ),
                f"step {ident[0]} reconcile",
            )
        else:
            done = self._write(ident, seq, status, output=output)
        self._fenced(done, f"step {ident[0]} reconcile")
        self._replay.put(
            StepRecord(
                name=ident[0],
                input_hash=ident[1],
                occurrence=ident[2],
                seq=seq,
                status=status,
                fence=self.fence,
                output=output,
            )
        )
        if sends is not None:
            self.publish_children(ident, sends)

    def start_body(self) -> None:
        """Record the intent of a body that records no steps, before its one authorized re-run
        (after a ``not_executed`` verdict): a crash during it is then ambiguous again, not
        authorized again.

        Raises:
            Fenced: this attempt was superseded; the body must not run.
        """
        row = self._replay.get(BODY_IDENT)
        seq = row.seq if row else 0
        self._fenced(self._write(BODY_IDENT, seq, StepStatus.STARTED), "body start")

    def record_external_ref(self, ref: str) -> None:
        """Durably attach a provider handle to the running step, before the external call.

        Raises:
            StepUsageError: outside a step, or inside one that records no intent (a
                ``read``/``idempotent`` task's step, or ``effect=False``): there is no row to
                hold the reference, and nothing that would ever read it.
            Fenced: this attempt was superseded.
        """
        if self.current is None:
            raise StepUsageError("record_external_ref() is only meaningful inside a step")
        ident = self.current
        if not self._current_has_row:
            raise StepUsageError(
                f"record_external_ref() inside step {ident[0]!r}, which records no intent "
                f"({self.side_effect.value} task, or effect=False): only an effect step "
                "keeps an external reference for its reconciler"
            )
        self._check_fence()
        self._fenced(
            self._retrying(
                lambda: self._store.record_external_ref(self.key, self.fence, ident, ref),
                f"step {ident[0]} external ref",
            ),
            "record_external_ref",
        )
        self._refs[ident] = ref
        crash_point(self.settings, f"step-ref:{ident[0]}")

    @property
    def provider_key(self) -> str:
        """Stable provider idempotency key of the running step (same on every resume)."""
        if self.current is None:
            raise StepUsageError("provider_key is only available inside a step")
        return step_provider_key(self.key, self.current)

    # -- the entry: lease and settle ------------------------------------------------------

    def renew_lease(self) -> bool:
        """Extend the lease by ``lease_seconds`` (on the database clock), fenced; one try.

        The heartbeat calls it every lease/3 and is itself the retry: a backoff here would
        hold up every other attempt the heartbeat renews. Returns False, and marks the
        attempt superseded, when the fence moved.

        Raises:
            LedgerError: the ledger could not be reached.
        """
        ok = self._store.renew_lease(self.key, self.fence, self.lease_seconds)
        if not ok:
            self.mark_superseded("heartbeat found the fence moved")
        return ok

    def settle(self, status: EntryStatus, *, links: Sequence[Child] = (), **fields: Any) -> bool:
        """Settle the entry, retrying an unreachable ledger for ``ledger_settle_retry_seconds``.

        ``links`` (a ``completed`` settle only): the next chain link and callbacks, recorded
        as outbox children in the settle's transaction (``ledger.links``).

        Returns False when the fence moved (superseded). If the ledger stays unreachable past
        the bound, the entry is left running and this returns True: its lease expires, the
        sweep interrupts it, and the resume replays the completed steps. Nothing is lost.
        """

        def write() -> bool:
            if links:
                return self._store.settle_with_links(
                    self.key,
                    self.fence,
                    result=fields.get("result"),
                    error=fields.get("error"),
                    status=status,
                    links=links,
                    actor=self.actor,
                )
            return self._store.settle(self.key, self.fence, status, actor=self.actor, **fields)

        try:
            ok = self._retrying(write, f"settle {status.value}")
        except LedgerUnavailable as exc:
            log.error(
                "settle %s of key=%s task_id=%s fence=%s failed for %ss (%s); "
                "entry left running for recovery",
                status.value,
                self.key,
                self.task_id,
                self.fence,
                self.settings.settle_retry_seconds,
                exc,
            )
            return True
        if ok:
            self.emit("settled", status=status.value)
        else:
            self.mark_superseded(f"settle {status.value} refused")
        return ok

    def block(self, reason: str) -> bool:
        """Park the entry ``blocked`` with ``reason`` for an operator (``settle``)."""
        log.warning(
            "blocked key=%s task_id=%s fence=%s: %s",
            self.key,
            self.task_id,
            self.fence,
            self.scrub(reason),
        )
        return self.settle(EntryStatus.BLOCKED, reason=reason)

"""One attempt at a ledgered task: its fence, its replay rows, and every write under them.

A step is the unit of at-most-once. For an effect step the order of writes is the whole
safety argument:

1. ``started`` is written (fenced) *before* the body runs: from then on, a crash leaves a row
   that says "this may have happened", and nothing re-runs it blindly;
2. the body runs;
3. ``completed`` with the output is written (fenced): from then on, replay returns the output.

A crash between 1 and 3 is the ambiguous window; it is resolved by the side-effect class, a
reconciler, or an operator, never by guessing. Read/idempotent steps skip 1 (re-running them is
harmless) and write once.

Which row a step call is (its name and position, its input checked) is ``replay``'s; what a
step call does, in the order above, is ``steps.StepRunner``'s, a role this class mixes in.
The writes themselves are all here: step rows, the external reference, a verdict, the lease,
and the settle, among them the ``cancelled``/``expired`` settle of a start that a cancellation
or a passed deadline refused (``timing.explain_refusal`` asks ``stop_reason``, then ``settle``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, NoReturn, Protocol, TypeVar

from celery_ledger import otel
from celery_ledger.backoff import retry_while_unavailable
from celery_ledger.crashpoints import crash_point
from celery_ledger.errors import StepUsageError
from celery_ledger.ledger import (
    BODY_STEP,
    Child,
    EntryStatus,
    Fenced,
    LedgerBlocked,
    LedgerStore,
    LedgerUnavailable,
    SideEffect,
    SlotAsk,
    SnapshotCipher,
    StepRecord,
    StepStatus,
    Verdict,
    step_provider_key,
)
from celery_ledger.ledger.signals import Taken
from celery_ledger.ledger.slots import Granted
from celery_ledger.outbox import Sends
from celery_ledger.redact import scrub_for_call
from celery_ledger.replay import Ident, ReplayBook
from celery_ledger.settings import LedgerSettings
from celery_ledger.steps import AttemptTask, StepRunner

log = logging.getLogger(__name__)

T = TypeVar("T")


#: The replay row of a body that records no steps (the body itself is the effect).
BODY_IDENT: Ident = (BODY_STEP, "", 0)

#: The attempt running in this thread/context (None outside a ledgered body).
current_attempt: ContextVar[Attempt | None] = ContextVar("ledger_attempt", default=None)


class EmitEvent(Protocol):
    """Sends a ``task-ledger-<kind>`` event for an entry (``Delivery.emit``)."""

    def __call__(self, kind: str, key: str, fence: int, **fields: Any) -> None: ...


class Attempt(StepRunner):
    """State of one run of a body under one fence; the only writer under that fence.

    Every fenced write of the attempt goes through its methods: step rows (``_write``,
    ``write_completed``, ``write_marker``, ``record_verdict``, ``start_body``), the external
    reference, the lease (``renew_lease``) and the settle (``settle``, ``block``). A write the
    fence refuses marks the attempt superseded; a write the ledger cannot take is retried
    (``backoff``). The step calls (``step``, ``send``, ``transaction``) are ``StepRunner``'s.
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
        slot: SlotAsk | None = None,
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
        self.tracing = otel.tracing(settings)
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
        #: How many ``wait_for`` calls of each signal name this run has made: the n-th wait
        #: is the same wait on every run, and takes the same signal (``signals.wait_for``).
        self.signal_waits: Counter[str] = Counter()
        #: docs/concurrency.md: the key whose slot it holds; the waiters its settle served in
        #: its own transaction (None: none did; ``Delivery.run`` hands over after the run).
        self.slot = slot
        self.served: list[Granted] | None = None

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

    # -- the writes a step asks for (``steps.StepRunner`` decides) ------------------------

    def write_completed(self, ident: Ident, seq: int, encoded: str, sends: Sends) -> None:
        """Write a step's ``completed`` row with its output and the children it sent.

        The children are recorded in the same write (a transaction when there are any): a
        crash before it loses both, after it keeps both.

        Raises:
            Fenced: the fence moved (superseded).
            LedgerUnavailable: the ledger stayed unreachable; the step is ambiguous (it ran,
                the ledger could not be told).
        """
        try:
            done = self._retrying(
                lambda: self._store.complete_step(
                    self.key, self.fence, ident, seq=seq, output=encoded, children=sends.children
                ),
                f"step {ident[0]} write",
            )
        except LedgerUnavailable:
            self.ambiguous = ident  # it ran; the ledger could not be told
            raise
        self._fenced(done, f"step {ident[0]} complete")

    def write_marker(self, ident: Ident, seq: int) -> None:
        """Write the marker row of a first transaction step (``TRANSACTION_STEP_REF``).

        Raises:
            Fenced: the fence moved (superseded).
        """
        what = f"step {ident[0]} marker"
        self._fenced(
            self._retrying(
                lambda: self._store.write_transaction_marker(self.key, self.fence, ident, seq=seq),
                what,
            ),
            what,
        )

    def open_transaction(self) -> AbstractContextManager[Any]:
        """A connection of the ledger's engine in a new transaction (``step_transaction``)."""
        return self._store.step_transaction()

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
        and the delivery leaves the entry running for recovery (``delivery.ESCAPES``).
        """
        return self._retrying(
            lambda: self._store.write_step(
                self.key, self.fence, ident, seq=seq, status=status, output=output, error=error
            ),
            f"step {ident[0]} write",
        )

    # -- writes made outside a step: ambiguity resolution and the body row -----------------

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
            at = (self.slot, self.key, self.fence, status)
            ok, self.served = self._store.settle_attempt(
                *at, links=links, actor=self.actor, **fields
            )
            return ok

        with self.tracing.settle(self, status.value) as span:
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
            span.settled(ok)
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

    def take_signal(self, name: str, wait: int, deadline: float) -> Taken | None:
        """This entry's ``wait``-th wait for signal ``name`` (``LedgerStore.take_signal``),
        retried as a settle is: ``LedgerUnavailable`` past ``ledger_settle_retry_seconds``
        leaves the entry running for recovery, and the resume's wait asks again."""
        return self._retrying(
            lambda: self._store.take_signal(self.key, name, wait, deadline=deadline),
            f"take of signal {name!r}",
        )

    def stop_reason(self) -> str | None:
        """Why the ledger refuses this fence a start (``cancelled``, ``expired``), if it does
        (``timing.explain_refusal`` settles it)."""
        return self._store.stop_reason(self.key, self.fence)

    def now(self) -> float:
        """The database clock (seconds since the epoch): the clock leases and wake times use."""
        return self._store.now()

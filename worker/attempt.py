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
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from celery_ledger.codec import canonical_arguments, decode, encode
from celery_ledger.crashpoints import crash_point
from celery_ledger.ledger import (
    Fenced,
    LedgerStore,
    LedgerUnavailable,
    PayloadError,
    SideEffect,
    StepRecord,
    StepStatus,
    input_hash,
    provider_key,
)
from celery_ledger.settings import LedgerSettings

if TYPE_CHECKING:
    from celery_ledger.task import LedgerTask

log = logging.getLogger(__name__)

#: The attempt running in this thread/context (None outside a ledgered body).
current_attempt: ContextVar[Attempt | None] = ContextVar("ledger_attempt", default=None)


class Attempt:
    """State of one run of a body under one fence."""

    def __init__(
        self,
        task: LedgerTask,
        store: LedgerStore,
        settings: LedgerSettings,
        *,
        key: str,
        fence: int,
        task_id: str,
        lease_seconds: float,
        replay: tuple[StepRecord, ...] = (),
    ) -> None:
        self.task = task
        self.store = store
        self.settings = settings
        self.key = key
        self.fence = fence
        self.task_id = task_id
        self.lease_seconds = lease_seconds
        self.side_effect = SideEffect(task.side_effect)
        self.replay: dict[tuple[str, str, int], StepRecord] = {r.ident: r for r in replay}
        self._occurrences: Counter[tuple[str, str]] = Counter()
        self._seq = max((r.seq for r in replay), default=0)
        self.superseded: str | None = None
        #: The step whose body is running now (for record_external_ref / provider_key).
        self.current: tuple[str, str, int] | None = None
        #: Set when an exception escaped from a started effect step: it may have crossed.
        self.ambiguous: tuple[str, str, int] | None = None
        self.replayed = 0

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
        self.superseded = why

    def _check_fence(self) -> None:
        if self.superseded is not None:
            raise Fenced(f"key {self.key} fence {self.fence} superseded: {self.superseded}")

    def _fenced(self, ok: bool, what: str) -> None:
        if not ok:
            self.mark_superseded(f"{what} refused: fence {self.fence} is no longer current")
            raise Fenced(f"key {self.key} fence {self.fence}: {what} refused")

    def next_ident(self, name: str, args: Any) -> tuple[str, str, int]:
        ihash = input_hash_of(args)
        occurrence = self._occurrences[(name, ihash)]
        self._occurrences[(name, ihash)] += 1
        return (name, ihash, occurrence)

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
    ) -> Any:
        """Run ``fn`` as the named step, or return its stored output if it completed before.

        Raises:
            Fenced: this attempt was superseded; the step did not run.
            PayloadError: the output cannot be stored; the step stays ambiguous.
        """
        self._check_fence()
        if self.current is not None:
            raise RuntimeError(
                f"step {name!r} started inside step {self.current[0]!r}; steps do not nest"
            )
        ident = self.next_ident(name, [list(args), kwargs])
        row = self.replay.get(ident)
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
        writes_intent = self.side_effect.writes_intent if effect is None else effect
        self._seq += 1
        seq = row.seq if row is not None else self._seq
        if writes_intent:
            self._fenced(self._write(ident, seq, StepStatus.STARTED), f"step {name} start")
            crash_point(self.settings, f"step-started:{name}")
        self.current = ident
        try:
            output = fn(*args, **kwargs)
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
        crash_point(self.settings, f"step-returned:{name}")
        try:
            encoded = encode(
                output, limit=self.settings.max_result_bytes, what=f"output of step {name!r}"
            )
        except PayloadError:
            if writes_intent:
                self.ambiguous = ident
            raise
        try:
            done = self._write(ident, seq, StepStatus.COMPLETED, output=encoded)
        except LedgerUnavailable:
            self.ambiguous = ident  # it ran; the ledger could not be told
            raise
        self._fenced(done, f"step {name} complete")
        crash_point(self.settings, f"step-completed:{name}")
        # Return what replay would return, so the first run and a resume agree exactly.
        return decode(encoded)

    def _write(
        self,
        ident: tuple[str, str, int],
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
        deadline = time.monotonic() + self.settings.settle_retry_seconds
        delay = 0.1
        while True:
            try:
                return self.store.write_step(
                    self.key, self.fence, ident, seq=seq, status=status, output=output, error=error
                )
            except LedgerUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "step %s write of key=%s task_id=%s fence=%s failed (%s); retrying",
                    ident[0],
                    self.key,
                    self.task_id,
                    self.fence,
                    exc,
                )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def record_external_ref(self, ref: str) -> None:
        """Durably attach a provider handle to the running step, before the external call."""
        if self.current is None:
            raise RuntimeError("record_external_ref() is only meaningful inside a step")
        self._check_fence()
        self._fenced(
            self.store.record_external_ref(self.key, self.fence, self.current, ref),
            "record_external_ref",
        )
        crash_point(self.settings, f"step-ref:{self.current[0]}")

    @property
    def provider_key(self) -> str:
        """Stable provider idempotency key of the running step (same on every resume)."""
        if self.current is None:
            raise RuntimeError("provider_key is only available inside a step")
        name, _, occurrence = self.current
        return provider_key(self.key, name, occurrence)


def input_hash_of(args: Any) -> str:
    """SHA-256 of the canonical JSON of step arguments (kombu types allowed)."""
    try:
        return input_hash(args)
    except ValueError:
        import hashlib

        return hashlib.sha256(canonical_arguments(args).encode()).hexdigest()

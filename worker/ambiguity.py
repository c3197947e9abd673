"""Ambiguous steps: decided before anything else runs, never by guessing.

A step is ambiguous when its ``started`` row has no completion: the process died inside it, or
an exception escaped from it (the charge may have gone through and only the reply was lost).
What happens then follows the side-effect class (``SideEffect.rerun_when_ambiguous``):

- ``read`` / ``idempotent`` / ``keyed``: re-run (a ``keyed`` step gets the same provider key);
- otherwise the task's reconciler is asked (``recovery.reconcile.ask``): ``completed(output)``
  is stored and replays (with the children the reconciler returned for it, recorded with its
  row and published, as the step would have), ``not_executed`` authorizes one re-run (never
  for ``irreversible``),
  and ``unknown`` (or no reconciler, or one that raised or timed out) parks the entry
  ``blocked`` for an operator.

Every write goes through the attempt (``Attempt.record_verdict``, ``start_body``, ``settle``,
``block``), under its fence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from celery_ledger import runtime
from celery_ledger.attempt import BODY_IDENT, Attempt, Ident
from celery_ledger.codec import decode, encode
from celery_ledger.ledger import (
    BODY_STEP,
    STEP_RETURNED,
    Claim,
    EntryStatus,
    Fenced,
    Gate,
    LedgerBlocked,
    PayloadError,
    SideEffect,
    StepStatus,
    Verdict,
    step_provider_key,
)
from celery_ledger.ledger.death import scaled_grace
from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled, Reconciler, ask
from celery_ledger.timing import key_window_passed

log = logging.getLogger(__name__)

#: How many times a reconciler's ``not_executed`` waits for a sign of life to age past the
#: death grace (``Ambiguity._after_silence``): one wait, and one more for the refused write a
#: paused attempt makes when it wakes. Past that, an operator decides.
SILENCE_ROUNDS = 3

#: ``Ambiguity.before_body``'s answer when the body is to run (any other answer is the
#: task's result, proven by a reconciler).
RUN_BODY: Any = object()


class Ambiguity:
    """Resolves the ambiguous steps of one attempt, with the delivery's arguments at hand for
    the reconciler."""

    def __init__(
        self,
        attempt: Attempt,
        reconciler: Reconciler | Mapping[str, Reconciler] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.attempt = attempt
        self.reconciler = reconciler
        self.args = args
        self.kwargs = kwargs
        #: The claim this attempt began with (``before_body``): what it knew of the earlier
        #: attempts (``_after_silence``).
        self.claim: Claim | None = None

    def before_body(self, claim: Claim) -> Any:
        """Decide every step that started and never completed, before anything runs.

        Returns ``RUN_BODY`` to go on, or the task's result when a reconciler proved the
        whole body completed.

        Raises:
            LedgerBlocked: the entry was parked for an operator.
            Fenced: this attempt was superseded.
        """
        attempt = self.attempt
        self.claim = claim
        body = attempt.replay_row(BODY_IDENT)
        real_steps = [r for r in claim.steps if r.name != BODY_STEP]
        for row in real_steps:
            if row.ambiguous:
                self.resolve(row.ident, row.external_ref)
        if real_steps or not attempt.side_effect.writes_intent:
            return RUN_BODY
        # A task that recorded no steps: its body is the effect. If an earlier attempt ran it
        # and nothing says how that ended, the body itself is ambiguous.
        if (
            claim.gate is Gate.TAKEOVER
            and claim.executions >= 1
            and (body is None or body.status is StepStatus.STARTED)
        ):
            verdict = self.resolve(BODY_IDENT, body.external_ref if body else None)
            if verdict is not None and verdict[0] is Verdict.COMPLETED:
                attempt.settle(EntryStatus.COMPLETED, result=verdict[1])
                return decode(verdict[1])
            body = attempt.replay_row(BODY_IDENT)
        if body is not None and body.status is StepStatus.NOT_EXECUTED:
            # The one authorized re-run: record its intent, so a crash during it is ambiguous
            # again instead of authorized again.
            attempt.start_body()
        return RUN_BODY

    def after_escape(self) -> bool:
        """An exception escaped from inside a started effect step (``Attempt.ambiguous``): the
        step may have crossed (the charge went through, the response was lost). Ask, never
        assume.

        Returns True when nothing is left to settle (the entry is blocked, or this attempt was
        fenced out); False when the task settles ``failed`` as usual (the step was re-runnable,
        or its verdict is recorded).
        """
        attempt = self.attempt
        ident = attempt.ambiguous
        assert ident is not None
        try:
            self.resolve(ident, attempt.external_ref(ident), unstored=attempt.unstored_output)
        except (LedgerBlocked, Fenced):
            return True
        return False

    def resolve(
        self, ident: Ident, ref: str | None, *, unstored: str | None = None
    ) -> tuple[Verdict, str] | None:
        """Decide one ambiguous step. ``unstored``: the step returned, and this is why its
        output could not be stored (it executed; only the record of it is missing).

        Returns None when its class re-runs it, else the verdict recorded for it (with the
        encoded output of a ``completed`` one).

        Raises:
            LedgerBlocked: no verdict allows going on; the entry was parked for an operator.
            Fenced: this attempt was superseded.
        """
        attempt = self.attempt
        name = ident[0]
        # A keyed step past its provider's key window (design.md § "Durable time") is not
        # re-run blindly: the provider may have forgotten the key. It goes to its reconciler,
        # else an operator.
        rerun = attempt.side_effect.rerun_when_ambiguous
        if rerun and not key_window_passed(attempt, ident):
            log.info(
                "ambiguous step re-run key=%s task_id=%s fence=%s step=%s class=%s",
                attempt.key,
                attempt.task_id,
                attempt.fence,
                name,
                attempt.side_effect.value,
            )
            return None
        step = self._question(ident, ref)
        answer = ask(self.reconciler_for(name), step, timeout=attempt.settings.reconcile_timeout)
        if answer.verdict is Verdict.NOT_EXECUTED:
            answer = self._after_silence(ident, step, answer)
        if answer.verdict is Verdict.COMPLETED:
            recorded = self._record_completed(ident, answer)
            if isinstance(recorded, str):
                return (Verdict.COMPLETED, recorded)
            answer = recorded
        if (
            answer.verdict is Verdict.NOT_EXECUTED
            and attempt.side_effect is not SideEffect.IRREVERSIBLE
        ):
            attempt.record_verdict(ident, Verdict.NOT_EXECUTED)
            attempt.emit("reconciled", step=name, verdict="not_executed")
            return (Verdict.NOT_EXECUTED, "")
        self.block(self._blocked_reason(name, ref, answer, rerun=rerun, unstored=unstored))

    def _question(self, ident: Ident, ref: str | None) -> AmbiguousStep:
        """What the reconciler is asked about the step ``ident`` (its external ``ref``)."""
        attempt = self.attempt
        return AmbiguousStep(
            key=attempt.key,
            task_name=attempt.task.name,
            task_id=attempt.task_id,
            step=ident[0],
            input_hash=ident[1],
            occurrence=ident[2],
            external_ref=ref,
            provider_key=step_provider_key(attempt.key, ident),
            args=self.args,
            kwargs=self.kwargs,
        )

    def _record_completed(self, ident: Ident, answer: Reconciled) -> str | Reconciled:
        """Record a reconciler's ``completed`` verdict on the step ``ident``; returns its
        encoded output, or an ``unknown`` answer when the output (or the children the
        reconciler returned) cannot be stored."""
        attempt = self.attempt
        name = ident[0]
        try:
            encoded = encode(
                answer.output,
                limit=attempt.settings.max_result_bytes,
                what=f"reconciled output of step {name!r}",
            )
            # The children the step would have sent: its completed row, which records
            # them, is this verdict's, and its body never runs again to send them.
            sends = attempt.verdict_sends(ident, answer.children)
        except (PayloadError, TypeError, ValueError) as exc:
            return type(answer).unknown(str(exc))
        attempt.record_verdict(ident, Verdict.COMPLETED, encoded, sends=sends)
        attempt.emit("reconciled", step=name, verdict="completed")
        return encoded

    def _blocked_reason(
        self, name: str, ref: str | None, answer: Reconciled, *, rerun: bool, unstored: str | None
    ) -> str:
        """Why the step ``name`` parks the entry, for the operator who reads ``show``."""
        why = answer.note or answer.verdict.value
        if answer.verdict is Verdict.NOT_EXECUTED:
            why = "irreversible steps are never re-run without an operator"
        # Past here, a class that re-runs is a keyed step (or body) past its key window.
        window = (
            f"; past provider_key_ttl={self.attempt.task.provider_key_ttl}s, the provider may "
            "have forgotten its key"
            if rerun
            else ""
        )
        # A step that returned did execute: the reason says so first, for the operator who
        # would otherwise release it not-executed and run it twice (``show`` warns on it).
        what = (
            f"{STEP_RETURNED} ({unstored}); it executed"
            if unstored is not None
            else "may have executed"
        )
        return (
            f"step {name!r} {what} (external ref: {ref or 'none'}; "
            f"reconciler: {why}{window}); reconcile or release: "
            f"celery-ledger show {self.attempt.key}"
        )

    def _after_silence(self, ident: Ident, step: AmbiguousStep, answer: Reconciled) -> Reconciled:
        """Trust a reconciler's ``not_executed`` about a step an earlier attempt started only
        once that attempt is known dead (``mark-dead``, the worker-lost fast path, a boot
        sweep: ``Claim.dead_fence``) or has shown no sign of life for the death grace
        (``ledger_death_grace_seconds``, scaled to its own lease).

        Why: the fence stops a superseded attempt's ledger writes, not its call in flight. An
        attempt paused mid-call (SIGSTOP, a GC pause, a partition) past its lease, then
        continued, lands the charge the provider could not show when it was asked; re-running
        the step on that first answer charged twice. So this attempt waits, renewing its own
        lease, with no effect run, until the earlier one has been silent for the grace (a
        refused write it makes meanwhile counts as a sign of life), then asks again, when the
        provider shows the late call. After ``SILENCE_ROUNDS`` waits that each met a new sign
        of life, the answer is ``unknown``: an operator decides.
        """
        attempt, claim = self.attempt, self.claim
        row = attempt.replay_row(ident)
        # The fence that started it: its row's; a body without steps has none, and any
        # earlier attempt may have run it.
        started = row.fence if row is not None else attempt.fence - 1
        if claim is None or claim.now is None or started >= attempt.fence:
            return answer  # this attempt started it itself: nothing else may be in flight
        store = runtime.store_for(attempt.task.app)
        alive_at = claim.prior_alive_at
        if row is None:
            # The attempts since the one that ran the body may only have waited here, killed
            # while they waited: their renewals are no sign of the body, and counting them
            # made each waiter's death restart the grace (``LedgerStore.body_starter``).
            starter = store.body_starter(attempt.key, attempt.fence)
            if starter is not None and starter.fence < started:
                started, alive_at = starter.fence, starter.last_alive
        if claim.dead_fence is not None and claim.dead_fence >= started:
            return answer
        if alive_at is None:
            return answer
        settings = attempt.settings
        grace = scaled_grace(
            claim.prior_lease,
            grace_seconds=settings.death_grace_seconds,
            lease_seconds=settings.lease_seconds,
        )
        for _ in range(SILENCE_ROUNDS):
            wait = alive_at + grace - store.now()
            if wait <= 0:
                return answer
            log.warning(
                "reconciler says step %s of key=%s did not execute, but the attempt that "
                "started it (fence %s) showed a sign of life %.1fs ago; task_id=%s fence=%s "
                "waits %.1fs and asks again",
                step.step,
                attempt.key,
                started,
                grace - wait,
                attempt.task_id,
                attempt.fence,
                wait,
            )
            attempt.emit("waited", step=step.step, reason="death grace")
            time.sleep(wait)
            entry = store.get_entry(attempt.key)
            if entry.seen_alive_at is not None and (entry.seen_alive_fence or 0) < attempt.fence:
                alive_at = max(alive_at, entry.seen_alive_at)
            answer = ask(self.reconciler_for(step.step), step, timeout=settings.reconcile_timeout)
            if answer.verdict is not Verdict.NOT_EXECUTED:
                return answer
        if alive_at + grace <= store.now():
            return answer
        return Reconciled.unknown(
            f"the attempt that started it (fence {started}) kept showing signs of life"
        )

    def reconciler_for(self, step: str) -> Reconciler | None:
        """The task's reconciler for ``step`` (a mapping may name ``"*"`` for the rest)."""
        rec = self.reconciler
        if isinstance(rec, Mapping):
            return rec.get(step) or rec.get("*")
        return rec

    def block(self, reason: str) -> NoReturn:
        """Park the entry ``blocked`` for an operator and stop the attempt (``Attempt.park``).

        Raises:
            LedgerBlocked: the entry is parked (the message is acked, not redelivered).
            Fenced: this attempt was superseded.
        """
        self.attempt.park(reason)

"""One delivery of a ledgered task, read as two tables (design.md § "The delivery as a table").

A delivery keys its call and claims the entry; the claim's gate (``ledger.Gate``) decides what
happens next. ``GATES`` gives each gate the event it sends and the one method that handles
it. RUN and TAKEOVER run the body under the claim's fence (``Attempt``, the only writer under
it). An exception that escapes the body is looked up in ``ESCAPES``, an ordered table whose
first matching row decides: the attempt settles the entry from it and it is raised again
(``SETTLE``), the entry is left running and the delivery is sent again later
(``REDELIVER``), or nothing is settled here and it is raised again, as it is or as Celery's
``Ignore`` (``RAISE``: the entry is settled, parked or another attempt's already, or the
process is going away).

The crash points of the RUN path (``crashpoints``), in order: ``after-claim`` (the claim and
the decisions on its ambiguous steps are durable, the body has not started); the step points,
inside the body (``steps``); ``before-settle`` (the body returned and its result is encoded,
nothing is settled); ``after-settle`` (the settle and the links it recorded committed,
nothing is published); ``after-publish`` (the links went out; Celery has stored no result
and acked nothing). ``after-publish`` also follows the publish of a ``self.replace()``
(``replacing``).

The runtime (settings, store, whether events are sent, the ``otel`` hooks) is looked up once,
as the delivery begins; what the delivery calls gets it from here. The claim is a span; each
event the delivery sends is also an event of the current span (``otel``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any, NamedTuple, NoReturn, Protocol

from celery.exceptions import Ignore, Reject, Retry

from celery_ledger import canvas, concurrency, envelope, otel, ratelimit, refusal, runtime, timing
from celery_ledger.ambiguity import RUN_BODY, Ambiguity
from celery_ledger.attempt import Attempt, AttemptTask, current_attempt
from celery_ledger.codec import decode, decode_failure, encode, encode_failure
from celery_ledger.crashpoints import crash_point
from celery_ledger.errors import Stopped
from celery_ledger.heartbeat import heartbeat
from celery_ledger.intents import PublishedTask
from celery_ledger.ledger import (
    Claim,
    ClaimRequest,
    EntryStatus,
    Fenced,
    Gate,
    KeyConflict,
    LedgerBlocked,
    LedgerUnavailable,
    PayloadError,
    wire,
)
from celery_ledger.recovery.reconcile import Reconciler
from celery_ledger.redact import scrub_for_call
from celery_ledger.redelivery import header, ledger_unavailable, redeliver, wait_briefly

log = logging.getLogger(__name__)


class DeliveryTask(AttemptTask, PublishedTask, Protocol):
    """What a delivery needs from its task (``LedgerTask``; a protocol, so that the task, which
    starts deliveries, and this module do not import each other)."""

    backend: Any
    lease_seconds: float | None
    deadline: float | None
    reconciler: Reconciler | Mapping[str, Reconciler] | None

    @property
    def request(self) -> Any: ...

    def run(self, *args: Any, **kwargs: Any) -> Any: ...

    def send_event(self, type_: str, **fields: Any) -> Any: ...


class Gated(NamedTuple):
    """A row of ``GATES``: the ``task-ledger-*`` event a gate sends, and its handler."""

    event: str
    handler: str


#: What each gate of a claim does: one handler each (``Delivery.<handler>``).
GATES: dict[Gate, Gated] = {
    Gate.RUN: Gated("claimed", "run"),
    Gate.TAKEOVER: Gated("resumed", "run"),
    Gate.RETURN: Gated("returned", "give_back"),
    Gate.WAIT: Gated("waited", "wait"),
    Gate.HOLD: Gated("held", "hold"),
    Gate.BLOCK: Gated("blocked", "block"),
    Gate.CONFLICT: Gated("conflict", "conflict"),
}


class Outcome(str, Enum):
    """What a delivery does with an exception that escaped the body."""

    #: The attempt settles the entry from it (failed, retrying, scheduled); raised again.
    SETTLE = "settle"
    #: The entry is left running for recovery; the delivery is sent again after the lease.
    REDELIVER = "redeliver"
    #: Nothing is settled here; raised again, as it is or as Celery's ``Ignore``.
    RAISE = "raise"


class Escape(NamedTuple):
    """A row of ``ESCAPES``: an exception type, what it leads to, and its handler."""

    kind: type[BaseException]
    outcome: Outcome
    handler: str


#: What each exception escaping the body does; the first row whose type matches decides.
ESCAPES: tuple[Escape, ...] = (
    Escape(Stopped, Outcome.RAISE, "after_stop"),
    Escape(Retry, Outcome.SETTLE, "after_retry"),
    Escape(Reject, Outcome.SETTLE, "after_reject"),
    Escape(Fenced, Outcome.RAISE, "after_fenced"),
    Escape(LedgerBlocked, Outcome.RAISE, "after_blocked"),
    Escape(LedgerUnavailable, Outcome.REDELIVER, "after_unreachable"),
    Escape(Ignore, Outcome.SETTLE, "after_ignore"),
    Escape(Exception, Outcome.SETTLE, "after_failure"),
    Escape(BaseException, Outcome.RAISE, "after_exit"),
)


def escape_of(exc: BaseException) -> Escape:
    """The row of ``ESCAPES`` that decides what ``exc`` does (the first that matches)."""
    return next(row for row in ESCAPES if isinstance(exc, row.kind))


class Delivery:
    """One delivery of ``task`` with these arguments: the claim, then its gate's handler."""

    def __init__(self, task: DeliveryTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.task = task
        self.request = task.request
        self.args = args
        self.kwargs = kwargs
        parts = runtime.runtime_of(task.app)  # looked up once for the whole delivery
        self.settings = parts.settings
        self.store = parts.store
        self.events = parts.events_enabled()
        self.tracing = otel.tracing(self.settings)
        self.lease = float(task.lease_seconds or self.settings.lease_seconds)
        self.header_key = header(self.request, wire.KEY)
        self.key, self.slot = "", concurrency.NO_SLOT  # docs/concurrency.md

    def __call__(self) -> Any:
        """Claim, then hand the claim to its gate's handler; returns what the task returns."""
        with self.tracing.claim(self.task.name) as span:
            claim = self.claim()
            span.claimed(claim)
            gated = GATES[claim.gate]
            found = None if claim.found is None else claim.found.value
            self.emit(gated.event, self.key, claim.fence, found=found)
        log.debug(
            "claim key=%s task_id=%s fence=%s gate=%s",
            self.key,
            self.request.id,
            claim.fence,
            claim.gate.value,
        )
        return getattr(self, gated.handler)(claim)

    def claim(self) -> Claim:
        """Key the call and claim its entry; a WAIT that sees the other attempt end within
        ``ledger_wait_poll_seconds`` claims again, at most twice.

        Raises:
            LedgerError: the arguments cannot be keyed (``refuse``).
            Ignore: the ledger is unreachable; the delivery is sent again after a backoff.
        """
        req = self.request
        try:
            self.key, args_hash = self.task.ledger_key(
                self.args, self.kwargs, req.id, self.header_key, canvas.replacement(req)
            )
            self.slot = concurrency.slot_ask(self.task, self.args, self.kwargs)
        except Exception as exc:  # noqa: BLE001 - key_from is user code, the arguments the sender's
            raise self.refuse(exc) from None
        # A fresh publish (no retry count, not the ledger's own re-send) must bring the
        # arguments its task id was first claimed with; a retry may change them.
        fresh = not req.retries and not header(req, wire.REDELIVERY)
        asked = ClaimRequest(
            key=self.key,
            task_name=self.task.name,
            task_id=req.id,
            args_hash=args_hash,
            snapshot=self.snapshot(),
            side_effect=self.task.side_effect,
            # Eager apply() has no worker node: each process is its own owner, so that one
            # process never takes another's live lease for a previous boot of its own.
            owner=runtime.owner_for(req.hostname, per_process=bool(req.is_eager)),
            lease_seconds=self.lease,
            max_interruptions=self.settings.max_resumes,
            args_may_change=not fresh and self.task.keyed_by_task_id(self.header_key),
            group_id=req.group,
            parent_id=req.parent_id,
            # The admission gate: the claim refuses a delivery whose deadline passed.
            deadline_at=timing.delivery_deadline(req),
            deadline_after=None if self.task.deadline is None else float(self.task.deadline),
            slot=self.slot,
            rate=ratelimit.token_ask(self.task, self.args, self.kwargs),
        )
        claim = None
        for _ in range(3):
            try:
                claim = self.store.claim(asked)
            except LedgerUnavailable as exc:
                ledger_unavailable(self.task, exc, self.args, self.kwargs, self.settings)
            if claim.gate is not Gate.WAIT or not wait_briefly(self.store, self.key, self.settings):
                break
        assert claim is not None
        return claim

    # -- the gates (``GATES``) ------------------------------------------------------------

    def run(self, claim: Claim) -> Any:
        """RUN, TAKEOVER: decide the ambiguous steps, run the body, settle what it returned
        (``complete``); what escapes goes by ``ESCAPES``."""
        attempt = Attempt(
            self.task,
            self.store,
            self.settings,
            key=claim.key,
            fence=claim.fence,
            task_id=self.request.id,
            lease_seconds=self.lease,
            replay=claim.steps,
            actor=self.request.hostname,
            emit=self.emit,
            slot=self.slot,
        )
        token = current_attempt.set(attempt)
        heartbeat.register(attempt)
        try:
            try:
                if claim.gate is Gate.TAKEOVER or claim.steps:
                    early = self.ambiguity(attempt).before_body(claim)
                    if early is not RUN_BODY:
                        return early  # a reconciler proved the body completed; settled
                crash_point(self.settings, "after-claim")
                result = self.task.run(*self.args, **self.kwargs)
            except BaseException as exc:
                getattr(self, escape_of(exc).handler)(attempt, exc)
                raise
            return self.complete(attempt, result)
        finally:
            heartbeat.unregister(attempt)
            current_attempt.reset(token)
            concurrency.after_run(self.task.app, attempt)  # settled, stopped or superseded

    def give_back(self, claim: Claim) -> Any:
        """RETURN: the entry is settled; return its result or raise its failure, once the
        links its settle recorded are the outbox's (``canvas.returned``)."""
        failed = claim.error is not None
        retval = None if failed else decode(claim.result)
        try:
            links = self.links(claim.fence, retval, failed=failed)
            canvas.returned(self.task, self.store, self.key, claim.fence, links)
        except LedgerUnavailable as exc:
            # Which links the settle recorded cannot be read: neither publish them nor
            # let the tracer do it blind. Re-send this delivery (with its links) later.
            ledger_unavailable(self.task, exc, self.args, self.kwargs, self.settings)
        if claim.error is not None:
            raise decode_failure(self.task.backend, claim.error)
        return retval

    def wait(self, claim: Claim) -> NoReturn:
        """WAIT: another attempt holds a live lease; send this delivery again when it may
        have ended (the same task id, no retry spent)."""
        countdown = min(max(claim.lease_remaining or 1.0, 1.0), self.settings.wait_countdown_max)
        redeliver(self.task, self.args, self.kwargs, countdown=countdown)

    def hold(self, claim: Claim) -> NoReturn:
        """HOLD: the ledger sends the entry when due; held for a token, ``ratelimit``."""
        concurrency.after_hold(self.task.app, self.slot, claim, self.request.hostname)
        ratelimit.resend_when_due(self.task, self.args, self.kwargs, claim, self.settings)

    def block(self, claim: Claim) -> NoReturn:
        """BLOCK: the entry is parked for an operator; nothing runs."""
        why = scrub_for_call(
            claim.reason or "",
            redact=self.settings.redact,
            task=self.task,
            args=self.args,
            kwargs=self.kwargs,
        )
        raise LedgerBlocked(
            f"{self.task.name}[{self.request.id}] key {self.key} is blocked: {why}; see "
            f"`celery-ledger show {self.key}`"
        )

    def conflict(self, claim: Claim) -> NoReturn:
        """CONFLICT: the key was first claimed with other arguments; refused, nothing runs."""
        keyed_by_id = self.task.keyed_by_task_id(self.header_key)
        what = "task id" if keyed_by_id else f"business key {self.key}"
        raise self.refuse(
            KeyConflict(
                f"{self.task.name}[{self.request.id}]: {what} was first claimed with different "
                "arguments; the body did not run (use a different key, or the same arguments)"
            )
        )

    # -- the body returned ----------------------------------------------------------------

    def complete(self, attempt: Attempt, result: Any) -> Any:
        """Settle ``completed`` with the result and the links that follow it, then publish
        the links; returns the result.

        Raises:
            PayloadError: the result cannot be stored (settled ``failed``).
            Ignore: the settle was refused (superseded).
        """
        req = self.request
        try:
            # What Celery's backend stores (``prepare_value``: a returned AsyncResult or
            # GroupResult becomes its ``as_tuple()``), not the raw object: the ledger's
            # result is the one the caller gets, and a RETURN hands it back the same.
            encoded = encode(
                self.task.backend.prepare_value(result),
                limit=self.settings.max_result_bytes,
                what=f"result of {self.task.name}",
            )
        except PayloadError as exc:
            attempt.settle(EntryStatus.FAILED, error=self.dump(exc))
            raise
        # The next link receives the result as stored (decoded), if there is a next link.
        retval = decode(encoded) if req.chain or req.callbacks else None
        links = self.links(attempt.fence, retval)
        crash_point(self.settings, "before-settle")
        if attempt.replayed:
            self.emit("replayed", attempt.key, attempt.fence, steps=attempt.replayed)
        if not attempt.settle(EntryStatus.COMPLETED, result=encoded, links=links.children):
            self.emit("fenced", attempt.key, attempt.fence, reason="settle refused")
            raise Ignore()
        # The links are the outbox's now: the tracer must not publish them too.
        links.hand_over(req)
        crash_point(self.settings, "after-settle")
        canvas.publish_links(self.store, self.task.app, attempt.key, attempt.fence, links.children)
        crash_point(self.settings, "after-publish")
        return result

    # -- what escaped the body (``ESCAPES``) ----------------------------------------------

    def after_stop(self, attempt: Attempt, exc: Stopped) -> NoReturn:
        """The entry is settled already (sleeping, cancelled, expired): raise what ends the
        delivery (``Ignore``, or the cancellation's or deadline's failure)."""
        raise exc.outcome from None

    def after_retry(self, attempt: Attempt, exc: Retry) -> None:
        """``self.retry()``: settle ``retrying``, due at its ETA plus the grace; or
        ``scheduled`` when the ledger holds its long countdown (design.md § "Durable
        time")."""
        due, held = timing.retry_due(self.task, exc, self.settings), timing.held_retry(exc)
        if held is not None:
            due = {k: v for k, v in due.items() if k == "snapshot"} | held
        status = EntryStatus.RETRYING if held is None else EntryStatus.SCHEDULED
        attempt.settle(status, **due)

    def after_reject(self, attempt: Attempt, exc: Reject) -> None:
        """Celery's ``Reject`` (guarantees.md § "Bad input"): not the task's failure; it
        tells the broker what to do with the message, and the ledger follows it.

        ``requeue=True``: the message goes back to the queue and the body is to run again.
        (Settled ``failed``, every redelivery RETURNed the ``Reject`` and requeued forever.)
        The attempt ended cleanly, as a ``self.retry()`` does: it settles ``retrying``, the
        requeued message's claim RUNs the body with completed steps replaying, and should
        that message be lost, the sweep re-sends it once due (after
        ``ledger_retry_grace_seconds``). A body that rejects every time requeues every time,
        as under plain Celery.

        ``requeue=False``: the broker drops (or dead-letters) the message; nothing will run
        it again. The entry ends ``failed`` with a reason saying so, so that the sweep never
        re-sends it and a stray duplicate RETURNs it (raising a ``Reject`` that drops it).
        Celery calls no ``link_error`` for a rejected task, so none are recorded.
        """
        if exc.requeue:
            attempt.settle(EntryStatus.RETRYING, due_in=self.settings.retry_grace_seconds)
            return
        attempt.settle(
            EntryStatus.FAILED,
            error=self.dump(exc),
            reason=f"rejected (requeue=False), message dropped: {exc.reason!r}"[:500],
        )

    def after_fenced(self, attempt: Attempt, exc: Fenced) -> NoReturn:
        """Superseded: another attempt owns the entry; ack, store nothing. A start refused by
        a cancellation or a deadline settles it first (design.md § "Durable time")."""
        try:
            timing.explain_refusal(attempt)
        except Stopped as stop:
            raise stop.outcome from None
        self.emit("fenced", attempt.key, attempt.fence, reason=str(exc))
        raise Ignore() from exc

    def after_blocked(self, attempt: Attempt, exc: LedgerBlocked) -> None:
        """Parked for an operator already (drift, an unresolved ambiguous step)."""

    def after_unreachable(self, attempt: Attempt, exc: LedgerUnavailable) -> NoReturn:
        """The ledger went away mid-body, past the write retries. Settling ``failed`` would be
        a lie (nothing failed) and impossible anyway: leave the entry running. Its lease
        expires, the sweep interrupts it, and a resume replays what completed. Re-deliver
        after the lease too, in case the sweep's own resume message is the one that gets
        lost."""
        log.error(
            "ledger unreachable mid-task key=%s task_id=%s fence=%s (%s); entry "
            "left running for recovery",
            attempt.key,
            attempt.task_id,
            attempt.fence,
            exc,
        )
        redeliver(self.task, self.args, self.kwargs, countdown=self.lease + 1.0)

    def after_ignore(self, attempt: Attempt, exc: Ignore) -> None:
        """``Ignore`` from ``self.replace(sig)``: settle ``failed`` with a reason naming the
        replacement (``replacing``); any other ``Ignore`` fails the task as an exception."""
        if attempt.replaced_by is None:
            self.after_failure(attempt, exc)
            return
        reason = f"replaced by {attempt.replaced_by}"
        attempt.settle(EntryStatus.FAILED, error=self.dump(exc), reason=reason)

    def after_failure(self, attempt: Attempt, exc: BaseException) -> None:
        """The task failed: settle ``failed`` with its ``link_error`` callbacks recorded, as a
        success's links are, and publish them. An exception from inside a started effect step
        asks first (``Ambiguity.after_escape``): the step may have crossed."""
        if attempt.ambiguous is not None and self.ambiguity(attempt).after_escape():
            return  # blocked, or fenced out: nothing left to settle
        links = self.links(attempt.fence, None, failed=True)
        if attempt.settle(EntryStatus.FAILED, error=self.dump(exc), links=links.children):
            links.hand_over(self.request)
            canvas.publish_links(
                self.store, self.task.app, attempt.key, attempt.fence, links.children
            )

    def after_exit(self, attempt: Attempt, exc: BaseException) -> None:
        """``SystemExit``, ``KeyboardInterrupt``: the process is going away, the task did not
        fail. Settle nothing (a stored BaseException would be raised again by every later
        delivery): the entry stays running, the worker's parent sees the pool process lost
        (``request.LedgerRequest``) or the lease expires, and the resume replays what
        completed."""
        log.warning(
            "%s raised in the body key=%s task_id=%s fence=%s; entry left running for recovery",
            type(exc).__name__,
            attempt.key,
            attempt.task_id,
            attempt.fence,
        )

    # -- helpers --------------------------------------------------------------------------

    def ambiguity(self, attempt: Attempt) -> Ambiguity:
        return Ambiguity(attempt, self.task.reconciler, self.args, self.kwargs)

    def refuse(self, exc: BaseException) -> BaseException:
        """End a delivery whose arguments cannot be keyed or stored, or that conflicts with
        its key's first claim (``refusal``): nothing runs; its own entry settles ``failed``
        with the refusal as its reason. Returns the error to raise."""
        refused = refusal.as_refusal(self.task, exc)
        req = self.request
        refusal.record(self.task, self.store, str(req.id), refused, req.hostname, self.settings)
        return refused

    def links(self, fence: int, retval: Any, *, failed: bool = False) -> canvas.Links:
        """The links this delivery publishes when it completes (``canvas.links_of``) or, if
        ``failed``, its ``link_error`` callbacks (``canvas.errback_links_of``), as the settle
        at ``fence`` records them; none taken over if one cannot be stored (the tracer then
        publishes them, as Celery does)."""
        req = self.request
        nothing = canvas.Links([], False, list(req.callbacks or ()))
        if failed:
            nothing.errbacks_left = list(req.errbacks or ())
            if not req.errbacks:
                return nothing
        elif not (req.chain or req.callbacks):
            return nothing
        try:
            if failed:
                return canvas.errback_links_of(self.task, req, self.key, fence=fence)
            return canvas.links_of(self.task, req, self.key, retval, fence=fence)
        except PayloadError as exc:
            log.warning(
                "links of key=%s task_id=%s not recorded (%s); Celery publishes them",
                self.key,
                req.id,
                exc,
            )
            return nothing

    def snapshot(self) -> str | None:
        """The delivery's envelope (``envelope.of_request``), sealed for the claim; None if
        not storable (recovery then reports the entry rather than resume it)."""
        req = self.request
        try:
            return envelope.seal(
                self.task.app,
                envelope.of_request(req, self.args, self.kwargs, canvas=canvas.placement(req)),
            )
        except PayloadError as exc:
            log.warning(
                "no argument snapshot for task_id=%s (%s); recovery will report it, not resume it",
                req.id,
                exc,
            )
            return None

    def dump(self, exc: BaseException) -> str:
        return encode_failure(exc, limit=self.settings.max_exception_bytes)

    def emit(self, kind: str, key: str, fence: int, **fields: Any) -> None:
        """Send a ``task-ledger-<kind>`` Celery event, and add it to the current span
        (``otel``); monitoring never breaks a task."""
        self.tracing.event(kind, key, fence, fields)
        if not self.events:
            return
        try:
            self.task.send_event(
                f"task-ledger-{kind}",
                retry=False,
                key=key,
                fence=fence,
                task_name=self.task.name,
                **fields,
            )
        except Exception as exc:  # noqa: BLE001
            log.debug("could not send task-ledger-%s for key=%s: %r", kind, key, exc)


@contextlib.contextmanager
def replacing(attempt: Attempt, sig: Any) -> Iterator[None]:
    """Around Celery's ``on_replace``: it publishes ``sig`` under this task's id and raises
    ``Ignore``. The attempt remembers what replaced it, so that the entry is settled
    ``failed`` with that ``Ignore`` and a reason naming the replacement (``after_ignore``): a
    redelivery RETURNs it and raises ``Ignore`` again, storing nothing over the
    replacement's result and publishing nothing (design.md § "Canvas: chains, groups,
    chords, callbacks")."""
    attempt.replaced_by = f"{sig.name or sig.task}[{sig.id}]"
    try:
        yield
    except Ignore:
        crash_point(attempt.settings, "after-publish")
        raise

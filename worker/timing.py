"""Durable time for ledgered tasks (design.md § "Durable time"): held countdowns, sleep, deadlines,
cancellation.

- **Held countdowns.** ``apply_async(countdown=/eta=)`` further away than
  ``ledger_hold_threshold_seconds`` records a ``scheduled`` entry (due time and argument
  snapshot) and publishes nothing (``hold``); ``self.retry(countdown=)`` past it settles the
  entry ``scheduled`` instead of publishing the retry (``held_retry``). The sweep publishes
  what is due with the original task id (``recovery.wake.wake_due``). No broker ever holds a
  long-delayed message, so no visibility timeout or ``consumer_timeout`` can duplicate or kill
  it.
- **Sleep.** ``self.sleep(seconds)`` / ``self.wait_until(when)`` is a step (its wake time is
  its output, so it never sleeps twice); while the wake time is ahead the entry settles
  ``sleeping`` and the attempt ends (message acked, no worker slot held).
- **Deadlines.** Celery's ``expires`` and the ledger's ``deadline`` (task option: seconds after
  the entry was created; or the ``ledger_deadline`` header: seconds since the epoch) ride on
  the claim, which stores the earliest and refuses a delivery whose deadline passed on the
  database clock (``ledger.admission``); every effect step's ``started`` write re-checks it
  in the same statement.
- **Cancellation.** ``cancel_entry`` (the CLI's ``cancel``) and ``revoke()`` (producer side:
  ``app.control.revoke``; worker side: the ``revoke`` control command) record it in the ledger.
  A running attempt finds out at its next effect step: the step's own ``started`` write
  refuses to start (no extra statement); ``explain_refusal`` then settles ``cancelled``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Retry
from celery.utils.time import maybe_make_aware

from celery_ledger import canvas, envelope, runtime
from celery_ledger.codec import encode_failure
from celery_ledger.errors import Stopped
from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    LedgerError,
    LedgerStore,
    TaskCancelled,
    TaskExpired,
    wire,
)
from celery_ledger.ledger.admission import expired_failure
from celery_ledger.ledger.schedule import SLEEP_STEP, cancelled_failure
from celery_ledger.redelivery import header

if TYPE_CHECKING:
    from celery_ledger.attempt import Attempt
    from celery_ledger.settings import LedgerSettings

log = logging.getLogger(__name__)


# -- held countdowns ---------------------------------------------------------------------------


class RetryCall:
    """One ``LedgerTask.retry`` call in progress, and the due time the ledger held its publish
    for (None: published as Celery's)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[str, float] | None = None


#: The ``LedgerTask.retry`` call running right now: only its publish is a retry the attempt
#: may hold (not the ledger's own re-sends from inside an attempt, which carry a retry count
#: too). Set for the length of that call and no longer: a pool process runs task after task
#: in one context, so nothing a retry records may outlive its call (``held_retry``).
_retry_call: contextvars.ContextVar[RetryCall | None] = contextvars.ContextVar(
    "ledger_retry_call", default=None
)
#: The attribute of a ``Retry`` that carries the due time the ledger held it for.
_HELD_ATTR = "ledger_held_due"


@contextlib.contextmanager
def in_retry() -> Iterator[RetryCall]:
    call = RetryCall()
    token = _retry_call.set(call)
    try:
        yield call
    finally:
        _retry_call.reset(token)


def hold_due(task: Any, options: dict[str, Any], *, linked: bool) -> dict[str, float] | None:
    """The due time (``{"due_in": s}`` on the database clock, or ``{"due_at": ts}``) when this
    publish is one the ledger holds; None when Celery's behaviour applies (short or no delay,
    eager, the ledger's own re-sends, or callbacks, which the ledger does not store)."""
    threshold = runtime.settings_for(task.app).hold_threshold_seconds
    if threshold <= 0 or linked or task.app.conf.task_always_eager:
        return None
    headers = options.get("headers") or {}
    # The ledger's own re-sends are never held; a retry is not one, even of a delivery that
    # was (its options copy the delivery's headers).
    resent = headers.get(wire.REDELIVERY) or headers.get(wire.UNAVAILABLE)
    if resent and _retry_call.get() is None:
        return None
    if options.get("chain") or options.get("chord"):
        return None
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None:
        seconds = float(countdown)
        return {"due_in": seconds} if seconds > threshold else None
    if eta is None:
        return None
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    when = maybe_make_aware(eta).timestamp()
    return {"due_at": when} if when - time.time() > threshold else None


def hold(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task_id: str,
    options: dict[str, Any],
    due: dict[str, float],
) -> bool:
    """Hold this publish in the ledger: a retry of the running attempt is settled
    ``scheduled`` by it (``held_retry``); any other publish records a ``scheduled`` entry.

    Returns False when the ledger holds nothing (the key has an entry, or the ledger cannot
    be reached: logged): the caller then publishes as Celery would.
    """
    from celery_ledger.attempt import current_attempt

    attempt = current_attempt.get()
    call = _retry_call.get()
    if call is not None and attempt is not None and attempt.task_id == task_id:
        call.held = dict(due)
        return True
    try:
        settings = runtime.settings_for(task.app)
        # The whole message the producer meant (its options, its place in a group), sent as
        # it is when due (``recovery.resend``); its deadline on the database clock.
        held = envelope.of_publish(
            task, args, kwargs, options, canvas=canvas.published_placement(options, None, None)
        )
        key, args_hash = task.ledger_key(
            args, kwargs, task_id, held.ledger_key, canvas.replacement(held.canvas)
        )
        snapshot = envelope.seal(task.app, held)
        deadline_at, deadline_in = envelope.deadline_of(options)
        recorded = runtime.store_for(task.app).schedule(
            ClaimRequest(
                key=key,
                task_name=task.name,
                task_id=task_id,
                args_hash=args_hash,
                snapshot=snapshot,
                side_effect=task.side_effect,
                owner=runtime.owner_for(None),
                lease_seconds=settings.lease_seconds,
                max_interruptions=settings.max_resumes,
            ),
            deadline_at=deadline_at,
            deadline_in=deadline_in,
            **due,
        )
    except Exception as exc:  # noqa: BLE001 - the publish goes ahead as Celery's
        log.warning(
            "%s[%s] not held by the ledger (%s); published with its countdown as Celery does",
            task.name,
            task_id,
            exc,
        )
        return False
    if not recorded:
        log.info(
            "%s[%s]: key %s has an entry already; published with its countdown as Celery does",
            task.name,
            task_id,
            key,
        )
    return recorded


def retry_due(task: Any, exc: Retry, settings: LedgerSettings) -> dict[str, Any]:
    """When a ``self.retry()`` is due and what it re-sends: the fields of its ``retrying``
    settle (``Delivery.after_retry``), so that the sweep re-sends a retry whose message is
    lost (design.md § "Recovery").

    Due at its ETA (``countdown`` seconds from now on the database clock, or the ``eta``
    datetime) plus ``ledger_retry_grace_seconds``; the snapshot becomes the retry's own
    arguments and retry count (``retry(args=...)`` may change them).
    """
    grace = settings.retry_grace_seconds
    when = exc.when
    due: dict[str, Any] = {"due_in": grace}  # no ETA known: due after the grace alone
    if isinstance(when, str):
        with contextlib.suppress(ValueError):
            when = datetime.fromisoformat(when)
    if isinstance(when, datetime):
        due = {"due_at": maybe_make_aware(when).timestamp() + grace}
    elif isinstance(when, (int, float)):
        due = {"due_in": max(float(when), 0.0) + grace}
    sig = exc.sig
    if sig is None:
        return due
    req = task.request
    try:
        due["snapshot"] = envelope.seal(
            task.app, envelope.of_retry(req, sig, canvas=canvas.placement(req))
        )
    except Exception as exc_:  # noqa: BLE001 - nothing here may stop the retry itself
        # The entry keeps the snapshot it has, as a claim does for arguments it cannot
        # snapshot; the retry's own message carries the new arguments.
        log.warning(
            "no argument snapshot for the retry of task_id=%s (%s); a lost retry is "
            "re-sent with the arguments last stored",
            req.id,
            exc_,
        )
    return due


def mark_held(retry: BaseException, call: RetryCall) -> None:
    """Tie the hold of ``call`` (if its publish was held) to the ``Retry`` it made: the hold
    is that exception's, and only its settle (``held_retry``) may use it."""
    if call.held is not None:
        setattr(retry, _HELD_ATTR, dict(call.held))


def held_retry(retry: BaseException) -> dict[str, float] | None:
    """The due time the ledger held this ``Retry``'s publish for; None when it was
    published (or is not a ``LedgerTask.retry`` of this attempt)."""
    due = getattr(retry, _HELD_ATTR, None)
    return dict(due) if isinstance(due, dict) else None


# -- deadlines ---------------------------------------------------------------------------------


def delivery_deadline(req: Any) -> float | None:
    """The absolute deadline a delivery carries (its ``expires``, its ``ledger_deadline``
    header), for its claim: the admission gate stores the earliest it knows and refuses the
    delivery once it passed on the database clock (``ledger.admission``)."""
    return envelope.absolute_deadline(req.expires, header(req, wire.DEADLINE), task_id=req.id)


# -- cancellation and refused starts -----------------------------------------------------------


def explain_refusal(attempt: Attempt) -> None:
    """A fenced write was refused: if it was an effect step's start that a cancellation or a
    passed deadline refused, settle the entry ``cancelled``/``expired`` (same fence, through
    the attempt: ``Attempt.settle``).

    Returns when the fence moved (superseded: the caller goes on as before).

    Raises:
        Stopped: settled cancelled or expired.
    """
    try:
        why = attempt.stop_reason()
    except LedgerError:
        return
    if why == EntryStatus.CANCELLED.value:
        _settle_stop(attempt, EntryStatus.CANCELLED, "cancelled before this step started")
    if why == EntryStatus.EXPIRED.value:
        _settle_stop(attempt, EntryStatus.EXPIRED, "the deadline passed before this step")


def _settle_stop(attempt: Attempt, status: EntryStatus, why: str) -> None:
    exc_type = TaskCancelled if status is EntryStatus.CANCELLED else TaskExpired
    exc = exc_type(f"{attempt.task.name}[{attempt.task_id}] key {attempt.key}: {why}")
    error = encode_failure(exc, limit=attempt.settings.max_exception_bytes)
    if not attempt.settle(status, error=error):
        raise Stopped(Ignore())  # another attempt owns it now
    log.warning("%s key=%s task_id=%s: %s", status.value, attempt.key, attempt.task_id, why)
    raise Stopped(exc)


def cancel_entry(app: Any, store: LedgerStore, key: str, *, by: str, reason: str) -> Any:
    """Cancel ``key`` durably (``LedgerStore.request_cancel``); returns its ``CancelOutcome``."""
    return store.request_cancel(
        key, by=by, reason=reason, error=cancelled_failure(f"cancelled by {by}: {reason}")
    )


def cancel_task_ids(app: Any, task_ids: Iterable[str], *, by: str, reason: str) -> int:
    """Cancel the ledger entries of ``task_ids`` (a revoke); never raises. Returns how many
    entries it cancelled or marked."""
    done = 0
    try:
        store = runtime.store_for(app)
        for task_id in task_ids:
            for key in store.keys_of_task_id(str(task_id)):
                if cancel_entry(app, store, key, by=by, reason=reason).outcome != "settled":
                    done += 1
    except Exception as exc:  # noqa: BLE001 - a revoke goes on as Celery's without the ledger
        log.warning("revoke of %s not recorded in the ledger: %s", list(task_ids), exc)
    return done


def discarded(app: Any, task_id: str, *, expired: bool, node: str) -> None:
    """Celery discarded the message of ``task_id`` without running it: end its entry, so that
    no sweep sends back what Celery dropped. An expired one settles ``expired`` once its
    deadline passed on the database clock too (``LedgerStore.expire_passed``: a worker whose
    clock runs ahead leaves it to the sweep, which expires it rather than re-send it); a
    revoked one is cancelled (``revoke()`` by id is recorded already; by a stamped header
    it is not, otherwise). Runs in the worker's parent: reads the ledger by task id, never
    the task's own key function. Never raises."""
    try:
        store = runtime.store_for(app)
        keys = store.keys_of_task_id(task_id)
        if expired:
            why = f"task {task_id}: its message expired before a worker ran it"
            for key in store.expire_passed(keys, expired_failure(why), actor=node):
                log.warning("expired key=%s task_id=%s: Celery discarded its message", key, task_id)
            return
        for key in keys:
            cancel_entry(app, store, key, by=f"revoke@{node}", reason="Celery discarded it")
    except Exception as exc:  # noqa: BLE001 - a discard goes on as Celery's without the ledger
        log.warning("discard of task_id=%s not recorded in the ledger: %s", task_id, exc)


def install_revoke_hooks(app: Any) -> None:
    """Record ``revoke()`` in the ledger on the producer: ``app.control.revoke``, which
    ``AsyncResult.revoke`` calls. The app's control object is made with a subclass of its
    control class (or patched, when it exists already). Idempotent."""
    if "control" in app.__dict__:  # made already (a cached property)
        _wrap_revoke(app, app.control)
        return
    base = app.control_cls
    if isinstance(base, str):
        from celery.utils.imports import symbol_by_name

        base = symbol_by_name(base)
    if getattr(base, "_ledger", False):
        return

    class LedgerControl(base):  # type: ignore[misc, valid-type]
        _ledger = True

        def revoke(self, task_id: Any, *args: Any, **kwargs: Any) -> Any:
            ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
            cancel_task_ids(self.app, ids, by="revoke", reason="AsyncResult.revoke()")
            return super().revoke(task_id, *args, **kwargs)

    app.control_cls = LedgerControl


def _wrap_revoke(app: Any, control: Any) -> None:
    if getattr(control.revoke, "_ledger", False):
        return
    original = control.revoke

    def revoke(task_id: Any, *args: Any, **kwargs: Any) -> Any:
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        cancel_task_ids(app, ids, by="revoke", reason="AsyncResult.revoke()")
        return original(task_id, *args, **kwargs)

    revoke._ledger = True  # type: ignore[attr-defined]
    control.revoke = revoke


def install_worker_revoke_hook() -> None:
    """Wrap the worker's ``revoke`` control command (``celery.worker.control.Panel``)."""
    from celery.worker.control import Panel

    original = Panel.data.get("revoke")
    if original is None or getattr(original, "_ledger", False):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        app = getattr(state, "app", None)
        if app is not None:
            hostname = getattr(state, "hostname", "worker")
            cancel_task_ids(app, ids, by=f"revoke@{hostname}", reason="revoke control command")
        return reply

    revoke._ledger = True  # type: ignore[attr-defined]
    Panel.data["revoke"] = revoke


# -- provider key windows ------------------------------------------------------------------


def key_window_passed(attempt: Attempt, ident: tuple[str, str, int]) -> bool:
    """Whether an ambiguous ``keyed`` step's provider key may have been forgotten: its task's
    ``provider_key_ttl`` (seconds) has passed since the key was first sent, on the database
    clock. The first send is the step's ``started_at`` when it started once; after a re-run
    that time was overwritten, so the entry's creation (earlier still) stands in for it: the
    window is judged passed sooner, never later.

    A body that records no steps (design.md § "One envelope, one admission gate": ``BODY_STEP``,
    ambiguous on takeover) has no row
    of its own until a verdict writes one: it sent its key when the entry first executed,
    which is the entry's first ``claimed`` event (``first_execution_at``; ``created_at``, never
    later, when that event is gone). Not ``created_at`` itself: a publish intent or a task the
    ledger held for a long countdown is created long before it first runs."""
    from celery_ledger.ledger import BODY_STEP, SideEffect

    ttl = getattr(attempt.task, "provider_key_ttl", None)
    if ttl is None or attempt.side_effect is not SideEffect.KEYED:
        return False
    row = attempt.replay_row(ident)
    store = runtime.store_for(attempt.task.app)
    if row is None:
        if ident[0] != BODY_STEP:
            return False  # first started by this very attempt: just now
        since = store.first_execution_at(attempt.key)
    else:
        first_start = row.started_at if row.attempts <= 1 else None
        since = first_start if first_start is not None else store.get_entry(attempt.key).created_at
    passed = store.now() - since > float(ttl)
    if passed:
        log.warning(
            "keyed step %s of key=%s started %.0fs ago, past provider_key_ttl=%ss: asking its "
            "reconciler instead of re-running it",
            ident[0],
            attempt.key,
            store.now() - since,
            ttl,
        )
    return passed


# -- sleep -------------------------------------------------------------------------------------


def sleep_until(attempt: Attempt, *, seconds: float | None, when: float | None) -> None:
    """The body of ``self.sleep``/``self.wait_until``: a step whose output is the wake time
    (database clock), so a resume never sleeps again; while it is ahead, settle ``sleeping``
    and end the attempt.

    Raises:
        Stopped: the entry sleeps until its wake time (the delivery is acked).
    """
    if seconds is not None:
        wake = attempt.step(
            SLEEP_STEP, lambda s: attempt.now() + s, (float(seconds),), {}, effect=False
        )
    else:
        wake = attempt.step(SLEEP_STEP, lambda w: w, (float(when),), {}, effect=False)  # type: ignore[arg-type]
    if attempt.now() >= float(wake):
        return
    if not attempt.settle(EntryStatus.SLEEPING, due_at=float(wake)):
        raise Stopped(Ignore())
    log.info("sleeping key=%s task_id=%s until %.3f", attempt.key, attempt.task_id, wake)
    raise Stopped(Ignore())

"""Celery's ``celery.chord_unlock`` as a ledgered task (design.md § "Canvas: chains, groups,
chords, callbacks").

On result backends without a native join (the database backends, the embedded ``db+sqlite``)
a chord's callback is published by one task, ``celery.chord_unlock``, that polls the header's
results and retries itself every ``result_chord_retry_interval`` until they are ready. Its
messages were Celery's alone: a retry whose publish the broker refused failed the chord, and a
message held for its countdown by a worker killed whole stayed unacked in Redis for its
visibility timeout (an hour), so the chord never called back.

A ledger app replaces the task under the same name with ``ChordUnlock``, a ``LedgerTask``:

- its first message (``Backend.fallback_chord_unlock``) records a publish intent, which the
  sweep re-sends if no worker claims it (``ledger_publish_intent_seconds``);
- each poll that finds the header not ready settles ``retrying``, due at its countdown plus
  ``ledger_retry_grace_seconds``, and the sweep re-sends a retry whose message was lost;
- a retry or a callback publish the broker refuses is held by the ledger instead of failing
  the chord: the poll ends ``retrying`` without a message, and the sweep sends it.

Running a poll twice is harmless (``side_effect="idempotent"``): it only reads the header's
results and publishes the callback under the chord body's frozen id, which a ledgered
callback's claim deduplicates.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.canvas import maybe_signature
from celery.exceptions import ChordError, MaxRetriesExceededError, Reject, Retry
from celery.result import allow_join_result, result_from_tuple

from celery_ledger.ledger import SideEffect
from celery_ledger.task import LedgerTask

log = logging.getLogger(__name__)

#: Celery's name for the chord join task; ``Backend.fallback_chord_unlock`` sends it by it.
CHORD_UNLOCK = "celery.chord_unlock"


def _chord_error(message: str, original_exc: BaseException | None = None) -> ChordError:
    """The ``ChordError`` Celery's own ``chord_unlock`` raises, the original as its cause (the
    private ``_create_chord_error_with_cause`` of Celery 5.6 and later; 5.4 and 5.5 lack it)."""
    error = ChordError(message)
    if isinstance(original_exc, Exception):
        error.__cause__ = original_exc
    return error


def _publish_callback(app: Celery, callback: Any, ret: Any) -> None:
    """Publish the chord's callback as Celery's own ``chord_unlock`` does: through
    ``AMQP._retry_publish`` (private, Celery 5.7), which waits between the retries of each of
    the callback's messages; Celery 5.4 to 5.6 lack it and call ``callback.delay`` directly."""
    retry_publish = getattr(app.amqp, "_retry_publish", None)
    if retry_publish is None:
        callback.delay(ret)
    else:
        retry_publish(callback.delay, ret)


def unlock_id(group_id: str) -> str:
    """The task id (and so the entry) of the ``chord_unlock`` of the chord whose header is
    ``group_id``; its retries keep it."""
    return f"chord-unlock-{group_id}"


class ChordUnlock(LedgerTask):
    """``celery.chord_unlock`` held in the ledger: a poll is idempotent (it reads results and
    publishes the callback under its frozen id), so a lost one is simply run again."""

    side_effect = SideEffect.IDEMPOTENT.value
    max_retries = None
    ignore_result = True

    def apply_async(  # type: ignore[override]  # the same call; Celery's own options pass through
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """Send the chord's first poll under ``unlock_id`` of its group: one entry per chord
        (a chord applied again, frozen, meets its own entry), and one its producer can name."""
        if task_id is None and args:
            task_id = unlock_id(str(args[0]))
        return super().apply_async(args, kwargs, task_id=task_id, **options)

    def hold_retry(self, interval: float, exc: BaseException | None, **options: Any) -> Retry:
        """The ``Retry`` that ends this poll: published as Celery's, or, when the broker
        refuses the publish, held by the ledger (the poll settles ``retrying`` without a
        message and the sweep re-sends it once due, design.md § "Recovery")."""
        try:
            retry = self.retry(exc=exc, countdown=interval, throw=False, **options)
        except Reject as refused:
            req = self.request
            log.warning(
                "chord_unlock task_id=%s: its retry could not be published (%r); the ledger "
                "re-sends it once due",
                req.id,
                refused.reason,
            )
            sig = self.signature_from_request(
                req, None, None, countdown=interval, retries=req.retries + 1, **options
            )
            return Retry(exc=exc, when=interval, sig=sig)
        assert isinstance(retry, Retry)
        return retry


def unlock_chord(
    self: ChordUnlock,
    group_id: str,
    callback: Any,
    interval: float | None = None,
    max_retries: int | None = None,
    result: Any = None,
    **kwargs: Any,
) -> None:
    """Celery 5.7's ``unlock_chord`` (``celery.app.builtins.add_unlock_chord_task``), its
    retries and its callback publish held by the ledger (``ChordUnlock.hold_retry``)."""
    app = self.app
    if interval is None:
        interval = float(app.conf.result_chord_retry_interval)
    options: dict[str, Any] = {}
    # Preserved for retries: not part of delivery_info (as Celery's).
    exchange_type = kwargs.pop("_chord_unlock_exchange_type", None)
    if exchange_type is not None:
        options["exchange_type"] = exchange_type
    deps = app.GroupResult(group_id, [result_from_tuple(r, app=app) for r in result], app=app)
    callback = maybe_signature(callback, app=app)
    ready_error: Exception | None = None
    try:
        ready = deps.ready()
    except Exception as exc:  # noqa: BLE001 - Celery retries on it too
        ready, ready_error = False, exc
    if not ready:
        if max_retries is not None and self.request.retries >= max_retries:
            reason = f"chord_unlock gave up after {max_retries} retries"
            error = _chord_error(message=reason, original_exc=ready_error)
            app.backend.chord_error_from_stack(callback=callback, exc=error)
            raise MaxRetriesExceededError(reason)
        raise self.hold_retry(interval, ready_error, **options)
    join = deps.join_native if deps.supports_native_join else deps.join
    try:
        with allow_join_result():
            ret = join(timeout=app.conf.result_chord_join_timeout, propagate=True)
    except Exception as exc:  # a member failed: the chord fails, as Celery's does
        try:
            culprit = next(deps._failed_join_report())
            reason = f"Dependency {culprit.id} raised {exc!r}"
        except StopIteration:
            reason = repr(exc)
        log.exception("Chord %r raised: %r", group_id, exc)
        error = _chord_error(message=reason, original_exc=exc)
        app.backend.chord_error_from_stack(callback=callback, exc=error)
        return
    try:
        _publish_callback(app, callback, ret)
    except Exception as exc:  # the broker refused it: poll again, held
        # The callback keeps the chord body's frozen id: publishing it again on the next poll
        # is deduplicated by a ledgered callback's claim, where Celery failed the chord.
        log.warning(
            "Chord %r: its callback could not be published (%r); polling again", group_id, exc
        )
        raise self.hold_retry(interval, exc, **options) from exc


def register(app: Celery) -> None:
    """Put ``ChordUnlock`` under Celery's name on ``app``, in place of the builtin (which
    Celery registers as the app is finalized: replaced right after it)."""
    if app.finalized:
        _replace(app)
    else:
        app.on_after_finalize.connect(_on_finalized, weak=False, sender=app)


def _on_finalized(sender: Celery, **_: Any) -> None:
    _replace(sender)


def _replace(app: Celery) -> None:
    if isinstance(app._tasks.get(CHORD_UNLOCK), ChordUnlock):
        return
    app._tasks.pop(CHORD_UNLOCK, None)
    app._task_from_fun(
        unlock_chord,
        name=CHORD_UNLOCK,
        base=ChordUnlock,
        bind=True,
        ignore_result=True,
        max_retries=None,
    )

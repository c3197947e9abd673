"""Sending a delivery again later, and waiting briefly before doing so.

A ledgered task re-queues itself, with the same task id and without spending one of Celery's
retries, when it must not run now: another attempt holds a live lease (WAIT), or the ledger
cannot be reached at claim (fail closed: the body does not run). The re-sent message carries
``ledger_redelivery`` (the entry exists with these arguments: no publish intent is recorded
for it, and its claim does not treat it as a fresh publish) or, after an unreachable ledger,
``ledger_unavailable``: how many times in a row, for the backoff (no intent either; the
delivery never reached a claim, so it stays as fresh as it came).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject

from celery_ledger.ledger import EntryStatus, LedgerStore, LedgerUnavailable, wire
from celery_ledger.recovery.publish import confirmed
from celery_ledger.settings import LedgerSettings

log = logging.getLogger(__name__)

#: How often a WAIT polls the other attempt's entry within ``ledger_wait_poll_seconds``.
WAIT_POLL_INTERVAL = 0.05


def header(req: Any, name: str) -> Any:
    """A message header of a Celery request (``req.<name>``, else ``req.headers[name]``)."""
    value = getattr(req, name, None)
    if value is None and isinstance(getattr(req, "headers", None), dict):
        value = req.headers.get(name)
    return value


def redeliver(
    task: Task,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    countdown: float,
    headers: dict[str, Any] | None = None,
    vouched: bool = True,
) -> NoReturn:
    """Send this delivery again later with the same task id, without spending a retry.

    ``vouched``: the claim saw this delivery's arguments and found them the entry's, so the
    re-send is marked ``ledger_redelivery`` (not a fresh publish). A delivery that never
    reached a claim (ledger unreachable) keeps whatever mark it came with.

    Raises:
        Ignore: the copy is the broker's (confirmed on RabbitMQ); Celery then acks this
            message and records no state, so a RETURN stored by the other attempt is not
            overwritten with RETRY.
        Reject: the broker did not take the copy; this delivery is requeued instead of acked.
    """
    sig = task.signature_from_request(task.request, args, kwargs, countdown=countdown)
    # The entry exists (WAIT) or the ledger is down (claim): no publish intent to record.
    merged = {**(sig.options.get("headers") or {}), **(headers or {})}
    if vouched or header(task.request, wire.REDELIVERY):
        merged[wire.REDELIVERY] = True
    else:
        merged.pop(wire.REDELIVERY, None)
    sig.options["headers"] = merged
    try:
        # This delivery is acked once we return: the copy must be the broker's before that.
        with confirmed(task.app) as connection:
            sig.apply_async(connection=connection)
    except Exception as exc:
        log.warning(
            "re-send of task=%s task_id=%s not confirmed by the broker (%r); requeueing "
            "this delivery instead",
            task.name,
            task.request.id,
            exc,
        )
        raise Reject(exc, requeue=True) from exc
    raise Ignore()


def ledger_unavailable(
    task: Task,
    exc: LedgerUnavailable,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    settings: LedgerSettings,
) -> NoReturn:
    """Fail closed at claim: the body does not run; re-send it after a backoff that doubles
    with each unreachable claim in a row (``ledger_unavailable_backoff``, up to
    ``ledger_unavailable_backoff_max``).

    Raises:
        Ignore: always (``redeliver``).
    """
    n = int(header(task.request, wire.UNAVAILABLE) or 0)
    countdown = min(settings.unavailable_backoff * (2**n), settings.unavailable_backoff_max)
    log.warning(
        "ledger unavailable at claim task=%s task_id=%s (attempt %s); body not run, "
        "redelivering in %.1fs: %s",
        task.name,
        task.request.id,
        n + 1,
        countdown,
        exc,
    )
    redeliver(
        task,
        args,
        kwargs,
        countdown=countdown,
        headers={wire.UNAVAILABLE: n + 1},
        vouched=False,
    )


def wait_briefly(store: LedgerStore, key: str, settings: LedgerSettings) -> bool:
    """Poll a live lease for up to ``ledger_wait_poll_seconds``; True if it ended."""
    deadline = time.monotonic() + settings.wait_poll_seconds
    while time.monotonic() < deadline:
        time.sleep(WAIT_POLL_INTERVAL)
        try:
            found = store.peek_status(key)
        except LedgerUnavailable:
            return False
        if found is None:
            return True
        status, left = found
        if status is not EntryStatus.RUNNING or left is None or left <= 0:
            return True
    return False

"""The task option ``ledger_rate_limit`` (design.md § "Fleet-wide rate limits").

``ledger_rate_limit="10/s"`` (or ``/m``, ``/h``) limits the task across the fleet: one token
bucket in the ledger, taken at claim (``ledger.rate_limits``). ``"5/m per customer_id"``: one
bucket per value of the argument ``customer_id``. Celery's own ``rate_limit`` stays what it is,
a limit per worker process; the two may be combined.

A claim that finds no token answers HOLD with the seconds until its token is due; the delivery
then sends itself again for that time (``redeliver``: the envelope's re-send, same task id, no
retry spent) and is acked, so no worker slot is held. Past ``ledger_hold_threshold_seconds`` it
is not sent: the entry is ``scheduled`` and the sweep's durable-time pass wakes it, as it wakes
a long countdown (the broker is not asked to hold a message that long).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from typing import Any, NoReturn

from celery.exceptions import Ignore

from celery_ledger.ledger import Claim, RateLimit, TokenAsk, parse_rate_limit
from celery_ledger.redelivery import redeliver
from celery_ledger.settings import LedgerSettings

#: A bucket's name is at most this long (the column's width); a longer one is hashed.
_BUCKET_CHARS = 255


@cache
def _parsed(text: str) -> RateLimit:
    return parse_rate_limit(text)


def check_option(cls: Any) -> None:
    """Validate a task's ``ledger_rate_limit`` when the task is registered.

    Raises:
        ValueError: the limit cannot be parsed, or names an argument the task does not have.
    """
    text = getattr(cls, "ledger_rate_limit", None)
    if text is None:
        return
    try:
        limit = _parsed(text)
    except ValueError as exc:
        raise ValueError(f"task {cls.name}: {exc}") from None
    if limit.argument is not None:
        cls._check_argument_names("ledger_rate_limit", (limit.argument,))


def token_ask(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TokenAsk | None:
    """What this delivery's claim asks of its bucket; None for a task without a limit."""
    text = getattr(task, "ledger_rate_limit", None)
    if text is None:
        return None
    limit = _parsed(text)
    bucket = task.name
    if limit.argument is not None:
        bound = task._signature().bind_partial(*args, **kwargs).arguments
        value = bound.get(limit.argument, kwargs.get(limit.argument))
        shown = json.dumps(value, sort_keys=True, default=str)
        bucket = f"{task.name} {limit.argument}={shown}"
        if len(bucket) > _BUCKET_CHARS:
            digest = hashlib.sha256(shown.encode()).hexdigest()
            bucket = f"{task.name} {limit.argument}=sha256:{digest}"[:_BUCKET_CHARS]
    return TokenAsk(bucket, limit.interval, limit.rate)


def resend_when_due(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    claim: Claim,
    settings: LedgerSettings,
) -> NoReturn:
    """HOLD: held for a token, send this delivery again for the time its token is due, or
    leave it to the sweep when that is further than the broker should hold a message; held
    for anything else (a ``scheduled`` or ``sleeping`` entry), the ledger sends it when due.

    Raises:
        Ignore: always (the copy is the broker's, or the ledger holds the entry).
    """
    if claim.token_due_in is None:
        raise Ignore()
    due_in = max(float(claim.token_due_in or 0.0), 0.0)
    threshold = settings.hold_threshold_seconds
    if threshold and due_in > threshold:
        raise Ignore()
    redeliver(task, args, kwargs, countdown=due_in)

"""A task's envelope (``ledger.envelope``), built on the Celery side and sealed for the ledger.

The envelope is written once per entry, by whichever comes first: the publish intent
(``apply_async``, or ``send_task`` seen through ``after_task_publish``), the hold of a long
countdown, or the claim of a delivery; a retry writes the retry's own. Each builds it here,
from what it has in hand:

| writer | built by | from |
|---|---|---|
| publish intent, held countdown | ``of_publish`` | ``apply_async``'s options |
| intent of a task sent by name | ``of_message`` | the published message's headers |
| claim | ``of_request`` | the delivery's request (Celery's ``as_execution_options``) |
| a retry's settle | ``of_retry`` | the retry's signature |

and recovery sends it again through one function, ``recovery.resend.message``.

Deadlines are not in the envelope: ``deadline_of`` reads them from the same options, and the
store keeps the earliest in the entry's own column (``ledger.admission``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from celery.utils.time import maybe_make_aware

from celery_ledger import runtime
from celery_ledger.codec import encode
from celery_ledger.ledger import Envelope, PayloadError, wire
from celery_ledger.redelivery import header

log = logging.getLogger(__name__)

#: Celery's own message headers (protocol 2) and request fields: never the user's, and set by
#: Celery again on every send.
_CELERY_HEADERS = frozenset(
    (
        "lang",
        "task",
        "id",
        "shadow",
        "eta",
        "expires",
        "group",
        "group_index",
        "retries",
        "timelimit",
        "root_id",
        "parent_id",
        "argsrepr",
        "kwargsrepr",
        "origin",
        "ignore_result",
        "replaced_task_nesting",
        "stamped_headers",
        "stamps",
        "compression",
        "redelivered",
    )
)


def user_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headers the producer itself attached: not Celery's, not the ledger's ``ledger_*``
    (a re-send sets those itself), not the broker's ``x-*`` (RabbitMQ's ``x-death`` would make
    a re-send look like a dead-letter cycle)."""
    if not isinstance(headers, Mapping):
        return {}
    return {
        str(k): v
        for k, v in headers.items()
        if k not in _CELERY_HEADERS
        and not str(k).startswith("ledger_")
        and not str(k).lower().startswith("x-")
    }


def _options(
    *,
    exchange: Any = None,
    routing_key: Any = None,
    priority: Any = None,
    time_limit: Any = None,
    soft_time_limit: Any = None,
    headers: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    found = {
        "exchange": exchange or None,
        "routing_key": routing_key if exchange else None,  # no exchange: the queue routes it
        "priority": priority,
        "time_limit": time_limit,
        "soft_time_limit": soft_time_limit,
        "headers": user_headers(headers) or None,
    }
    return {k: v for k, v in found.items() if v is not None}


def of_publish(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: Mapping[str, Any],
    *,
    canvas: Mapping[str, Any] | None = None,
) -> Envelope:
    """The envelope of ``apply_async(args, kwargs, **options)`` (an intent, a hold)."""
    exchange = options.get("exchange")
    return Envelope(
        args=tuple(args),
        kwargs=dict(kwargs),
        queue=_name(options.get("queue")) or getattr(task, "queue", None),
        ledger_key=(options.get("headers") or {}).get(wire.KEY),
        retries=int(options.get("retries") or 0),
        canvas=dict(canvas or {}),
        options=_options(
            exchange=_name(exchange),
            routing_key=options.get("routing_key"),
            priority=options.get("priority"),
            time_limit=options.get("time_limit"),
            soft_time_limit=options.get("soft_time_limit"),
            headers=options.get("headers"),
        ),
    )


def of_message(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    headers: Mapping[str, Any],
    *,
    routing_key: str | None,
    properties: Mapping[str, Any] | None,
    canvas: Mapping[str, Any] | None = None,
) -> Envelope:
    """The envelope of a published message (protocol 2: its headers and properties), for the
    intent of a task sent by name."""
    hard, soft = _limits(headers.get("timelimit"))
    return Envelope(
        args=tuple(args),
        kwargs=dict(kwargs),
        queue=routing_key,
        ledger_key=headers.get(wire.KEY),
        retries=int(headers.get("retries") or 0),
        canvas=dict(canvas or {}),
        options=_options(
            priority=(properties or {}).get("priority"),
            time_limit=hard,
            soft_time_limit=soft,
            headers=headers,
        ),
    )


def of_request(
    req: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, canvas: Mapping[str, Any]
) -> Envelope:
    """The envelope of a delivery, as Celery's own ``signature_from_request`` rebuilds it."""
    delivery = req.delivery_info or {}
    exchange = delivery.get("exchange") or None
    hard, soft = _limits(getattr(req, "timelimit", None))
    return Envelope(
        args=tuple(args),
        kwargs=dict(kwargs),
        queue=delivery.get("routing_key") or None,
        ledger_key=header(req, wire.KEY),
        retries=int(req.retries or 0),
        canvas=dict(canvas),
        options=_options(
            exchange=exchange,
            routing_key=delivery.get("routing_key"),
            priority=delivery.get("priority"),
            time_limit=hard,
            soft_time_limit=soft,
            headers=req.headers if isinstance(getattr(req, "headers", None), dict) else None,
        ),
    )


def of_retry(req: Any, sig: Any, *, canvas: Mapping[str, Any]) -> Envelope:
    """The envelope of a ``self.retry()``: the retry's own arguments and options (its
    signature, built by Celery from the request) and its retry count."""
    options = dict(sig.options or {})
    found = of_publish(None, tuple(sig.args or ()), dict(sig.kwargs or {}), options, canvas=canvas)
    delivery = req.delivery_info or {}
    return Envelope(
        args=found.args,
        kwargs=found.kwargs,
        queue=found.queue or delivery.get("routing_key"),
        ledger_key=header(req, wire.KEY),
        retries=int(options.get("retries") or (req.retries or 0) + 1),
        canvas=found.canvas,
        options=found.options,
    )


def seal(app: Any, envelope: Envelope, *, keep_canvas_optional: bool = False) -> str:
    """The envelope as the ledger stores it: kombu's JSON within ``ledger_max_snapshot_bytes``,
    sealed with ``ledger_snapshot_keys`` when set.

    ``keep_canvas_optional`` (a publish intent): an envelope too large with its canvas
    placement is stored without it, with a warning: an intent that re-sends the task without
    the rest of its canvas is better than none (a lost message would never be re-sent).

    Raises:
        PayloadNotSerializable: the arguments are not JSON.
        PayloadTooLarge: the envelope exceeds the limit.
    """
    settings = runtime.settings_for(app)
    cipher = runtime.snapshot_cipher(app)

    def sealed(value: Envelope) -> str:
        text = encode(
            value.as_data(),
            limit=settings.max_snapshot_bytes,
            what="argument snapshot",
            setting="ledger_max_snapshot_bytes",
            advice="pass a reference to large data instead of the data",
        )
        return cipher.seal(text) if cipher is not None else text

    try:
        return sealed(envelope)
    except PayloadError as exc:
        if not (keep_canvas_optional and envelope.canvas):
            raise
        log.warning(
            "the envelope of this publish keeps no canvas placement (%s): a re-send from it "
            "would not continue its chain or count in its chord",
            exc,
        )
        return sealed(_without_canvas(envelope))


def _without_canvas(envelope: Envelope) -> Envelope:
    return Envelope(
        args=envelope.args,
        kwargs=envelope.kwargs,
        queue=envelope.queue,
        ledger_key=envelope.ledger_key,
        retries=envelope.retries,
        options=envelope.options,
    )


# -- times a producer gives ----------------------------------------------------------------------


def _in_range(ts: float) -> bool:
    """Whether ``ts`` (seconds since the epoch) is a time Celery and the views can show."""
    try:
        datetime.fromtimestamp(ts, timezone.utc)
    except (OverflowError, ValueError, OSError):
        return False
    return True


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a finite number of seconds")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a finite number of seconds") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{what}={value!r} is not a finite number of seconds")
    return seconds


def relative_seconds(value: Any, what: str) -> float:
    """``value`` as seconds from now (``countdown``, a numeric ``expires``).

    Raises:
        ValueError: not a finite number, or now plus it is past what a date can hold.
    """
    seconds = _number(value, what)
    if not _in_range(time.time() + seconds):
        raise ValueError(f"{what}={value!r} is out of range: not a finite number of seconds")
    return seconds


def absolute_time(value: Any, what: str) -> float:
    """``value`` as seconds since the epoch (the ``ledger_deadline`` header).

    Raises:
        ValueError: not a finite number, or past what a date can hold.
    """
    ts = _number(value, what)
    if not _in_range(ts):
        raise ValueError(f"{what}={value!r} is out of range: not a finite time in seconds")
    return ts


def check_times(options: Mapping[str, Any]) -> None:
    """Refuse the times of an ``apply_async`` that are no finite time (``countdown``,
    ``eta``, ``expires``, the ``ledger_deadline`` header): before anything is recorded or
    published, as Celery refuses them only once the message is being built, in its own words.

    Raises:
        ValueError: in the ledger's words, naming the option.
    """
    countdown = options.get("countdown")
    if countdown is not None:
        relative_seconds(countdown, "countdown")
    for name in ("eta", "expires"):
        value = options.get(name)
        if value is None or isinstance(value, datetime):
            continue
        if isinstance(value, str):
            try:
                datetime.fromisoformat(value)
            except ValueError:
                raise ValueError(
                    f"{name}={value!r} is not a finite time (an ISO 8601 date and time)"
                ) from None
        elif name == "expires":
            relative_seconds(value, name)
    raw = (options.get("headers") or {}).get(wire.DEADLINE)
    if raw is not None:
        absolute_time(raw, wire.DEADLINE)


# -- deadlines ---------------------------------------------------------------------------------


def deadline_of(options: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(absolute, relative) deadline of a publish: an absolute ``expires`` (a datetime or ISO
    text) or ``ledger_deadline`` header keeps the producer's meaning; a numeric ``expires`` is
    relative, and the store makes it absolute on the database clock in the statement that
    stores it (``ledger.admission``), so a producer's skewed clock cannot move it."""
    expires = options.get("expires")
    relative: float | None = None
    found: list[float] = []
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        relative = float(expires)
    elif isinstance(expires, (str, datetime)):
        found.append(_timestamp(expires))
    header_deadline = _header_deadline((options.get("headers") or {}).get(wire.DEADLINE))
    if header_deadline is not None:
        found.append(header_deadline)
    return (min(found) if found else None), relative


def absolute_deadline(expires: Any, header: Any, *, task_id: str | None = None) -> float | None:
    """The earliest of a delivery's ``expires`` (as Celery hands it to the worker: a datetime
    or ISO text; a number counts from now) and its ``ledger_deadline`` header."""
    found: list[float] = []
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        found.append(time.time() + float(expires))
    elif isinstance(expires, (str, datetime)):
        found.append(_timestamp(expires))
    header_deadline = _header_deadline(header, task_id)
    if header_deadline is not None:
        found.append(header_deadline)
    return min(found) if found else None


def _header_deadline(raw: Any, task_id: str | None = None) -> float | None:
    """A ``ledger_deadline`` header as seconds since the epoch; None when absent, or when it
    is no finite time (a producer that bypassed ``check_times``): that header is ignored with
    a warning, and the delivery runs without that deadline (its ``expires`` still counts)."""
    if raw is None:
        return None
    try:
        return absolute_time(raw, wire.DEADLINE)
    except ValueError as exc:
        log.warning("task_id=%s: %s; the header is ignored: no deadline from it", task_id, exc)
        return None


def _timestamp(value: str | datetime) -> float:
    when = datetime.fromisoformat(value) if isinstance(value, str) else value
    return float(maybe_make_aware(when).timestamp())


def _limits(timelimit: Any) -> tuple[Any, Any]:
    if isinstance(timelimit, (list, tuple)) and len(timelimit) >= 2:
        return timelimit[0], timelimit[1]
    return None, None


def _name(value: Any) -> str | None:
    """A queue or exchange option as its name (kombu ``Queue``/``Exchange`` objects too)."""
    if value is None or isinstance(value, str):
        return value or None
    return getattr(value, "name", None) or None

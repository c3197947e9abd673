"""A step's children: ``self.send(sig)`` inside a step, recorded with its ``completed`` row.

The step does not publish what it sends. ``Sends`` collects the signatures during the step
run, each with its deterministic child id (``ledger.child_task_id``: parent key, step,
occurrence, n-th send); the attempt records them in the same write as the step's completed
row (``store.complete_step`` / ``complete_on``) and publishes them after that commit
(``recovery.outbox.publish``). What survives a crash anywhere is in
``celery_ledger.ledger.outbox``.

What a child keeps of its signature: task name, args, kwargs, and the routing options
(``queue``, ``routing_key``, ``exchange``, ``priority``, ``headers``, ``countdown``,
``expires``, ``time_limit``, ``soft_time_limit``). ``countdown`` counts from the publish, which
the sweep may make later than the step. A ``task_id`` of its own, ``link``/``link_error`` and
an absolute ``eta`` are refused: the child id is the outbox's, and callbacks would be
published outside it.

Everything the broker publish would refuse is refused here, when the child is recorded, with
the checks ``apply_async`` makes (``envelope.check_times``, ``codec.check_depth``) and the
types of the routing options: a recorded child that no publish can send would stay pending
for good. A refusal is the step's programming error, the same on every run
(``Attempt.send`` raises it as ``StepUsageError``).
"""

from __future__ import annotations

from typing import Any

from kombu.utils.json import dumps, loads

from celery_ledger.codec import check_depth, encode
from celery_ledger.envelope import check_times
from celery_ledger.ledger import (
    Child,
    OutboxMessage,
    SnapshotCipher,
    child_task_id,
    is_sealed,
    open_snapshot,
)

#: Signature options a recorded child keeps (anything else is refused, not dropped silently).
KEPT_OPTIONS = frozenset(
    {
        "queue",
        "routing_key",
        "exchange",
        "priority",
        "headers",
        "countdown",
        "expires",
        "time_limit",
        "soft_time_limit",
    }
)
#: Options that name a queue, a routing key or an exchange: text.
_NAMES = ("queue", "routing_key", "exchange")
#: Options that are a number of seconds (``countdown`` and ``expires`` are ``check_times``').
_LIMITS = ("time_limit", "soft_time_limit")


def check_options(name: str, options: dict[str, Any]) -> None:
    """Refuse the options of a child that no publish could send.

    Raises:
        TypeError: an option the outbox does not keep, or one of the wrong type.
        ValueError: a time that is no finite number (``check_times``), a priority out of range.
    """
    refused = sorted(set(options) - KEPT_OPTIONS)
    if refused:
        raise TypeError(
            f"send({name}): the outbox cannot keep the option(s) {refused}; the child's "
            "task id is derived from the step, and callbacks are not recorded"
        )
    try:
        check_times(options)
    except ValueError as exc:
        raise ValueError(f"send({name}): {exc}") from None
    for option in _NAMES:
        value = options.get(option)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"send({name}): {option}={value!r} is not a name (text)")
    priority = options.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        raise ValueError(f"send({name}): priority={priority!r} is not a whole number 0-255")
    for option in _LIMITS:
        value = options.get(option)
        if value is not None:
            _seconds(name, option, value)
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, dict):
        raise TypeError(f"send({name}): headers={headers!r} is not a mapping")


def _seconds(name: str, option: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ValueError(f"send({name}): {option}={value!r} is not a positive number of seconds")


class Sends:
    """The children one step run sends, in order."""

    def __init__(self, parent_key: str, step: str, occurrence: int) -> None:
        self.parent_key = parent_key
        self.step = step
        self.occurrence = occurrence
        self.children: list[Child] = []

    def add(self, sig: Any, *, limit: int, cipher: SnapshotCipher | None = None) -> str:
        """Record ``sig`` as the next child; returns its task id.

        With ``cipher`` (``ledger_snapshot_keys``) the payload is sealed like an argument
        snapshot: a child's arguments are arguments too.

        Raises:
            TypeError: ``sig`` is not a task signature, or has an option the outbox cannot
                keep or of the wrong type.
            ValueError: an option no publish could send (``check_options``).
            PayloadError: its arguments cannot be stored, or nest deeper than a worker can
                decode (``check_depth``).
        """
        name = getattr(sig, "task", None)
        if not isinstance(name, str) or not hasattr(sig, "args"):
            raise TypeError(
                f"send() takes a task signature (task.s(...) / task.si(...)), not {sig!r}"
            )
        options = dict(sig.options or {})
        check_options(name, options)
        args, kwargs = list(sig.args or ()), dict(sig.kwargs or {})
        check_depth([args, kwargs], what=f"arguments of child {name} sent by step {self.step!r}")
        n = len(self.children)
        child_id = child_task_id(self.parent_key, self.step, self.occurrence, n)
        payload = encode(
            {"args": args, "kwargs": kwargs, "options": options},
            limit=limit,
            what=f"child {name} sent by step {self.step!r}",
            setting="ledger_max_snapshot_bytes",
            advice="send a reference to the data instead",
        )
        if cipher is not None:
            payload = cipher.seal(payload)
        self.children.append(Child(child_id, name, payload, n))
        return child_id


def repaired_payload(
    child: OutboxMessage, cleared: tuple[str, ...], cipher: SnapshotCipher | None
) -> str:
    """An operator's repair (``celery-ledger outbox repair``, the Ledger page): ``child``'s
    payload without the ``cleared`` options, sealed again as it was.

    Raises:
        ValueError: an option a child does not keep, a sealed payload without ``cipher``, or
            what is left is still no publishable child (``check_options``).
    """
    unknown = sorted(set(cleared) - KEPT_OPTIONS)
    if unknown or not cleared:
        raise ValueError(
            f"clear one or more of the options a child keeps ({', '.join(sorted(KEPT_OPTIONS))})"
            + (f", not {', '.join(unknown)}" if unknown else "")
        )
    sealed = is_sealed(child.payload)
    if sealed and cipher is None:
        raise ValueError(
            "the child's payload is sealed, and no ledger_snapshot_keys are set here to open it"
        )
    data = loads(open_snapshot(child.payload, cipher))
    options = {k: v for k, v in dict(data.get("options") or {}).items() if k not in cleared}
    try:
        check_options(child.task_name, options)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"still not publishable after clearing {', '.join(cleared)}: {exc}"
        ) from None
    text = dumps({**data, "options": options})
    return cipher.seal(text) if sealed and cipher is not None else text

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
"""

from __future__ import annotations

from typing import Any

from celery_ledger.codec import encode
from celery_ledger.ledger import Child, SnapshotCipher, child_task_id

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
                keep.
            PayloadError: its arguments cannot be stored.
        """
        name = getattr(sig, "task", None)
        if not isinstance(name, str) or not hasattr(sig, "args"):
            raise TypeError(
                f"send() takes a task signature (task.s(...) / task.si(...)), not {sig!r}"
            )
        options = dict(sig.options or {})
        refused = sorted(set(options) - KEPT_OPTIONS)
        if refused:
            raise TypeError(
                f"send({name}): the outbox cannot keep the option(s) {refused}; the child's "
                "task id is derived from the step, and callbacks are not recorded"
            )
        n = len(self.children)
        child_id = child_task_id(self.parent_key, self.step, self.occurrence, n)
        payload = encode(
            {"args": list(sig.args or ()), "kwargs": dict(sig.kwargs or {}), "options": options},
            limit=limit,
            what=f"child {name} sent by step {self.step!r}",
            setting="ledger_max_snapshot_bytes",
            advice="send a reference to the data instead",
        )
        if cipher is not None:
            payload = cipher.seal(payload)
        self.children.append(Child(child_id, name, payload, n))
        return child_id

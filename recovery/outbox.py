"""Publishing the outbox: children recorded by steps go to the broker, then are marked.

Who publishes: the attempt whose step recorded the children, right after the step's row
committed (``publish``); and the sweep, for every child still unpublished past a grace
(``sweep_outbox``): the attempt died between its commit and its publish, or the broker was
down then.

Why a child is marked only after the broker confirmed it (``recovery.publish.confirmed``): a
mark for a message the broker never took would lose the child for good. The other order can
only publish a child twice (a crash between the publish and the mark), and a second message
with the same deterministic task id is deduplicated by the child's own claim (a ledgered
child: RETURN once it settled, WAIT while it runs).

Why a failed publish is not an error of the step: the child is durably recorded, and the sweep
owes it. The step's own result stands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kombu.utils.json import loads

from celery_ledger.ledger import (
    LedgerStore,
    LedgerUnavailable,
    OutboxMessage,
    SnapshotCipher,
    open_snapshot,
)
from celery_ledger.ledger.envelope import OPTIONS, Envelope
from celery_ledger.recovery import resend
from celery_ledger.recovery.publish import confirmed

log = logging.getLogger(__name__)

#: The header a child carries naming the entry key of the task whose step sent it.
PARENT_HEADER = "ledger_parent"


def send_child(
    app: Any,
    message: OutboxMessage,
    *,
    connection: Any = None,
    cipher: SnapshotCipher | None = None,
) -> None:
    """Publish one recorded child with its deterministic task id (not confirmed by itself:
    pass a ``confirmed`` connection).

    Raises:
        SnapshotSealError: its payload is sealed and ``cipher`` cannot open it.
    """
    payload = loads(open_snapshot(message.payload, cipher))
    options = dict(payload.get("options") or {})
    queue = options.pop("queue", None)
    child = Envelope(
        args=tuple(payload.get("args") or ()),
        kwargs=dict(payload.get("kwargs") or {}),
        queue=queue if isinstance(queue, str) else None,
        options={k: options.pop(k) for k in OPTIONS if k in options},
    )
    # The one message builder (``resend.message``); what is left of the options is the
    # child's own timing (``countdown``, ``expires``), as the step gave it.
    sent = resend.message(
        message.child_id,
        child,
        extra_headers={PARENT_HEADER: message.parent_key},
        redelivery=False,
    )
    app.send_task(message.task_name, connection=connection, **{**options, **sent})


def publish(
    store: LedgerStore,
    app: Any,
    messages: Sequence[OutboxMessage],
    *,
    after_send: Callable[[], None] | None = None,
    cipher: SnapshotCipher | None = None,
) -> list[str]:
    """Publish ``messages`` (each confirmed by the broker), then mark the ones that went out.

    Stops at the first publish the broker refuses: the rest stay recorded for the sweep.
    Returns the child ids published. Never raises for the broker or the ledger: a child that
    was not published or not marked is published again by the sweep (and deduplicated by its
    claim if it went out after all). ``after_send`` runs once every message went out,
    before the mark (a crash point's place).
    """
    sent: list[str] = []
    try:
        with confirmed(app) as connection:
            for message in messages:
                send_child(app, message, connection=connection, cipher=cipher)
                sent.append(message.child_id)
        if after_send is not None:
            after_send()
    except Exception as exc:  # noqa: BLE001 - the broker is down: the sweep publishes the rest
        log.warning(
            "outbox: %d of %d children published, the rest wait for the sweep (%s)",
            len(sent),
            len(messages),
            exc,
        )
    if sent:
        try:
            store.mark_published(sent)
        except LedgerUnavailable as exc:
            log.warning(
                "outbox: %d children published but not marked (%s); the sweep publishes "
                "them again and their claims deduplicate",
                len(sent),
                exc,
            )
    return sent


def sweep_outbox(
    store: LedgerStore,
    app: Any,
    *,
    batch: int = 500,
    grace_seconds: float = 5.0,
    cipher: SnapshotCipher | None = None,
) -> tuple[int, int]:
    """Publish up to ``batch`` children unpublished for ``grace_seconds``; returns (found,
    published).

    Raises:
        LedgerUnavailable: the ledger cannot be read (the next sweep tries again).
    """
    pending = store.unpublished(limit=batch, older_than=grace_seconds)
    if not pending:
        return 0, 0
    published = publish(store, app, pending, cipher=cipher)
    log.info(
        "ledger sweep: outbox published %d of %d pending children", len(published), len(pending)
    )
    return len(pending), len(published)

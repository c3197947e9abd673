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

Why one child's failure never stops the others: a publish fails either for the broker (down,
unreachable, refusing: every later publish would fail too, so the batch stops and the sweep
tries again) or for the child itself (an option Celery cannot build a message from, a payload
the cipher cannot open: it would fail every time). The second kind is the child's alone: it is
noted on its row (``note_publish_failures``), counted in the sweep's ``outbox_failed`` and
``errors``, listed behind every good child from then on, and the batch goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from amqp.exceptions import MessageNacked
from kombu.exceptions import OperationalError
from kombu.utils.json import loads

from celery_ledger.ledger import (
    LedgerUnavailable,
    OutboxMessage,
    SnapshotCipher,
    open_snapshot,
    wire,
)
from celery_ledger.ledger.envelope import OPTIONS, Envelope
from celery_ledger.recovery import resend
from celery_ledger.recovery.ports import OutboxPublishing, Publisher
from celery_ledger.recovery.publish import confirmed

log = logging.getLogger(__name__)

#: The header a child carries naming the entry key of the task whose step sent it (its name is
#: ``wire.PARENT``; exported under this name too).
PARENT_HEADER = wire.PARENT


class Unpublishable(ValueError):
    """Raised when Celery cannot build a child's message from what the outbox recorded: the
    same on every publish, so it is the child's own failure, never the broker's."""


@dataclass(frozen=True)
class Published:
    """What one ``publish`` did: the child ids the broker took, and those that failed for a
    fault of their own (noted on their rows)."""

    sent: list[str]
    failed: list[str]


def send_child(
    app: Publisher,
    message: OutboxMessage,
    *,
    connection: Any = None,
    cipher: SnapshotCipher | None = None,
) -> None:
    """Publish one recorded child with its deterministic task id (not confirmed by itself:
    pass a ``confirmed`` connection).

    Raises:
        SnapshotSealError: its payload is sealed and ``cipher`` cannot open it.
        Unpublishable: Celery cannot build a message from the child's options.
        Exception: the broker's failure (``broker_failure``), as the publish raised it.
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
        extra_headers={wire.PARENT: message.parent_key},
        redelivery=False,
    )
    try:
        app.send_task(message.task_name, connection=connection, **{**options, **sent})
    except Exception as exc:
        if broker_failure(app, exc):
            raise
        # Celery's words ("cannot convert float NaN to integer") name no option: say which
        # of the child's own options it was given (its headers are the user's: not shown).
        given = {k: v for k, v in payload.get("options", {}).items() if k != "headers"}
        raise Unpublishable(
            f"{message.task_name} cannot be published with the options {given!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def broker_failure(app: Publisher, exc: BaseException) -> bool:
    """Whether a failed publish is the broker's (down, unreachable, refusing), so that every
    later publish would fail too, rather than the message's own."""
    # A nack (AMQP confirms) is the broker refusing publishes (a full queue that rejects
    # them), not one message's fault; it is in no transport's error tuples.
    if isinstance(exc, (OperationalError, ConnectionError, TimeoutError, MessageNacked)):
        return True
    try:
        conn = app.connection_for_write()
        try:
            errors = tuple(conn.connection_errors) + tuple(conn.channel_errors)
        finally:
            conn.release()
    except Exception:  # noqa: BLE001 - no transport to ask: count it as the broker's
        return True
    return isinstance(exc, errors)


def publish(
    store: OutboxPublishing,
    app: Publisher,
    messages: Sequence[OutboxMessage],
    *,
    after_send: Callable[[], None] | None = None,
    cipher: SnapshotCipher | None = None,
) -> Published:
    """Publish ``messages`` (each confirmed by the broker), then mark the ones that went out.

    Stops at the first publish the broker refuses (``broker_failure``): the rest stay recorded
    for the sweep. A child that fails for a fault of its own is noted on its row
    (``note_publish_failures``) and the others go on. Never raises for the broker or the
    ledger: a child that was not published or not marked is published again by the sweep
    (and deduplicated by its claim if it went out after all). ``after_send`` runs once every
    message was tried, before the mark (a crash point's place).
    """
    sent: list[str] = []
    failed: list[tuple[str, str]] = []
    try:
        with confirmed(app) as connection:
            for message in messages:
                try:
                    send_child(app, message, connection=connection, cipher=cipher)
                except Exception as exc:
                    if broker_failure(app, exc):
                        raise
                    failed.append((message.child_id, f"{type(exc).__name__}: {exc}"))
                    log.warning(
                        "outbox: child %s (%s) of key=%s step=%s cannot be published (%s: "
                        "%s); the others go on; drop or repair it: celery-ledger outbox",
                        message.child_id,
                        message.task_name,
                        message.parent_key,
                        message.step,
                        type(exc).__name__,
                        exc,
                    )
                    continue
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
    if failed:
        try:
            store.note_publish_failures(failed)
        except LedgerUnavailable as exc:
            log.warning("outbox: %d failed publishes not noted (%s)", len(failed), exc)
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
    return Published(sent, [child_id for child_id, _ in failed])


def sweep_outbox(
    store: OutboxPublishing,
    app: Publisher,
    *,
    batch: int = 500,
    grace_seconds: float = 5.0,
    cipher: SnapshotCipher | None = None,
) -> tuple[int, int, int]:
    """Publish up to ``batch`` children unpublished for ``grace_seconds``; returns (found,
    published, failed): the failed are children that could not be published for a fault of
    their own (``publish``).

    Raises:
        LedgerUnavailable: the ledger cannot be read (the next sweep tries again).
    """
    pending = store.unpublished(limit=batch, older_than=grace_seconds)
    if not pending:
        return 0, 0, 0
    done = publish(store, app, pending, cipher=cipher)
    log.info(
        "ledger sweep: outbox published %d of %d pending children (%d failed)",
        len(done.sent),
        len(pending),
        len(done.failed),
    )
    return len(pending), len(done.sent), len(done.failed)

"""Publish intents: a ledgered task is recorded in the ledger when it is published.

On a broker that forgets a message once a worker has fetched it (``filesystem://``), a worker
killed between that fetch and its claim takes the message with it. An intent is the claim's own
insert made at publish time, with no execution and a lease of ``ledger_publish_intent_seconds``:
the first claim RUNs it, and if no claim comes, the lease expires and the sweep re-sends the
task like any interrupted entry (``LedgerStore.record_intent``).

Two ways in, one record (``record``):

- ``LedgerTask.apply_async`` (``delay``, signatures, canvas): the task knows its app;
- ``app.send_task("name")``: Celery's ``before_task_publish`` signal
  (``celery_ledger.app.on_before_task_publish``), for a name that the publishing ledger app
  has registered as a ``LedgerTask``.

A task sent by a name that no ledger app of the publishing process knows has no intent: only its
class knows its key and side-effect class.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery_ledger import runtime
from celery_ledger.codec import encode_snapshot
from celery_ledger.ledger import ClaimRequest

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)


class PublishedTask(Protocol):
    """What recording an intent reads from a ``LedgerTask``."""

    name: str
    side_effect: str

    @property
    def app(self) -> Celery: ...

    def ledger_key(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], task_id: str, header_key: Any = None
    ) -> tuple[str, str]: ...


#: Task id whose intent ``LedgerTask.apply_async`` recorded while it publishes, so the signal
#: that the same publish sends does not record it again.
_recorded: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ledger_intent", default=None
)


def wanted(task: PublishedTask, headers: dict[str, Any] | None) -> bool:
    """Whether publishing ``task`` now should record an intent."""
    if (headers or {}).get("ledger_redelivery"):  # the ledger's own re-send: the entry exists
        return False
    app = task.app
    return not app.conf.task_always_eager and runtime.publish_intent_enabled(app)


def record(
    task: PublishedTask,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task_id: str,
    *,
    ledger_key: str | None,
    queue: str | None,
) -> None:
    """Record ``task``'s intent; never raises (an intent must not stop a publish: without one
    the task is still claimed, or redelivered, as usual)."""
    try:
        key, args_hash = task.ledger_key(args, kwargs, task_id, ledger_key)
        settings = runtime.settings_for(task.app)
        snapshot = encode_snapshot(
            args,
            kwargs,
            queue=queue or getattr(task, "queue", None),
            ledger_key=ledger_key,
            limit=settings.max_snapshot_bytes,
        )
        runtime.store_for(task.app).record_intent(
            ClaimRequest(
                key=key,
                task_name=task.name,
                task_id=task_id,
                args_hash=args_hash,
                snapshot=snapshot,
                side_effect=task.side_effect,
                owner=runtime.owner_for(None),
                lease_seconds=settings.publish_intent_seconds,
                max_interruptions=settings.max_resumes,
            )
        )
    except Exception as exc:  # noqa: BLE001 - an intent must never stop a publish
        log.warning("no publish intent for %s[%s]: %s", task.name, task_id, exc)


class recorded_by_apply_async:  # noqa: N801 - reads as a with-statement clause
    """Marks ``task_id`` as recorded for the duration of its publish."""

    def __init__(self, task_id: str) -> None:
        self._task_id = task_id
        self._token: contextvars.Token[str | None] | None = None

    def __enter__(self) -> None:
        self._token = _recorded.set(self._task_id)

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _recorded.reset(self._token)


def recorded_by_this_publish(task_id: str) -> bool:
    """Whether ``LedgerTask.apply_async`` recorded ``task_id``'s intent for the publish now
    under way (the ``before_task_publish`` signal of that publish then records none)."""
    return _recorded.get() == task_id

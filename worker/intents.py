"""Publish intents: a ledgered task is recorded in the ledger when it is published.

On a broker that forgets a message once a worker has fetched it (``filesystem://``), a worker
killed between that fetch and its claim takes the message with it. An intent is the claim's own
insert made at publish time, with no execution and a lease of ``ledger_publish_intent_seconds``:
the first claim RUNs it, and if no claim comes, the lease expires and the sweep re-sends the
task like any interrupted entry (``LedgerStore.record_intent``).

Two ways in, one record (``record``):

- ``LedgerTask.apply_async`` (``delay``, signatures, canvas): the task knows its app. The intent
  is recorded *before* the publish, so that a fresh publish whose key the ledger holds with
  other arguments is refused (``KeyConflict``) before anything is sent; if the publish then
  raises, the intent is withdrawn in the same call (``withdraw``), or the sweep would send the
  task that the caller saw fail;
- ``app.send_task("name")``: Celery's ``after_task_publish`` signal
  (``celery_ledger.app.on_task_published``), for a name that the publishing ledger app has
  registered as a ``LedgerTask``. Celery offers no hook around that publish (Celery's signal
  dispatch swallows what a ``before_task_publish`` receiver raises, and no signal is sent when
  the publish raises), so this intent is recorded once the broker took the message: a failed
  publish records nothing. A worker that claims first makes the late insert a no-op.

A task sent by a name that no ledger app of the publishing process knows has no intent: only its
class knows its key and side-effect class.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery_ledger import canvas, envelope, runtime
from celery_ledger.codec import check_depth
from celery_ledger.ledger import NO_ARGS_HASH, ClaimRequest, Envelope, KeyConflict, wire

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
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        task_id: str,
        header_key: Any = None,
        replacement: int = 0,
    ) -> tuple[str, str]: ...

    def keyed_by_task_id(self, header_key: Any = None) -> bool: ...


#: Task id whose intent ``LedgerTask.apply_async`` recorded while it publishes, so the signal
#: that the same publish sends does not record it again.
_recorded: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ledger_intent", default=None
)


def wanted(task: PublishedTask, headers: dict[str, Any] | None) -> bool:
    """Whether publishing ``task`` now should record an intent."""
    headers = headers or {}
    if headers.get(wire.REDELIVERY) or headers.get(wire.UNAVAILABLE):
        return False  # a worker's or the sweep's own re-send: the entry exists or will
    app = task.app
    return not app.conf.task_always_eager and runtime.publish_intent_enabled(app)


def record(
    task: PublishedTask,
    sent: Envelope,
    task_id: str,
    *,
    deadline: tuple[float | None, float | None] = (None, None),
    check_conflict: bool = False,
) -> str | None:
    """Record ``task``'s intent with its envelope ``sent`` (``celery_ledger.envelope``: the
    arguments, routing, the user's headers, limits and canvas placement, so that if the
    message is lost before any claim, the sweep's re-send is the message the producer sent)
    and its ``deadline`` (absolute, relative to now on the database clock: ``deadline_of``).
    Returns its entry key when this call recorded it (None when the key has an entry already,
    or the intent could not be recorded).

    An intent must not stop a publish (without one the task is still claimed, or redelivered,
    as usual): any failure to record it is logged, never raised, with one exception.

    Raises:
        KeyConflict: ``check_conflict`` (a fresh publish) and the key's entry holds other
            arguments: the claim would refuse the message, so it is better not sent.
    """
    args, kwargs = tuple(sent.args), dict(sent.kwargs)
    try:
        check_depth([args, kwargs], what=f"arguments of {task.name}")
        key, args_hash = task.ledger_key(
            args, kwargs, task_id, sent.ledger_key, canvas.replacement(sent.canvas)
        )
        settings = runtime.settings_for(task.app)
        snapshot = envelope.seal(task.app, sent, keep_canvas_optional=True)
        store = runtime.store_for(task.app)
        if store.record_intent(
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
                deadline_at=deadline[0],
                deadline_after=deadline[1],
            )
        ):
            return key
        existing = store.args_hash_of(key) if check_conflict else None
    except Exception as exc:  # noqa: BLE001 - an intent must never stop a publish
        log.warning("no publish intent for %s[%s]: %s", task.name, task_id, exc)
        return None
    if existing is not None and existing not in (args_hash, NO_ARGS_HASH):
        what = "task id" if task.keyed_by_task_id(sent.ledger_key) else f"business key {key}"
        raise KeyConflict(
            f"{task.name}[{task_id}]: {what} is recorded in the ledger with different "
            "arguments; nothing was published (use a different key, or the same arguments)"
        )
    return None


def withdraw(task: PublishedTask, key: str, task_id: str, exc: BaseException) -> None:
    """Withdraw the intent ``record`` made for a publish that raised ``exc``; never raises
    (the caller re-raises ``exc``). If the ledger cannot be reached, the intent stays and the
    sweep sends the task once its lease expires: the publish the caller saw fail then happens
    after all (logged)."""
    why = f"publish failed: {type(exc).__name__}: {exc}"[:500]
    try:
        gone = runtime.store_for(task.app).withdraw_intent(
            key, task_id, actor=runtime.owner_for(None).node, why=why
        )
    except Exception as err:  # noqa: BLE001 - the publish error is the one to report
        log.error(
            "publish of %s[%s] failed and its intent could not be withdrawn (%s): the sweep "
            "will send it once the intent's lease expires",
            task.name,
            task_id,
            err,
        )
        return
    if not gone:
        log.warning(
            "publish of %s[%s] failed; its intent key=%s was already claimed or resent",
            task.name,
            task_id,
            key,
        )


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
    under way (the ``after_task_publish`` signal of that publish then records none)."""
    return _recorded.get() == task_id

"""Publish intents: a ledgered task is recorded in the ledger when it is published.

On a broker that forgets a message once a worker has fetched it (``filesystem://``), a worker
killed between that fetch and its claim takes the message with it. An intent is the claim's own
insert made at publish time, with no execution and a lease of ``ledger_publish_intent_seconds``:
the first claim RUNs it, and if no claim comes, the lease expires and the sweep re-sends the
task like any interrupted entry (``LedgerStore.record_intent``).

Two ways in, one record:

- ``LedgerTask.apply_async`` (``delay``, signatures, canvas): the task knows its app;
- ``app.send_task("name")``: Celery's ``before_task_publish`` signal, for a name that the
  publishing ledger app has registered as a ``LedgerTask``. The signal does not say which app
  is publishing: it is the process's only ledger app, else the current app (the one created or
  ``set_current()`` last), else the one finalized app that registers the name.

A task sent by a name that no ledger app of the publishing process knows has no intent: only its
class knows its key and side-effect class.
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from typing import TYPE_CHECKING, Any

from celery_ledger import runtime
from celery_ledger.codec import encode
from celery_ledger.ledger import ClaimRequest

if TYPE_CHECKING:
    from celery import Celery

    from celery_ledger.task import LedgerTask

log = logging.getLogger(__name__)

#: Snapshots larger than this are refused at publish (the claim enforces the same bound).
SNAPSHOT_LIMIT = 16 * 1024 * 1024

#: Ledger apps of this process (``celery_ledger.app.install``), for the signal to find a
#: task's class.
ledger_apps: weakref.WeakSet[Celery] = weakref.WeakSet()

#: Task id whose intent ``LedgerTask.apply_async`` recorded while it publishes, so the signal
#: that the same publish sends does not record it again.
_recorded: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ledger_intent", default=None
)


def wanted(task: LedgerTask, headers: dict[str, Any] | None) -> bool:
    """Whether publishing ``task`` now should record an intent."""
    if (headers or {}).get("ledger_redelivery"):  # the ledger's own re-send: the entry exists
        return False
    app = task.app
    return not app.conf.task_always_eager and runtime.publish_intent_enabled(app)


def record(
    task: LedgerTask,
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
        snapshot = encode(
            {
                "args": list(args),
                "kwargs": kwargs,
                "queue": queue or getattr(task, "queue", None),
                "ledger_key": ledger_key,
            },
            limit=SNAPSHOT_LIMIT,
            what="argument snapshot",
        )
        settings = runtime.settings_for(task.app)
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


def on_before_task_publish(
    sender: str | None = None,
    body: Any = None,
    headers: dict[str, Any] | None = None,
    routing_key: str | None = None,
    **_: Any,
) -> None:
    """``before_task_publish``: the intent of a ledgered task sent by name."""
    headers = headers or {}
    task_id = headers.get("id")
    if not sender or not task_id or _recorded.get() == task_id:
        return
    # Message protocol 2 (Celery's default since 4.0): body = (args, kwargs, embed).
    if not isinstance(body, (tuple, list)) or len(body) < 2:
        return
    task = _ledger_task(sender)
    if task is None or not wanted(task, headers):
        return
    record(
        task,
        tuple(body[0] or ()),
        dict(body[1] or {}),
        task_id,
        ledger_key=headers.get("ledger_key"),
        queue=routing_key,
    )


def _ledger_task(name: str) -> LedgerTask | None:
    """The ``LedgerTask`` that the publishing app registers under ``name``, if any."""
    from celery_ledger.task import LedgerTask

    found = []
    for app in _publishing_apps():
        try:
            tasks = app.tasks  # finalizes the app, as its own first use of tasks would
        except RuntimeError:  # autofinalize=False and not finalized yet
            continue
        task = tasks.get(name)
        if isinstance(task, LedgerTask):
            found.append(task)
    if len(found) > 1:
        log.debug("no publish intent for %s: %d ledger apps register it", name, len(found))
    return found[0] if len(found) == 1 else None


def _publishing_apps() -> list[Celery]:
    """The ledger apps that may be publishing: the only one, or the current one, or (several,
    none current) those already finalized. Another app is never finalized here: that would
    bind other apps' shared tasks to it as a side effect of a publish."""
    from celery import current_app

    apps = list(ledger_apps)
    if len(apps) <= 1:
        return apps
    current = current_app._get_current_object()
    if any(app is current for app in apps):
        return [current]
    return [app for app in apps if app.finalized]

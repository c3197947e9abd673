"""The Task.Request of ledgered tasks: it runs in the worker's parent process.

Three jobs. **Received, not started**: the parent holds the publish intent of every ledgered
message it has received until a pool process accepts it (``celery_ledger.receipts``), so a
worker killed while messages wait in its prefetch or its timer leaves intents that expire
within the lease, not a queue backlog's bound. A message whose producer recorded no intent
(sent by name from a process without the ``LedgerTask`` class) gets one here, from the
message as received (``_record_intent``), when the receipts thread finds nothing to hold.

**The worker-lost fast path**: when a pool process dies (SIGKILL, OOM killer), billiard
reports ``WorkerLostError`` for the request it was running to the parent, which calls
``Request.on_failure`` here. The parent knows the node, this boot and the dead child's pid,
but not the fence the child claimed with; so the entry is interrupted fenced on that exact
owner (``interrupt_owner``). It never waits for the lease: the child is provably gone.

**Discarded by Celery**: a message whose ``expires`` passed, or that was revoked (by id or by a
stamped header), is acked and never run; its entry is ended here (``timing.discarded``), so
that no sweep sends it again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.exceptions import InvalidTaskError
from celery.utils.saferepr import saferepr
from celery.worker.request import Request

from celery_ledger import canvas, envelope, intents, refusal, runtime, timing
from celery_ledger.ledger import MalformedMessage, wire
from celery_ledger.receipts import receipts
from celery_ledger.redact import redact_arguments, secret_names

log = logging.getLogger(__name__)

#: What Celery's ``Request`` adds to the message's headers in ``_request_dict``: not headers.
_NOT_HEADERS = frozenset(
    ("properties", "reply_to", "correlation_id", "hostname", "delivery_info", "args", "kwargs")
)


class LedgerRequest(Request):
    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(message, *args, **kwargs)
            wrong = refusal.malformed_fields(self._request_dict, self._body_of(message))
        except InvalidTaskError as exc:  # Celery's own words (an eta that is no time ...)
            wrong = refusal.one_line(str(exc), 200)
        except Exception as exc:  # noqa: BLE001 - a malformed field must not end the worker
            wrong = f"Celery could not read it ({type(exc).__name__})"
        if wrong is not None:
            self._refuse_message(message, kwargs.get("task"), wrong)
        self._held_key: str | None = None
        self._redact_reprs()
        self._hold()

    def _body_of(self, message: Any) -> Any:
        return self._body if self._decoded else message.payload

    @staticmethod
    def _refuse_message(message: Any, task: Any, wrong: str) -> None:
        """Refuse a message whose fields are malformed (guarantees.md § "Bad input"): its own entry
        settles
        ``failed`` with the reason, its result is that failure, and Celery's handling of an
        invalid task message acks it. Raises ``InvalidTaskError``."""
        headers = message.headers if isinstance(message.headers, dict) else {}
        task_id = str(headers.get("id", ""))
        name = getattr(task, "name", None) or str(headers.get("task", "?"))
        refused = MalformedMessage(f"{name}: the message is malformed ({wrong}); nothing ran")
        if task is not None and task_id:
            store = runtime.store_for(task.app)
            refusal.record(task, store, task_id, refused, actor="worker")
            try:
                task.backend.mark_as_failure(task_id, refused, traceback=None, call_errbacks=False)
            except Exception as err:  # noqa: BLE001 - the result is the caller's, the refusal ours
                log.warning("refused task_id=%s: its result not stored: %s", task_id, err)
        raise InvalidTaskError(str(refused))

    def _redact_reprs(self) -> None:
        """Hide secret argument values (``secret_args``, ``ledger_redact``) in the argument
        reprs the worker puts in its ``task-received`` event and log lines (Flower shows
        them). The sender wrote them (``argsrepr``/``kwargsrepr`` headers); this worker
        knows the task, so it rewrites them from the arguments, whoever sent the message."""
        task = self.task
        try:
            names = secret_names(runtime.settings_for(task.app).redact, task)
            if not names:
                return
            args, kwargs, _ = redact_arguments(
                list(self.args or ()), dict(self.kwargs or {}), names=names, task=task
            )
        except Exception as err:  # noqa: BLE001 - fail closed: show no argument at all
            log.debug("argument reprs of task_id=%s hidden whole: %r", self.id, err)
            self._argsrepr, self._kwargsrepr = "(...)", "{...}"
            return
        self._argsrepr = saferepr(tuple(args))
        self._kwargsrepr = saferepr(kwargs)

    def _hold(self) -> None:
        task = self.task
        try:
            if not runtime.publish_intent_enabled(task.app):
                return
            key = task.entry_key_of(
                self.args,
                self.kwargs,
                self.id,
                self._request_dict.get(wire.KEY),
                canvas.replacement(self),
            )
            settings = runtime.settings_for(task.app)
            lease = float(getattr(task, "lease_seconds", None) or settings.lease_seconds)
        except Exception as err:  # noqa: BLE001 - key_from is user code, run in the parent
            # The claim will say what is wrong with it; a receipt never stops a delivery.
            log.debug("no receipt hold for task_id=%s: %r", self.id, err)
            return
        self._held_key = key
        # Nothing more per message than a bound method in the hold: the intent a producer did
        # not record is recorded by the receipts thread, only for a key that waited
        # HOLD_AFTER unaccepted and that its batched hold found no intent of
        # (``_record_intent``); a message a free pool process accepts at once is never written.
        receipts.hold(task.app, key, lease, record=self._record_intent)

    def _record_intent(self) -> bool:
        """Record the publish intent this message's producer did not (it sent the task by
        name without knowing its class), with the envelope of the message as received
        (``envelope.of_message``: its headers, routing, limits, canvas placement) and its
        deadline. True if an intent was recorded now (one statement: insert if absent).

        Run by the receipts thread, only for a held key that had no intent to hold. A message
        due past ``ledger_hold_threshold_seconds`` waits in the worker's timer: it gets none,
        since an intent's re-send carries no ETA and would run it early. Never raises:
        ``key_from`` and the arguments are user code and data, run in the parent.
        """
        task = self.task
        try:
            headers = {k: v for k, v in self._request_dict.items() if k not in _NOT_HEADERS}
            if not intents.wanted(task, headers):
                return False
            threshold = runtime.settings_for(task.app).hold_threshold_seconds
            if self.eta is not None and self.eta.timestamp() - time.time() > threshold:
                return False
            payload = self._body if self._decoded else self._message.payload
            embed = payload[2] if isinstance(payload, (list, tuple)) and len(payload) > 2 else None
            sent = envelope.of_message(
                tuple(self.args or ()),
                dict(self.kwargs or {}),
                headers,
                routing_key=(self.delivery_info or {}).get("routing_key"),
                properties=self._request_dict.get("properties"),
                canvas=canvas.message_placement(headers, embed),
            )
            deadline = envelope.absolute_deadline(
                headers.get("expires"), headers.get(wire.DEADLINE)
            )
            key = intents.record(task, sent, self.id, deadline=(deadline, None))
        except Exception as err:  # noqa: BLE001 - never in the parent's way
            log.warning("no intent recorded for received task_id=%s: %r", self.id, err)
            return False
        if key is not None:
            log.debug(
                "recorded the publish intent of received key=%s task_id=%s (its producer did not)",
                key,
                self.id,
            )
        return key is not None

    def _unhold(self) -> None:
        if self._held_key is not None:
            receipts.release(self._held_key)
            self._held_key = None

    def on_accepted(self, pid: int, time_accepted: float) -> Any:
        # A pool process has it: its claim owns the entry from now on.
        self._unhold()
        return super().on_accepted(pid, time_accepted)

    def acknowledge(self) -> Any:
        self._unhold()
        return super().acknowledge()

    def reject(self, requeue: bool = False) -> Any:
        self._unhold()
        return super().reject(requeue=requeue)

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> Any:
        # Celery discards this message without running it (its ``expires`` passed, or it was
        # revoked by id or by a stamped header) and acks it: end its entry too, or the sweep
        # would send back what Celery dropped. A terminated task is the revoke hook's.
        done = super()._announce_revoked(reason, terminated, signum, expired)
        if not terminated:
            timing.discarded(self.task.app, self.id, expired=bool(expired), node=self.hostname)
        return done

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        self._unhold()
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, (WorkerLostError, SystemExit, KeyboardInterrupt)) and not (
            self._already_cancelled or self._already_revoked
        ):
            self._interrupt_now(exc)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def _interrupt_now(self, exc: BaseException) -> None:
        task = self.task
        try:
            key = task.entry_key_of(
                self.args,
                self.kwargs,
                self.id,
                self._request_dict.get(wire.KEY),
                canvas.replacement(self),
            )
            store = runtime.store_for(task.app)
            found = store.interrupt_owner(
                key,
                node=self.hostname,
                boot=runtime.boot_id(),
                pid=self.worker_pid,
                actor=self.hostname,
                why=f"pool process {self.worker_pid} lost: {exc}",
            )
        except Exception as err:  # noqa: BLE001 - key_from is user code, run in the parent
            # The lease is the backstop: the sweep finds this entry when it expires.
            log.warning("worker-lost fast path failed for task_id=%s: %s", self.id, err)
            return
        if found is not None:
            log.warning(
                "interrupted key=%s task_id=%s fence=%s: pool process %s lost",
                key,
                self.id,
                found.fence,
                self.worker_pid,
            )

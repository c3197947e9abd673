"""The worker-lost fast path: a Task.Request that runs in the worker's parent process.

When a pool process dies (SIGKILL, OOM killer), billiard reports ``WorkerLostError`` for the
request it was running to the parent, which calls ``Request.on_failure`` here. The parent knows
the node, this boot and the dead child's pid, but not the fence the child claimed with; so the
entry is interrupted fenced on that exact owner (``interrupt_owner``). It never waits for the
lease: the child is provably gone.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.worker.request import Request

from celery_ledger import runtime
from celery_ledger.ledger import LedgerError

log = logging.getLogger(__name__)


class LedgerRequest(Request):
    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
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
            key, _ = task.ledger_key(
                self.args, self.kwargs, self.id, self._request_dict.get("ledger_key")
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
        except (LedgerError, ValueError) as err:
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

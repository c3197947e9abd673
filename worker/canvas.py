"""Celery's canvas (chains, groups, chords, ``link``) around ledgered tasks.

Celery publishes a task's next chain link and its ``link`` callbacks from the worker, after the
body returned and before the result is stored (``celery.app.trace``), and counts a chord member
when it stores the result (``Backend.on_chord_part_return``). Every one of those happens again
when a settled member is redelivered and its claim RETURNs: the stored result is handed back to
the tracer, which publishes and counts as if the body had run. Where that is safe and where the
ledger steps in is argued in docs/design.md ("Canvas").
"""

from __future__ import annotations

from typing import Any

from celery import current_task

from celery_ledger import runtime
from celery_ledger.crashpoints import crash_point


def link_published(headers: dict[str, Any]) -> None:
    """``after_task_publish`` in a worker: the crash point ``after-publish`` fires once a
    ledgered task running in this process has published a message whose parent it is (its
    next link, a callback), before its own result is stored and its message acked."""
    task = current_task
    if task is None or not getattr(task, "ledger_attempt", None) and not _ledgered(task):
        return
    request = task.request
    if request is None or request.called_directly or headers.get("parent_id") != request.id:
        return
    crash_point(runtime.settings_for(task.app), "after-publish")


def _ledgered(task: Any) -> bool:
    from celery_ledger.task import LedgerTask  # canvas is imported by app, before task

    return isinstance(task._get_current_object(), LedgerTask)

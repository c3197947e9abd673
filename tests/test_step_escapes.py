"""An effect step that escapes with an exception, or whose output cannot be stored (guarantees.md
§ "Bad input", items 10 and 19): what the reconciler is handed, what the blocked reason says, and
what ``show``, ``release`` and Flower's release form tell an operator.

Code paths in one process (``apply()``) on the real store (SQLite and PostgreSQL); no
delivery is involved: the escape is decided inside the attempt that ran the step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from test_cli import cli  # noqa: F401 - the in-process CLI fixture

from celery_ledger import LedgerTask, Reconciled, runtime
from celery_ledger.ledger import EntryStatus, LedgerStore, StepStatus, entry_key
from celery_ledger.view import next_action


def local_app(tmp_path: Path, url: str) -> Celery:
    app = Celery("escapes", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(ledger_url=url, ledger_max_result_bytes=10_000)
    runtime.store_for(app).ensure_ready()
    return app


def test_the_reconciler_and_the_reason_see_the_ref_recorded_before_the_step_raised(
    tmp_path: Path, ledger_url: str
) -> None:
    app = local_app(tmp_path, ledger_url)
    asked: list[Any] = []

    def reconcile(step: Any) -> Reconciled:
        asked.append(step.external_ref)
        return Reconciled.unknown("provider unreachable")

    @app.task(
        base=LedgerTask,
        bind=True,
        name="escapes.charge",
        shared=False,
        key_from=("order",),
        reconciler=reconcile,
    )
    def charge(self: LedgerTask, order: str) -> None:
        def call() -> None:
            self.record_external_ref(f"ch_{order}")
            raise ConnectionError("reply lost")

        self.step("charge", call)

    assert charge.apply(args=("o1",)).failed()
    assert asked == ["ch_o1"]
    entry = runtime.store_for(app).get_entry(entry_key("escapes.charge", {"order": "o1"}))
    assert entry.status is EntryStatus.BLOCKED
    assert "external ref: ch_o1" in (entry.reason or ""), entry.reason


def _unstorable(app: Celery, what: str) -> Any:
    @app.task(base=LedgerTask, bind=True, name=f"escapes.{what}", shared=False, key_from=("order",))
    def task(self: LedgerTask, order: str) -> None:
        def call() -> Any:
            if what == "generator":
                return (n for n in range(3))
            return "x" * (app.conf.ledger_max_result_bytes + 1)

        self.step("charge", call)

    return task


@pytest.mark.parametrize("what", ["generator", "huge"])
def test_a_step_whose_output_cannot_be_stored_says_it_returned(
    tmp_path: Path, ledger_url: str, what: str
) -> None:
    app = local_app(tmp_path, ledger_url)
    task = _unstorable(app, what)
    assert task.apply(args=("o1",)).failed()
    store = runtime.store_for(app)
    entry = store.get_entry(entry_key(f"escapes.{what}", {"order": "o1"}))
    assert entry.status is EntryStatus.BLOCKED
    reason = entry.reason or ""
    assert "step 'charge' returned" in reason and "only its output could not be stored" in reason
    assert "may have executed" not in reason
    # ``show`` (and Flower's "what resolves it"): the next action is a completed release.
    action = next_action(entry, store.now(), "celery-ledger")
    assert "not-executed" not in (action.command or ""), action
    assert "--verified completed" in (action.command or "")
    assert "runs it again" in action.hint, action.hint


def test_release_not_executed_of_a_step_that_returned_warns(
    tmp_path: Path,
    ledger_url: str,
    cli: Any,  # noqa: F811
) -> None:
    app = local_app(tmp_path, ledger_url)
    task = _unstorable(app, "generator")
    assert task.apply(args=("o2",)).failed()
    key = entry_key("escapes.generator", {"order": "o2"})
    shown = cli("show", key)
    assert "its step returned" in shown.output, shown.output
    released = cli(
        "release", key, "--verified", "not-executed", "--by", "ops", "--reason", "checked"
    )
    assert "warning: its step returned" in released.output, released.output
    store = LedgerStore(ledger_url)
    try:
        (row,) = [s for s in store.load_steps(key) if s.name == "charge"]
        assert row.status is StepStatus.NOT_EXECUTED
    finally:
        store.dispose()
    data = json.loads(cli("show", key, "--json").output)
    assert data["key"] == key

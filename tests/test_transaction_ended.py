"""A transaction step whose block ends the step's transaction itself (guarantees.md § "Bad
input", item 6).

The block's ``conn.commit()`` (or ``rollback()``) ends the transaction the ledger began; the
writes after it go to a new one. Writing the step's row there would count writes as done
that did not commit with it (a crash before the row ran the block again: its insert committed
twice). The step refuses: nothing more is committed, the task fails with
``TransactionEndedError`` (a ``StepUsageError``: never blocked, never re-run).

Code paths in one process (``apply()``) on the real store, SQLite and PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from celery_ledger import LedgerTask, StepUsageError, TransactionEndedError, runtime
from celery_ledger.ledger import EntryStatus, StepStatus, entry_key

meta = MetaData()
rows = Table("ended_rows", meta, Column("id", Integer, primary_key=True), Column("v", String(40)))


def local_app(url: str) -> Celery:
    app = Celery("txended", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(ledger_url=url)
    store = runtime.store_for(app)
    store.ensure_ready()
    meta.create_all(store.engine)
    return app


def values(app: Celery) -> list[str]:
    with runtime.store_for(app).engine.connect() as conn:
        return sorted(conn.execute(select(rows.c.v)).scalars())


def _end(conn: Any, how: str) -> None:
    if how == "commit":
        conn.commit()
    elif how == "rollback":
        conn.rollback()
    else:  # the ORM form: the session's own connection
        conn.connection().commit()


@pytest.mark.parametrize(
    "form,how",
    [
        ("with", "commit"),
        ("with", "rollback"),
        ("function", "commit"),
        ("session", "session-connection-commit"),
    ],
)
def test_a_block_that_ends_the_steps_transaction_fails_the_task(
    tmp_path: Path, ledger_url: str, form: str, how: str
) -> None:
    app = local_app(ledger_url)

    @app.task(base=LedgerTask, bind=True, name="txended.pay", shared=False, key_from=("who",))
    def pay(self: LedgerTask, who: str) -> Any:
        def block(conn: Any) -> str:
            conn.execute(rows.insert().values(v=f"before:{who}"))
            _end(conn, how)
            conn.execute(rows.insert().values(v=f"after:{who}"))
            return "paid"

        if form == "with":
            tx = self.transaction("credit")
            with tx as conn:
                tx.output = block(conn)
            return tx.output
        return self.transaction_step("credit", block, session=form == "session")

    result = pay.apply(args=(how,))
    assert result.failed()
    assert isinstance(result.result, TransactionEndedError), result.result
    assert isinstance(result.result, StepUsageError)
    assert "credit" in str(result.result) and "commit" in str(result.result)
    # What the block committed itself stays committed (the ledger cannot undo it); nothing
    # after it is, and the step has no completed row: its writes are not counted as done.
    committed = [] if how == "rollback" else [f"before:{how}"]
    assert values(app) == committed
    store = runtime.store_for(app)
    key = entry_key("txended.pay", {"who": how})
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.FAILED, entry
    assert "TransactionEndedError" in (entry.error or "")
    assert all(s.status is not StepStatus.COMPLETED for s in store.load_steps(key))
    assert store.stats().duplicate_executions == 0


def test_a_savepoint_inside_the_block_is_fine(tmp_path: Path, ledger_url: str) -> None:
    """``begin_nested()`` (a savepoint) leaves the step's transaction as it was."""
    app = local_app(ledger_url)

    @app.task(base=LedgerTask, bind=True, name="txended.nested", shared=False)
    def nested(self: LedgerTask) -> str:
        def block(conn: Any) -> str:
            with conn.begin_nested():
                conn.execute(rows.insert().values(v="inner"))
            conn.execute(rows.insert().values(v="outer"))
            return "ok"

        return self.transaction_step("credit", block)

    assert nested.apply(task_id="n-1").get() == "ok"
    assert values(app) == ["inner", "outer"]
    with runtime.store_for(app).engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(rows)).scalar_one() == 2

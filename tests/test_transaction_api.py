"""The transaction step and ``send`` API in one process (``apply()``): code paths only.

Replay, rollback, usage errors. Crashes, fencing and delivery are proven with real workers
in ``tests/test_transaction_steps.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from celery_ledger import LedgerTask, NestedStepError, SendRefused, StepUsageError, runtime
from celery_ledger.ledger import EntryStatus, StepStatus, Verdict, child_task_id, entry_key

meta = MetaData()
rows = Table("api_rows", meta, Column("id", Integer, primary_key=True), Column("v", String(40)))


def local_app(tmp_path: Path, **conf: Any) -> Celery:
    app = Celery("txapi", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", **conf)
    store = runtime.store_for(app)
    store.ensure_ready()
    meta.create_all(store.engine)
    return app


def count(app: Celery, v: str | None = None) -> int:
    q = select(func.count()).select_from(rows)
    if v is not None:
        q = q.where(rows.c.v == v)
    with runtime.store_for(app).engine.connect() as conn:
        return int(conn.execute(q).scalar_one())


def test_replay_skips_the_block_and_returns_the_stored_output(tmp_path: Path) -> None:
    app = local_app(tmp_path)
    fail = {"now": True}

    @app.task(base=LedgerTask, bind=True, name="txapi.pay", shared=False, key_from=("who",))
    def pay(self: LedgerTask, who: str) -> list[Any]:
        tx = self.transaction("credit")
        with tx as conn:
            conn.execute(rows.insert().values(v=f"credit:{who}"))
            tx.output = {"credited": who}

        def debit(session: Any, amount: int) -> int:
            session.execute(rows.insert().values(v=f"debit:{who}"))
            return amount

        debited = self.transaction_step("debit", debit, 5, session=True)
        if fail["now"]:
            raise RuntimeError("after both steps")
        return [tx.output, debited, tx.replayed]

    first = pay.apply(args=("ann",))
    assert first.failed()
    assert count(app, "credit:ann") == 1 and count(app, "debit:ann") == 1
    store = runtime.store_for(app)
    key = entry_key("txapi.pay", {"who": "ann"})
    store.release(key, Verdict.NOT_EXECUTED, by="test", reason="run it again")
    fail["now"] = False
    second = pay.apply(args=("ann",))
    assert second.get() == [{"credited": "ann"}, 5, True]
    # Neither block ran again: one row each.
    assert count(app, "credit:ann") == 1 and count(app, "debit:ann") == 1
    assert store.get_entry(key).status is EntryStatus.COMPLETED
    assert store.stats().duplicate_executions == 0


def test_a_block_that_raises_commits_nothing(tmp_path: Path) -> None:
    app = local_app(tmp_path)

    @app.task(base=LedgerTask, bind=True, name="txapi.boom", shared=False)
    def boom(self: LedgerTask) -> None:
        with self.transaction("credit") as conn:
            conn.execute(rows.insert().values(v="boom"))
            raise ValueError("the block failed")

    result = boom.apply(task_id="b-1")
    assert isinstance(result.result, ValueError)
    assert count(app, "boom") == 0
    steps = runtime.store_for(app).load_steps(entry_key("txapi.boom", "b-1"))
    # Only the marker row of the entry's first step, never a completed one.
    assert [s.status for s in steps] == [StepStatus.STARTED]


def test_send_records_children_with_deterministic_ids(tmp_path: Path) -> None:
    app = local_app(tmp_path)

    @app.task(base=LedgerTask, bind=True, name="txapi.child", shared=False)
    def child(self: LedgerTask, n: int) -> int:
        return n

    @app.task(base=LedgerTask, bind=True, name="txapi.parent", shared=False)
    def parent(self: LedgerTask) -> list[str]:
        return self.step("notify", lambda: [self.send(child.s(n)) for n in range(2)])

    ids = parent.apply(task_id="p-1").get()
    key = entry_key("txapi.parent", "p-1")
    assert ids == [child_task_id(key, "notify", 0, n) for n in range(2)]
    kids = runtime.store_for(app).children_of(key)
    assert [k.child_id for k in kids] == ids and all(k.published for k in kids)


@pytest.mark.parametrize(
    "body,error,words",
    [
        ("outside", StepUsageError, "inside a step"),
        ("link", SendRefused, "cannot keep the option"),
        ("not-a-signature", SendRefused, "takes a task signature"),
        ("nested", NestedStepError, "steps do not nest"),
    ],
)
def test_misuse_fails_the_task_in_the_ledgers_words(
    tmp_path: Path, body: str, error: type[Exception], words: str
) -> None:
    app = local_app(tmp_path)

    @app.task(base=LedgerTask, bind=True, name="txapi.child2", shared=False)
    def child(self: LedgerTask) -> None:
        return None

    @app.task(base=LedgerTask, bind=True, name="txapi.misuse", shared=False)
    def misuse(self: LedgerTask, how: str) -> Any:
        if how == "outside":
            return self.send(child.s())
        if how == "link":
            return self.step("s", lambda: self.send(child.s().set(link=child.s())))
        if how == "not-a-signature":
            return self.step("s", lambda: self.send("txapi.child2"))
        with self.transaction("t"):
            self.step("inner", lambda: 1)
        return None

    result = misuse.apply(args=(body,))
    assert isinstance(result.result, error) and words in str(result.result)
    assert count(app) == 0


def test_a_child_that_is_not_ledgered_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = local_app(tmp_path)

    @app.task(name="txapi.plain_child", shared=False)
    def plain_child(n: int) -> int:
        return n

    @app.task(base=LedgerTask, bind=True, name="txapi.ledgered_child", shared=False)
    def ledgered_child(self: LedgerTask, n: int) -> int:
        return n

    @app.task(base=LedgerTask, bind=True, name="txapi.sender", shared=False)
    def sender(self: LedgerTask) -> None:
        self.step("a", lambda: [self.send(plain_child.s(1)), self.send(plain_child.s(2))])
        self.step("b", lambda: self.send(ledgered_child.s(3)))

    with caplog.at_level("WARNING", logger="celery_ledger.attempt"):
        sender.apply(task_id="s-1").get()
    warned = [r.getMessage() for r in caplog.records if "not a LedgerTask" in r.getMessage()]
    assert len(warned) == 1 and "txapi.plain_child" in warned[0]


def test_a_childs_arguments_are_sealed_like_a_snapshot(tmp_path: Path) -> None:
    """With ``ledger_snapshot_keys``, a child's recorded payload is sealed (encryption at
    rest); it is opened to publish it."""
    from cryptography.fernet import Fernet

    app = local_app(tmp_path, ledger_snapshot_keys=Fernet.generate_key().decode())

    @app.task(base=LedgerTask, bind=True, name="txapi.secret_child", shared=False)
    def secret_child(self: LedgerTask, card: str) -> str:
        return card

    @app.task(base=LedgerTask, bind=True, name="txapi.secret_parent", shared=False)
    def secret_parent(self: LedgerTask) -> str:
        return str(self.step("pay", lambda: self.send(secret_child.s("4111-1111"))))

    child_id = secret_parent.apply(task_id="sp-1").get()
    (kid,) = runtime.store_for(app).children_of(entry_key("txapi.secret_parent", "sp-1"))
    assert kid.child_id == child_id and kid.published
    assert kid.payload.startswith("fernet:") and "4111" not in kid.payload

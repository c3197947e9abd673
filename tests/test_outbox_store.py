"""The outbox and the transaction step at the store (design.md § "Transaction steps and the
transactional outbox"), on SQLite and PostgreSQL.

What the runtime relies on: a step's children are recorded with its completed row or not at
all, and only under the attempt's fence; a transaction step's writes commit with its row, and
a stale fence rolls both back; the sweep's list/mark; ``show`` lists the children and names
the parent. Delivery and crashes are ``tests/test_transaction_steps.py``'s (real workers).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from celery_ledger.ledger import (
    Child,
    ClaimRequest,
    Gate,
    LedgerStore,
    Owner,
    StepStatus,
    child_task_id,
    entry_key,
)
from celery_ledger.ledger.schema import entries

meta = MetaData()
app_rows = Table("app_rows", meta, Column("id", Integer, primary_key=True), Column("v", String(20)))


@pytest.fixture
def store(ledger_url: str) -> Any:
    s = LedgerStore(ledger_url)
    s.now()
    meta.create_all(s.engine)
    yield s
    s.dispose()


def claim(
    store: LedgerStore,
    task: str = "shop.parent",
    task_id: str | None = None,
    owner: Owner = Owner("celery@a", "boot-1", 1),
) -> Any:
    task_id = task_id or str(uuid.uuid4())
    return store.claim(
        ClaimRequest(
            key=entry_key(task, task_id),
            task_name=task,
            task_id=task_id,
            args_hash="task-id",
            snapshot=None,
            side_effect="non_idempotent",
            owner=owner,
            lease_seconds=60.0,
        )
    )


def child(key: str, n: int, step: str = "notify") -> Child:
    payload = json.dumps({"args": [n], "kwargs": {}, "options": {}})
    return Child(child_task_id(key, step, 0, n), "shop.child", payload, n)


def app_count(store: LedgerStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(app_rows)).scalar_one())


def test_child_ids_are_deterministic_and_distinct() -> None:
    a = child_task_id("k", "notify", 0, 0)
    assert a == child_task_id("k", "notify", 0, 0)
    assert len({a, child_task_id("k", "notify", 0, 1), child_task_id("k", "notify", 1, 0)}) == 3
    assert a != child_task_id("k2", "notify", 0, 0) != child_task_id("k", "other", 0, 0)


def test_children_are_recorded_with_the_completed_row_under_the_fence(store) -> None:
    c = claim(store)
    kids = [child(c.key, 0), child(c.key, 1)]
    # A stale fence records neither the row nor the children.
    assert not store.complete_step(
        c.key, c.fence + 1, ("notify", "h", 0), seq=1, output="1", children=kids
    )
    assert store.load_steps(c.key) == () and store.children_of(c.key) == []
    assert store.complete_step(c.key, c.fence, ("notify", "h", 0), seq=1, output="1", children=kids)
    assert [s.status for s in store.load_steps(c.key)] == [StepStatus.COMPLETED]
    assert [m.child_id for m in store.children_of(c.key)] == [k.child_id for k in kids]
    # A completed row is never written again, and no child is added by a second attempt.
    again = [child(c.key, 0, "other")]
    assert not store.complete_step(
        c.key, c.fence, ("notify", "h", 0), seq=1, output="1", children=again
    )
    assert len(store.children_of(c.key)) == 2


def ambiguous_then_taken_over(store: LedgerStore) -> tuple[Any, Any]:
    """An effect step ``charge`` started under fence 1, its process died (the fast path), and
    a takeover claimed the entry: the step is ambiguous, and no child of it was recorded."""
    task_id = str(uuid.uuid4())
    first = claim(store, task_id=task_id)
    assert store.write_step(first.key, first.fence, CHARGE, seq=1, status=StepStatus.STARTED)
    assert store.interrupt_owner(
        first.key, node="celery@a", boot="boot-1", pid=1, actor="test", why="pool process killed"
    )
    second = claim(store, task_id=task_id, owner=Owner("celery@b", "boot-2", 2))
    assert second.key == first.key and second.gate is Gate.TAKEOVER
    assert [s.status for s in second.steps] == [StepStatus.STARTED]
    assert store.children_of(first.key) == []
    return first, second


CHARGE = ("charge", "h", 0)


def test_a_reconciled_verdict_records_the_steps_children_with_its_completed_row(store) -> None:
    """A reconciler's ``completed`` verdict with the children the step would have sent: the
    row and the children in one transaction, under the takeover's fence, with the step's own
    child ids; a stale fence (the dead attempt's) records neither."""
    first, second = ambiguous_then_taken_over(store)
    kids = [child(first.key, 0, "charge"), child(first.key, 1, "charge")]
    assert not store.complete_step(
        first.key, first.fence, CHARGE, seq=1, output='"ch"', children=kids
    )
    assert store.children_of(first.key) == []
    assert store.complete_step(first.key, second.fence, CHARGE, seq=1, output='"ch"', children=kids)
    (row,) = store.load_steps(first.key)
    # A verdict is a proof, not a run: the step's attempts stay 1.
    assert (row.status, row.fence, row.output, row.attempts) == (
        StepStatus.COMPLETED,
        second.fence,
        '"ch"',
        1,
    )
    listed = store.children_of(first.key)
    assert [(m.child_id, m.step, m.n, m.fence, m.published) for m in listed] == [
        (k.child_id, "charge", k.n, second.fence, False) for k in kids
    ]
    assert [m.child_id for m in store.unpublished()] == [k.child_id for k in kids]
    assert store.stats().duplicate_executions == 0


def test_a_reconciled_verdict_with_children_is_not_refused_by_a_pending_cancellation(
    store,
) -> None:
    """The admission gate stops effects from beginning; a verdict begins none, it records
    one that happened. A cancellation requested while the reconciler was asked must not
    refuse the verdict's row because it carries children (without children it never was):
    refused, the attempt would take itself for superseded and leave the step ambiguous."""
    first, second = ambiguous_then_taken_over(store)
    assert store.request_cancel(first.key, by="ops", reason="r", error="e").outcome == "requested"
    kids = [child(first.key, 0, "charge")]
    assert store.complete_step(first.key, second.fence, CHARGE, seq=1, output='"ch"', children=kids)
    assert [s.status for s in store.load_steps(first.key)] == [StepStatus.COMPLETED]
    assert [m.child_id for m in store.children_of(first.key)] == [kids[0].child_id]


def test_unpublished_then_marked(store) -> None:
    c = claim(store)
    kids = [child(c.key, 0), child(c.key, 1)]
    assert store.complete_step(c.key, c.fence, ("notify", "h", 0), seq=1, output="1", children=kids)
    assert store.unpublished(older_than=3600.0) == []  # the grace: too fresh for the sweep
    pending = store.unpublished()
    assert [m.child_id for m in pending] == [k.child_id for k in kids]
    assert store.count_unpublished() == 2
    assert store.mark_published([kids[0].child_id]) == 1
    assert store.mark_published([kids[0].child_id]) == 0  # twice is harmless
    assert [m.child_id for m in store.unpublished()] == [kids[1].child_id]
    found = store.parent_of(kids[1].child_id)
    assert found is not None and found.parent_key == c.key and found.step == "notify"
    assert store.parent_of("no-such-child") is None


def test_transaction_step_commits_its_writes_with_its_row(store) -> None:
    c = claim(store)
    with store.step_transaction() as conn:
        conn.execute(app_rows.insert().values(v="credit"))
        assert store.commit_step(conn, c.key, c.fence, ("credit", "h", 0), seq=1, output='"ok"')
    assert app_count(store) == 1
    assert [(s.name, s.status) for s in store.load_steps(c.key)] == [
        ("credit", StepStatus.COMPLETED)
    ]


def test_a_stale_fence_rolls_the_transaction_back(store) -> None:
    c = claim(store)
    with store.step_transaction() as conn:
        conn.execute(app_rows.insert().values(v="credit"))
        refused = store.commit_step(
            conn,
            c.key,
            c.fence + 1,
            ("credit", "h", 0),
            seq=1,
            output="1",
            children=[child(c.key, 0)],
        )
    assert refused is False
    assert app_count(store) == 0 and store.load_steps(c.key) == ()
    assert store.children_of(c.key) == []


def test_a_transaction_step_commits_its_children_with_its_row(store) -> None:
    c = claim(store)
    kids = [child(c.key, 0, "book"), child(c.key, 1, "book")]
    with store.step_transaction() as conn:
        conn.execute(app_rows.insert().values(v="book"))
        assert store.commit_step(
            conn, c.key, c.fence, ("book", "h", 0), seq=1, output="1", children=kids
        )
    assert app_count(store) == 1
    assert [m.child_id for m in store.unpublished()] == [k.child_id for k in kids]


def test_a_completed_row_is_not_written_twice_by_a_transaction(store) -> None:
    """The same step committed already (under this fence): a second commit writes nothing."""
    c = claim(store)
    for expected in (True, False):
        with store.step_transaction() as conn:
            conn.execute(app_rows.insert().values(v="credit"))
            assert (
                store.commit_step(conn, c.key, c.fence, ("credit", "h", 0), seq=1, output="1")
                is expected
            )
    assert app_count(store) == 1


def test_leaving_the_block_without_commit_rolls_back(store) -> None:
    c = claim(store)
    with pytest.raises(RuntimeError), store.step_transaction() as conn:
        conn.execute(app_rows.insert().values(v="credit"))
        raise RuntimeError("the block failed")
    assert app_count(store) == 0 and store.load_steps(c.key) == ()


def test_prune_outbox_keeps_what_is_owed(store) -> None:
    c = claim(store)
    kids = [child(c.key, 0), child(c.key, 1)]
    assert store.complete_step(c.key, c.fence, ("notify", "h", 0), seq=1, output="1", children=kids)
    store.mark_published([kids[0].child_id])
    assert store.prune_outbox() == 0  # the parent entry still exists
    with store.engine.begin() as conn:
        conn.execute(entries.delete().where(entries.c.key == c.key))
    assert store.prune_outbox() == 1  # published and orphaned; the unpublished one stays
    assert [m.child_id for m in store.unpublished()] == [kids[1].child_id]


def test_the_ledger_page_never_calls_a_transaction_steps_marker_ambiguous() -> None:
    """The operator view's step state (``show`` and the Flower page): a transaction step's
    marker row is not ambiguous."""
    from dataclasses import replace

    from celery_ledger.ledger import TRANSACTION_STEP_REF, StepRecord
    from celery_ledger.view import step_detail

    started = StepRecord("credit", "h", 0, 1, StepStatus.STARTED, 1, started_at=1.0)
    assert step_detail(started, False).state == "ambiguous"
    marker = replace(started, external_ref=TRANSACTION_STEP_REF)
    assert step_detail(marker, False).state == "not-executed"
    assert step_detail(marker, True).state == "running"

"""The admission gate at the store (SQLite and PostgreSQL): a claim admits a delivery only when
no cancellation is pending, no deadline has passed and the key is no tombstone; a stored
deadline only ever moves earlier. Each case is a claim the runtime makes (a retry's, a
takeover's, a first delivery's), so a stepless body is stopped here, before it runs."""

from __future__ import annotations

import dataclasses
import time

from test_store_contract import OWNER, STEP, make_interrupted, request

from celery_ledger.ledger import EntryStatus, Gate, LedgerStore, StepStatus
from celery_ledger.ledger.schedule import cancelled_failure

ERROR = cancelled_failure("test")


def test_a_cancellation_asked_during_an_attempt_stops_its_retry_at_the_claim(
    store: LedgerStore,
) -> None:
    first = store.claim(request("k-retry", task_id="t-retry"))
    assert store.request_cancel("k-retry", by="ops", reason="r", error=ERROR).outcome == (
        "requested"
    )
    # The attempt retries (a stepless body never met the step gate): the retry's delivery
    # must not run it again.
    assert store.settle("k-retry", first.fence, EntryStatus.RETRYING, due_in=0.0)
    again = store.claim(request("k-retry", task_id="t-retry"))
    assert again.gate is Gate.RETURN, again
    assert "TaskCancelled" in (again.error or "")
    entry = store.get_entry("k-retry")
    assert entry.status is EntryStatus.CANCELLED and entry.fence > first.fence


def test_a_cancellation_asked_before_a_takeover_stops_the_takeover(store: LedgerStore) -> None:
    first = store.claim(request("k-take", task_id="t-take"))
    assert store.write_step("k-take", first.fence, STEP, seq=1, status=StepStatus.COMPLETED)
    assert store.request_cancel("k-take", by="ops", reason="r", error=ERROR).outcome == (
        "requested"
    )
    # The worker's parent saw the pool process die (the fast path) before any sweep.
    assert interrupt(store, "k-take")
    taken = store.claim(request("k-take", task_id="t-take"))
    assert taken.gate is Gate.RETURN, taken
    assert store.get_entry("k-take").status is EntryStatus.CANCELLED


def test_a_passed_deadline_stops_a_first_delivery_at_its_claim(store: LedgerStore) -> None:
    now = store.now()
    late = dataclasses.replace(request("k-late", task_id="t-late"), deadline_at=now - 1.0)
    claim = store.claim(late)
    assert claim.gate is Gate.RETURN, claim
    assert "TaskExpired" in (claim.error or "")
    assert store.get_entry("k-late").status is EntryStatus.EXPIRED
    # A deadline relative to the entry's creation that is already spent does the same.
    spent = dataclasses.replace(request("k-spent", task_id="t-spent"), deadline_after=-1.0)
    assert store.claim(spent).gate is Gate.RETURN
    # And one still ahead admits it, storing it for every later gate.
    ahead = dataclasses.replace(request("k-ahead", task_id="t-ahead"), deadline_at=now + 60.0)
    assert store.claim(ahead).gate is Gate.RUN
    stored = store.get_entry("k-ahead").deadline_at
    assert stored is not None and abs(stored - (now + 60.0)) < 1.0


def test_a_passed_deadline_stops_a_publish_intent_at_its_claim(store: LedgerStore) -> None:
    intent = dataclasses.replace(
        request("k-intent", task_id="t-intent"), deadline_at=store.now() + 0.2
    )
    assert store.record_intent(intent)
    time.sleep(0.4)
    claim = store.claim(request("k-intent", task_id="t-intent"))
    assert claim.gate is Gate.RETURN and "TaskExpired" in (claim.error or ""), claim


def test_a_stored_deadline_never_moves_later(store: LedgerStore) -> None:
    now = store.now()
    first = store.claim(request("k-dl", task_id="t-dl"))
    assert store.set_deadline("k-dl", first.fence, at=now + 30.0, after_created=None) is False
    # The message's own deadline (a resume carries none, or a later one) never extends it.
    assert store.set_deadline("k-dl", first.fence, at=now + 3600.0, after_created=None) is False
    stored = store.get_entry("k-dl").deadline_at
    assert stored is not None and stored < now + 31.0, stored
    assert store.set_deadline("k-dl", first.fence, at=None, after_created=7200.0) is False
    stored = store.get_entry("k-dl").deadline_at
    assert stored is not None and stored < now + 31.0, stored
    fence = interrupt(store, "k-dl")
    later = dataclasses.replace(
        request("k-dl", task_id="t-dl"), deadline_at=now + 3600.0, deadline_after=7200.0
    )
    taken = store.claim(later)
    assert taken.gate is Gate.TAKEOVER and taken.fence == fence + 1
    stored = store.get_entry("k-dl").deadline_at
    assert stored is not None and stored < now + 31.0, stored


def interrupt(store: LedgerStore, key: str) -> int:
    """The worker-lost fast path: the parent saw the pool process die."""
    found = store.interrupt_owner(
        key, node=OWNER.node, boot=OWNER.boot, pid=OWNER.pid, actor="parent", why="lost"
    )
    assert found is not None
    return found.fence


def test_a_tombstone_is_never_admitted(store: LedgerStore) -> None:
    fence = make_interrupted(store, "k-tomb")
    taken = store.claim(request("k-tomb"))
    assert taken.gate is Gate.TAKEOVER and taken.fence == fence + 1
    assert store.settle("k-tomb", taken.fence, EntryStatus.FAILED, error='{"e":1}')
    with store._txn() as conn:  # settled long ago: retention's clock moved on
        from sqlalchemy import update

        from celery_ledger.ledger.schema import entries

        conn.execute(update(entries).values(settled_at=entries.c.settled_at - 10 * 86400.0))
    from celery_ledger.ledger.schedule import PRUNED_FAILURE

    assert store.prune_settled(86400.0, tombstone=PRUNED_FAILURE) == 1
    late = store.claim(request("k-tomb"))
    assert late.gate is Gate.RETURN and "KeyPruned" in (late.error or "")


def test_a_transaction_step_does_not_commit_after_a_cancellation_or_its_deadline(
    store: LedgerStore,
) -> None:
    """A transaction step's commit is its effect: the gate refuses it like a ``started`` row,
    and its writes roll back with the refused row."""
    cancelled = store.claim(request("k-txc", task_id="t-txc"))
    assert store.request_cancel("k-txc", by="ops", reason="r", error=ERROR).outcome == ("requested")
    with store.step_transaction() as conn:
        assert not store.commit_step(
            conn, "k-txc", cancelled.fence, ("credit", "h", 0), seq=1, output='"ok"'
        )
    assert store.stop_reason("k-txc", cancelled.fence) == "cancelled"

    late = store.claim(request("k-txd", task_id="t-txd"))
    assert store.set_deadline("k-txd", late.fence, at=store.now() - 1.0, after_created=None)
    with store.step_transaction() as conn:
        assert not store.commit_step(
            conn, "k-txd", late.fence, ("credit", "h", 0), seq=1, output='"ok"'
        )
    assert store.stop_reason("k-txd", late.fence) == "expired"
    assert store.load_steps("k-txc") == () and store.load_steps("k-txd") == ()


def test_recovery_expires_what_it_would_send_again_after_its_deadline(store: LedgerStore) -> None:
    """``expire_passed``: the sweep's door. An intent or an interrupted entry whose deadline
    passed settles ``expired``; a live attempt, or a deadline still ahead, is left alone."""
    now = store.now()
    lost = dataclasses.replace(request("k-lost", task_id="t-lost"), deadline_at=now + 0.2)
    assert store.record_intent(lost)
    live = dataclasses.replace(request("k-live", task_id="t-live"), deadline_at=now + 0.2)
    assert store.claim(live).gate is Gate.RUN
    ahead = dataclasses.replace(request("k-ahead", task_id="t-ahead"), deadline_at=now + 600)
    assert store.record_intent(ahead)
    time.sleep(0.4)
    done = store.expire_passed(["k-lost", "k-live", "k-ahead", "k-none"], ERROR, actor="sweep")
    assert done == {"k-lost"}
    assert store.get_entry("k-lost").status is EntryStatus.EXPIRED
    assert store.get_entry("k-live").status is EntryStatus.RUNNING
    assert store.get_entry("k-ahead").status is EntryStatus.RUNNING
    assert store.expire_passed([], ERROR) == set()


def test_stats_count_the_unclaimed_backlog_and_its_lapses(store: LedgerStore) -> None:
    """``stats``: published tasks no worker claimed yet, the oldest one's age, and how often
    their leases lapsed (each a re-send or a deferred one): what ``doctor`` and the metrics
    call a backlog."""
    for i in range(3):
        assert store.record_intent(request(f"k-q{i}", task_id=f"t-q{i}", lease=0.05))
    assert store.claim(request("k-ran", task_id="t-ran")).gate is Gate.RUN
    time.sleep(0.2)
    lapsed = store.interrupt_expired()
    assert {i.key for i in lapsed} == {"k-q0", "k-q1", "k-q2"}
    assert all(i.executions == 0 and i.created_at is not None for i in lapsed)
    won = store.begin_resume_many(
        [(i.key, i.fence) for i in lapsed], lease_seconds=60, event="deferred", detail="queued"
    )
    assert set(won) == {"k-q0", "k-q1", "k-q2"}
    stats = store.stats()
    assert stats.unclaimed == 3
    assert stats.unclaimed_lapses == 3
    assert stats.oldest_unclaimed_age >= 0.2
    assert "deferred" in [e.event for e in store.entry_events("k-q0")]


def test_the_gate_compares_deadlines_as_numbers_on_both_databases(store: LedgerStore) -> None:
    """SQLite 3.40 compares a column with the clock inside ``RETURNING`` wrongly for some
    values (1e10, year 2286, read as passed; 5e8, 1985, as ahead): the gate's comparisons are
    made on the values the statement returns, never in ``RETURNING`` itself."""
    far = dataclasses.replace(request("k-far", task_id="t-far"), deadline_at=1e10)
    assert store.claim(far).gate is Gate.RUN
    past = dataclasses.replace(request("k-past", task_id="t-past"), deadline_at=5e8)
    assert store.claim(past).gate is Gate.RETURN
    fence = store.get_entry("k-far").fence
    assert store.set_deadline("k-far", fence, at=2e10, after_created=None) is False
    run = store.claim(request("k-set", task_id="t-set"))
    assert store.set_deadline("k-set", run.fence, at=5e8, after_created=None) is True

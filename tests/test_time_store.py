"""Issue 18 at the store (SQLite and PostgreSQL): waking held entries, cancellation, deadlines,
tombstones. Each transition is a compare-and-set that one caller wins."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from test_store_contract import STEP, make_interrupted, request

from celery_ledger.ledger import (
    EntryNotFound,
    EntryStatus,
    Gate,
    LedgerStore,
    ReleaseRefused,
    StepStatus,
    Verdict,
)
from celery_ledger.ledger.schedule import PRUNED_FAILURE, cancelled_failure


def test_a_due_entry_is_woken_by_exactly_one_waker(store: LedgerStore) -> None:
    assert store.schedule(request("k-due", task_id="t-due"), due_in=-1.0)
    assert store.schedule(request("k-later", task_id="t-later"), due_in=3600.0)
    # An ETA is an absolute time; a deadline may come with it.
    assert store.schedule(
        request("k-eta", task_id="t-eta"), due_at=time.time() + 3600, deadline_at=time.time()
    )
    assert not store.schedule(request("k-eta", task_id="t-eta"), due_in=1.0), "key exists"
    due = store.list_due()
    assert [d.key for d in due] == ["k-due"]
    first = store.begin_wake("k-due", due[0].fence, EntryStatus.SCHEDULED, lease_seconds=60)
    second = store.begin_wake("k-due", due[0].fence, EntryStatus.SCHEDULED, lease_seconds=60)
    assert first is not None and second is None
    assert store.begin_wake("k-later", 1, EntryStatus.SCHEDULED, lease_seconds=60) is None
    entry = store.get_entry("k-due")
    assert entry.status is EntryStatus.RUNNING and entry.due_at is None
    # Its claim RUNs it (nothing executed yet); a delivery of the held one is held.
    assert store.claim(request("k-due", task_id="t-due")).gate is Gate.RUN
    assert store.claim(request("k-later", task_id="t-later")).gate is Gate.HOLD


def test_cancel_settles_idle_entries_and_marks_running_ones(store: LedgerStore) -> None:
    error = cancelled_failure("test")
    assert store.schedule(request("k-s", task_id="t-s"), due_in=-1.0)
    assert store.request_cancel("k-s", by="ops", reason="r", error=error).outcome == "cancelled"
    assert store.list_due() == [], "a cancelled entry is never woken"
    claim = store.claim(request("k-s", task_id="t-s"))
    assert claim.gate is Gate.RETURN and "TaskCancelled" in (claim.error or "")

    running = store.claim(request("k-r", task_id="t-r"))
    assert store.request_cancel("k-r", by="ops", reason="r", error=error).outcome == "requested"
    # A read step's completed write still lands; an effect step's start is refused.
    assert store.write_step(
        "k-r", running.fence, STEP, seq=1, status=StepStatus.COMPLETED, output="1"
    )
    second = ("email", "ih-email", 0)
    assert not store.write_step("k-r", running.fence, second, seq=2, status=StepStatus.STARTED)
    assert store.stop_reason("k-r", running.fence) == "cancelled"
    assert store.settle("k-r", running.fence, EntryStatus.CANCELLED, error=error)

    fence = make_interrupted(store, "k-i")
    assert fence
    store.request_cancel("k-i", by="ops", reason="r", error=error)
    assert store.get_entry("k-i").status is EntryStatus.CANCELLED


def test_a_pending_cancellation_without_a_live_attempt_is_settled_by_the_sweep(
    store: LedgerStore,
) -> None:
    error = cancelled_failure("test")
    claim = store.claim(request("k-gone", task_id="t-gone", lease=0.05))
    assert store.request_cancel("k-gone", by="ops", reason="r", error=error).outcome == "requested"
    time.sleep(0.2)
    assert store.finish_cancelled(error) == 1
    entry = store.get_entry("k-gone")
    assert entry.status is EntryStatus.CANCELLED and entry.fence == claim.fence + 1
    assert store.finish_cancelled(error) == 0


def test_a_passed_deadline_refuses_the_next_effect_start(store: LedgerStore) -> None:
    claim = store.claim(request("k-d", task_id="t-d"))
    assert (
        store.set_deadline("k-d", claim.fence, at=time.time() + 3600, after_created=None) is False
    )
    assert store.write_step("k-d", claim.fence, STEP, seq=1, status=StepStatus.STARTED)
    assert store.set_deadline("k-d", claim.fence, at=time.time() - 1, after_created=None) is True
    second = ("email", "ih-email", 0)
    assert not store.write_step("k-d", claim.fence, second, seq=2, status=StepStatus.STARTED)
    assert store.stop_reason("k-d", claim.fence) == "expired"
    assert store.set_deadline("k-d", claim.fence + 1, at=None, after_created=1.0) is None


def test_prune_to_tombstones_keeps_the_final_status_and_blocks_a_rerun(store: LedgerStore) -> None:
    for key, status in (("k-ok", EntryStatus.COMPLETED), ("k-bad", EntryStatus.FAILED)):
        claim = store.claim(request(key, task_id=f"t-{key}"))
        assert store.write_step(key, 1, STEP, seq=1, status=StepStatus.COMPLETED, output="1")
        assert store.settle(key, claim.fence, status, result="1", error="e")
    time.sleep(0.3)
    assert store.prune_settled(0.1, tombstone=PRUNED_FAILURE) == 2
    assert store.prune_settled(0.1, tombstone=PRUNED_FAILURE) == 0, "a tombstone is not pruned"
    ok, bad = store.get_entry("k-ok"), store.get_entry("k-bad")
    assert (ok.status, ok.result, ok.settled_at) == (EntryStatus.COMPLETED, None, None)
    assert ok.tombstone_at is not None and store.load_steps("k-ok") == ()
    assert "KeyPruned" in (bad.error or "")
    again = store.claim(request("k-ok", task_id="t-k-ok"))
    assert again.gate is Gate.RETURN and again.result is None
    assert store.prune_tombstones(3600) == 0
    assert store.prune_tombstones(0.0) == 2
    assert store.claim(request("k-ok", task_id="t-k-ok")).gate is Gate.RUN


def failed_tombstone(store: LedgerStore, key: str) -> None:
    """``key`` failed after its step ``charge`` completed, and retention pruned it to a
    tombstone (its settled time moved an hour back, so a one-minute window takes it)."""
    claim = store.claim(request(key, task_id=f"t-{key}"))
    assert store.write_step(key, claim.fence, STEP, seq=1, status=StepStatus.COMPLETED, output="1")
    assert store.settle(key, claim.fence, EntryStatus.FAILED, error="e")
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE ledger_entries SET settled_at = settled_at - 3600 WHERE key = :k"),
            {"k": key},
        )
    assert store.prune_settled(60.0, tombstone=PRUNED_FAILURE) == 1
    assert store.get_entry(key).tombstone_at is not None and store.load_steps(key) == ()


@pytest.mark.parametrize("verdict", [Verdict.NOT_EXECUTED, Verdict.COMPLETED])
def test_a_tombstone_is_not_releasable(store: LedgerStore, verdict: Verdict) -> None:
    """Issue 29: a ``failed`` entry pruned to a tombstone forgot its steps (``charge`` had
    completed). A release would re-run the whole body, charge included, while the duplicate
    rate says 0, and leave the tombstone stamp on a live row for the next prune to delete. It
    is refused in words that say why, and nothing changes."""
    failed_tombstone(store, "k-tomb")
    before = store.get_entry("k-tomb")
    events = store.entry_events("k-tomb")
    with pytest.raises(ReleaseRefused) as refused:
        store.release("k-tomb", verdict, by="alice", reason="customer asked", result="1")
    message = str(refused.value)
    assert "\n" not in message, message
    assert "tombstone" in message and "steps" in message and "completed" in message, message
    assert store.get_entry("k-tomb") == before
    assert store.entry_events("k-tomb") == events
    assert store.stats().duplicate_executions == 0
    assert store.prune_tombstones(0.0) == 1, "still a tombstone, deleted after its window"


def test_first_execution_is_the_first_claim_not_the_publish(store: LedgerStore) -> None:
    """Issue 29: a keyed body's key window runs from ``first_execution_at``: the first
    ``claimed`` event. A publish intent is created earlier and does not count; a takeover does
    not move it; without the event, ``created_at`` stands in."""
    assert store.record_intent(request("k-pub", task_id="t-pub"))
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE ledger_entries SET created_at = created_at - 60 WHERE key = 'k-pub'")
        )
    assert store.claim(request("k-pub", task_id="t-pub")).gate is Gate.RUN
    (claimed,) = [e.at for e in store.entry_events("k-pub") if e.event == "claimed"]
    entry = store.get_entry("k-pub")
    assert store.first_execution_at("k-pub") == claimed >= entry.created_at + 59
    make_interrupted(store, "k-run")
    (first,) = [e.at for e in store.entry_events("k-run") if e.event == "claimed"]
    assert store.claim(request("k-run")).gate is Gate.TAKEOVER
    assert store.first_execution_at("k-run") == first
    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM ledger_events WHERE key = 'k-run'"))
    assert store.first_execution_at("k-run") == store.get_entry("k-run").created_at
    with pytest.raises(EntryNotFound):
        store.first_execution_at("k-none")


def test_a_held_snapshot_is_sealed_and_the_wake_pass_opens_it(tmp_path) -> None:
    """With ``ledger_snapshot_keys`` a held task's snapshot is sealed like a worker's; the
    sweep wakes it with the key, and without the key leaves it for a process that has it."""
    from cryptography.fernet import Fernet

    from celery_ledger import LedgerTask, create_app, runtime
    from celery_ledger.ledger import cipher_from, entry_key, is_sealed
    from celery_ledger.recovery import run_sweep

    key = Fernet.generate_key().decode()
    app = create_app(
        "sealed-producer",
        data_dir=tmp_path,
        ledger_snapshot_keys=[key],
        ledger_hold_threshold_seconds=60,
    )

    @app.task(shared=False, base=LedgerTask, bind=True, name="sealed.remind")
    def remind(self: LedgerTask, card: str) -> str:
        return card

    result = remind.apply_async(("4242",), countdown=3600)
    store = runtime.store_for(app)
    k = entry_key("sealed.remind", result.id)
    entry = store.get_entry(k)
    assert entry.status is EntryStatus.SCHEDULED
    assert is_sealed(entry.snapshot) and "4242" not in entry.snapshot
    with store.engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(text("UPDATE ledger_entries SET due_at = 1 WHERE key = :k"), {"k": k})
    kw = {"lease_seconds": 60, "max_resumes": 5, "retention_days": 7}
    assert run_sweep(store, app, **kw).woken == 0, "woken without the key"
    assert store.get_entry(k).status is EntryStatus.SCHEDULED, "parked for a missing key"
    assert run_sweep(store, app, cipher=cipher_from([key]), **kw).woken == 1
    assert store.get_entry(k).status is EntryStatus.RUNNING

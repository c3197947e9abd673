"""Durable time (design.md § "Durable time") at the store (SQLite and PostgreSQL): waking held
entries, cancellation, deadlines,
tombstones. Each transition is a compare-and-set that one caller wins."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import text
from test_faults_store import pg_admin, wait_until, waiting_on_locks
from test_store_contract import STEP, make_interrupted, request, wait_lease_expired

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
    # Woken, it keeps its due time until a claim runs it; nothing lists it as due again.
    assert entry.status is EntryStatus.RUNNING and entry.due_at is not None
    assert store.list_due() == []
    # Its claim RUNs it (nothing executed yet); a delivery of the held one is held.
    assert store.claim(request("k-due", task_id="t-due")).gate is Gate.RUN
    assert store.get_entry("k-due").due_at is None
    assert store.claim(request("k-later", task_id="t-later")).gate is Gate.HOLD


def _woken(store: LedgerStore, key: str, status: EntryStatus, *, lease: float = 60.0) -> int:
    """Claim ``key``, run it, settle it ``status`` (already due: a held retry, or a sleep),
    and wake it as the sweep does. Returns the woken fence."""
    claim = store.claim(request(key, task_id=f"t-{key}"))
    assert claim.gate is Gate.RUN
    assert store.settle(key, claim.fence, status, due_in=-1.0)
    due = [d for d in store.list_due() if d.key == key]
    assert len(due) == 1
    woke = store.begin_wake(key, due[0].fence, status, lease_seconds=lease)
    assert woke is not None
    return woke[0].fence


def test_the_wake_of_a_clean_settle_is_rerun_not_taken_over(store: LedgerStore) -> None:
    """An attempt that settled ``scheduled`` (a held retry) or ``sleeping`` left nothing
    ambiguous: the claim of its wake RUNs it like a ``retrying`` entry (steps replay), also
    when the wake's message was lost and its lease lapsed. Once an attempt has claimed it, a
    crash of that attempt is a takeover again."""
    for status in (EntryStatus.SCHEDULED, EntryStatus.SLEEPING):
        key = f"k-woken-{status.value}"
        _woken(store, key, status)
        claim = store.claim(request(key, task_id=f"t-{key}"))
        assert claim.gate is Gate.RUN, (status, claim.gate)
        assert claim.executions == 1

    # The wake's message is lost: the resume marker's lease lapses, the sweep interrupts
    # and resumes it. Still nothing ran since the clean settle: RUN, no interruption counted.
    _woken(store, "k-lost", EntryStatus.SCHEDULED, lease=0.05)
    wait_lease_expired(store, "k-lost")
    assert [i.key for i in store.interrupt_expired()] == ["k-lost"]
    interrupted = store.get_entry("k-lost")
    assert interrupted.interruptions == 0
    assert store.begin_resume("k-lost", interrupted.fence, lease_seconds=60) is not None
    assert store.claim(request("k-lost", task_id="t-k-lost")).gate is Gate.RUN

    # A late delivery of the lost wake claims the interrupted entry directly: RUN too.
    _woken(store, "k-late", EntryStatus.SLEEPING, lease=0.05)
    wait_lease_expired(store, "k-late")
    store.interrupt_expired()
    assert store.get_entry("k-late").status is EntryStatus.INTERRUPTED
    assert store.claim(request("k-late", task_id="t-k-late")).gate is Gate.RUN

    # The attempt that claimed the wake dies: its body may have run, a takeover decides.
    _woken(store, "k-died", EntryStatus.SCHEDULED)
    assert store.claim(request("k-died", task_id="t-k-died", lease=0.05)).gate is Gate.RUN
    wait_lease_expired(store, "k-died")
    store.interrupt_expired()
    assert store.claim(request("k-died", task_id="t-k-died")).gate is Gate.TAKEOVER


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
    """guarantees.md § "The seams", fault 10: a ``failed`` entry pruned to a tombstone forgot its
    steps (``charge`` had
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
    """guarantees.md § "The seams", fault 11: a keyed body's key window runs from
    ``first_execution_at``: the first
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


# -- the sweep's finishing of pending cancellations (design.md § "One envelope, one admission gate")


def _pending_cancel_past_lease(store: LedgerStore, key: str) -> int:
    """A running entry with a pending cancellation whose lease ran out; returns its fence."""
    claim = store.claim(request(key, task_id=f"t-{key}", lease=0.05))
    assert claim.gate is Gate.RUN
    assert store.request_cancel(key, by="ops", reason="r", error="e").outcome == "requested"
    wait_lease_expired(store, key)
    return claim.fence


@pytest.mark.parametrize("racer", ["settle", "renew"])
def test_finish_cancelled_loses_to_a_settle_or_renewal_that_commits_first(
    ledger_url: str, racer: str
) -> None:
    """guarantees.md § "The seams", fault 5. The sweep's ``finish_cancelled`` picked a running entry
    past its
    lease with a pending cancellation; before its update reaches the row, the attempt settles
    ``completed`` (or renews its lease) and commits. The finishing update must re-check what
    it picked, in its own WHERE, and leave the row alone: the work completed (or is alive).

    PostgreSQL: the interleaving is made deterministic with row locks (as in
    ``test_faults_store``'s fault 1). A third connection holds the row; the attempt's write
    queues on it first, the sweep's statement second (its pick of candidates is read at its
    start, before the attempt commits); then the lock is let go. SQLite runs one writer at a
    time (``BEGIN IMMEDIATE``), so the sweep's read and write cannot be split: the attempt's
    write commits before the sweep's statement, which must then leave the row alone too.
    """
    error = cancelled_failure("test")
    store = LedgerStore(ledger_url)
    results: dict[str, Any] = {}

    def attempt() -> None:
        if racer == "settle":
            results["attempt"] = store.settle(key, fence, EntryStatus.COMPLETED, result='"done"')
        else:
            results["attempt"] = store.renew_lease(key, fence, 60.0)

    def finish() -> None:
        results["finished"] = store.finish_cancelled(error)

    key = f"k-race-{racer}"
    try:
        fence = _pending_cancel_past_lease(store, key)
        if store.is_sqlite:
            attempt()
            finish()
        else:
            admin = pg_admin(ledger_url)
            holder = pg_admin(ledger_url)
            try:
                holder.execute("BEGIN")
                holder.execute("SELECT key FROM ledger_entries WHERE key = %s FOR UPDATE", (key,))
                first = threading.Thread(target=attempt, daemon=True)
                first.start()
                wait_until(lambda: waiting_on_locks(admin) >= 1, timeout=20, what="the attempt")
                second = threading.Thread(target=finish, daemon=True)
                second.start()
                wait_until(lambda: waiting_on_locks(admin) >= 2, timeout=20, what="the sweep")
                holder.execute("ROLLBACK")
                first.join(timeout=30)
                second.join(timeout=30)
                assert not first.is_alive() and not second.is_alive()
            finally:
                holder.close()
                admin.close()
        assert results["attempt"] is True, f"the attempt's {racer} was refused"
        entry = store.get_entry(key)
        expected = EntryStatus.COMPLETED if racer == "settle" else EntryStatus.RUNNING
        assert (entry.status, entry.fence) == (expected, fence), (
            f"finish_cancelled overwrote a {racer} that committed first: entry is "
            f"{entry.status.value} at fence {entry.fence}, error {entry.error!r}"
        )
        assert results["finished"] == 0
        if racer == "settle":
            again = store.claim(request(key, task_id=f"t-{key}"))
            assert again.gate is Gate.RETURN and again.error is None and again.result == '"done"'
    finally:
        store.dispose()


def test_finishing_a_cancellation_over_a_started_effect_step_blocks_the_entry(
    store: LedgerStore,
) -> None:
    """design.md § "One envelope, one admission gate". The attempt started ``charge`` (a ``started``
    row, no outcome) and vanished
    with a cancellation pending. ``charge`` may have run: settling ``cancelled`` would tell
    every later delivery that nothing happened. The sweep parks the entry ``blocked`` with a
    reason that says the cancellation was asked and ``charge`` may have executed, and an
    operator decides (``release``). An entry whose steps all completed is still settled
    ``cancelled``, and so is one interrupted (no live attempt) with no started step."""
    error = cancelled_failure("test")
    started = store.claim(request("k-started", task_id="t-started", lease=0.05))
    assert store.write_step("k-started", started.fence, STEP, seq=1, status=StepStatus.STARTED)
    done = store.claim(request("k-done", task_id="t-done", lease=0.05))
    email = ("email", "ih-email", 0)
    assert store.write_step("k-done", done.fence, email, seq=1, status=StepStatus.STARTED)
    assert store.write_step(
        "k-done", done.fence, email, seq=1, status=StepStatus.COMPLETED, output="1"
    )
    for key in ("k-started", "k-done"):
        assert store.request_cancel(key, by="ops", reason="r", error=error).outcome == "requested"
        wait_lease_expired(store, key)

    assert store.finish_cancelled(error) == 2
    blocked = store.get_entry("k-started")
    assert blocked.status is EntryStatus.BLOCKED, (
        f"a cancellation finished over the started step 'charge' as {blocked.status.value}, "
        "with no sign that the step may have run"
    )
    assert blocked.fence == started.fence + 1 and blocked.settled_at is None
    assert "cancel" in (blocked.reason or "") and "'charge' may have executed" in (
        blocked.reason or ""
    )
    assert [e.event for e in store.entry_events("k-started")][-1] == "blocked"
    claim = store.claim(request("k-started", task_id="t-started"))
    assert claim.gate is Gate.BLOCK and "'charge' may have executed" in (claim.reason or "")
    assert store.get_entry("k-done").status is EntryStatus.CANCELLED
    assert store.finish_cancelled(error) == 0, "a blocked entry is not finished again"

"""The store's contract, run on SQLite and PostgreSQL (the ``store`` / ``ledger_url`` fixtures).

Every test here states one promise of ``ledger.LedgerStore`` and checks the rows behind it:
claim gates, fencing, replay rows, the audit trail, sweeps, operator release, and the races the
primary key and the compare-and-set updates must win. Time passes through short leases
(``LEASE_SHORT``), never through long sleeps.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from celery_ledger.ledger import (
    BODY_STEP,
    NO_ARGS_HASH,
    RESUME_OWNER,
    Claim,
    ClaimRequest,
    CrashLoop,
    EntryNotFound,
    EntryStatus,
    Gate,
    LedgerStore,
    LedgerUnavailable,
    OperatorTextError,
    Owner,
    ReleaseRefused,
    StepRecord,
    StepStatus,
    Verdict,
    crash_loop_reason,
)
from celery_ledger.ledger import errors as ledger_errors
from celery_ledger.ledger import statements as sql

#: A lease that expires almost at once, so takeovers need no real waiting.
LEASE_SHORT = 0.05
#: A lease that stays live for the whole test.
LEASE_LONG = 60.0

OWNER = Owner("worker-a@host", "boot-a1", 101)
OTHER = Owner("worker-b@host", "boot-b1", 202)
STEP = ("charge", "ih-charge", 0)

#: Rounds per race: enough to catch a race that wins only sometimes, few enough for 2 cores.
RACE_ROUNDS = 4
RACE_THREADS = 16
RACE_PROCESSES = 4


def request(
    key: str = "key-1",
    *,
    owner: Owner = OWNER,
    args_hash: str = "args-1",
    lease: float = LEASE_LONG,
    max_interruptions: int = 5,
    task_id: str = "tid-1",
    snapshot: str | None = '{"args":[1],"kwargs":{}}',
) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="shop.charge",
        task_id=task_id,
        args_hash=args_hash,
        snapshot=snapshot,
        side_effect="non_idempotent",
        owner=owner,
        lease_seconds=lease,
        max_interruptions=max_interruptions,
    )


def wait_lease_expired(store: LedgerStore, key: str, timeout: float = 60.0) -> None:
    """Poll the database clock until ``key``'s lease is over (bounded). The bound only ends a
    lease that never runs out: on a loaded machine a few seconds were not enough."""
    deadline = time.monotonic() + timeout
    while True:
        found = store.peek_status(key)
        assert found is not None, f"{key} vanished"
        left = found[1]
        if left is None or left < 0:
            return
        assert time.monotonic() < deadline, f"lease of {key} did not expire in {timeout}s"
        time.sleep(min(max(left, 0.01), 0.1))


def events_of(store: LedgerStore, key: str) -> list[tuple[str, int | None, str | None]]:
    return [(e.event, e.fence, e.actor) for e in store.entry_events(key)]


def last_event(store: LedgerStore, key: str) -> tuple[str, int | None, str | None]:
    return events_of(store, key)[-1]


def step_row(store: LedgerStore, key: str, name: str = STEP[0]) -> StepRecord:
    rows = [s for s in store.load_steps(key) if s.name == name]
    assert len(rows) == 1, rows
    return rows[0]


def run_and_expire(store: LedgerStore, key: str = "key-1", **kw: Any) -> Claim:
    """Claim ``key`` with a short lease and let that lease run out."""
    claim = store.claim(request(key, lease=LEASE_SHORT, **kw))
    assert claim.gate is Gate.RUN
    wait_lease_expired(store, key)
    return claim


def make_interrupted(store: LedgerStore, key: str = "key-1", **kw: Any) -> int:
    """Put ``key`` in ``interrupted`` through the stale-lease sweep; return its fence."""
    run_and_expire(store, key, **kw)
    marked = [i for i in store.interrupt_expired() if i.key == key]
    assert len(marked) == 1
    assert store.get_entry(key).status is EntryStatus.INTERRUPTED
    return marked[0].fence


# == claim gates ==========================================================================


def test_new_key_runs_with_fence_1(store: LedgerStore) -> None:
    claim = store.claim(request())
    assert (claim.gate, claim.fence, claim.found, claim.executions) == (Gate.RUN, 1, None, 0)
    entry = store.get_entry("key-1")
    assert entry.status is EntryStatus.RUNNING
    assert (entry.fence, entry.executions, entry.interruptions) == (1, 1, 0)
    assert (entry.owner, entry.owner_boot, entry.owner_pid) == (OWNER.node, OWNER.boot, OWNER.pid)
    assert entry.snapshot == '{"args":[1],"kwargs":{}}'
    assert entry.lease_until is not None
    assert LEASE_LONG - 5 < entry.lease_until - store.now() <= LEASE_LONG
    assert events_of(store, "key-1") == [("claimed", 1, OWNER.node)]


def test_live_lease_waits(store: LedgerStore) -> None:
    store.claim(request())
    claim = store.claim(request(owner=OTHER, task_id="tid-2"))
    assert (claim.gate, claim.fence, claim.found) == (Gate.WAIT, 1, EntryStatus.RUNNING)
    assert claim.lease_remaining is not None
    assert LEASE_LONG - 5 < claim.lease_remaining <= LEASE_LONG
    # The same worker process seeing a redelivery of its own running task waits too.
    assert store.claim(request(task_id="tid-3")).gate is Gate.WAIT
    entry = store.get_entry("key-1")
    assert (entry.fence, entry.owner, entry.task_id, entry.executions) == (
        1,
        OWNER.node,
        "tid-1",
        1,
    )
    assert events_of(store, "key-1")[1:] == [("waited", 1, OTHER.node), ("waited", 1, OWNER.node)]


def test_completed_returns_stored_result(store: LedgerStore) -> None:
    store.claim(request())
    assert store.settle("key-1", 1, EntryStatus.COMPLETED, result='{"ok":true}', actor="w")
    claim = store.claim(request(owner=OTHER))
    assert (claim.gate, claim.fence, claim.found) == (Gate.RETURN, 1, EntryStatus.COMPLETED)
    assert (claim.result, claim.error) == ('{"ok":true}', None)
    entry = store.get_entry("key-1")
    assert entry.status is EntryStatus.COMPLETED
    assert entry.settled_at is not None and entry.lease_until is None
    assert entry.executions == 1
    assert events_of(store, "key-1")[1:] == [("settled", 1, "w"), ("returned", 1, OTHER.node)]


def test_failed_returns_stored_error(store: LedgerStore) -> None:
    store.claim(request())
    assert store.settle("key-1", 1, EntryStatus.FAILED, error='{"exc":"ValueError"}')
    claim = store.claim(request(owner=OTHER))
    assert (claim.gate, claim.found) == (Gate.RETURN, EntryStatus.FAILED)
    assert (claim.result, claim.error) == (None, '{"exc":"ValueError"}')
    assert store.get_entry("key-1").status is EntryStatus.FAILED
    assert last_event(store, "key-1") == ("returned", 1, OTHER.node)


def test_retrying_reruns_with_fence_plus_one_and_replay(store: LedgerStore) -> None:
    store.claim(request())
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.COMPLETED, output="7")
    assert store.settle("key-1", 1, EntryStatus.RETRYING, actor=OWNER.node)
    entry = store.get_entry("key-1")
    assert entry.status is EntryStatus.RETRYING and entry.settled_at is None

    claim = store.claim(request(owner=OTHER, task_id="tid-1"))
    assert (claim.gate, claim.fence, claim.found) == (Gate.RUN, 2, EntryStatus.RETRYING)
    assert claim.executions == 1
    assert [(s.name, s.status, s.output, s.fence) for s in claim.steps] == [
        ("charge", StepStatus.COMPLETED, "7", 1)
    ]
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.owner) == (EntryStatus.RUNNING, 2, OTHER.node)
    assert (entry.executions, entry.interruptions) == (2, 0)
    assert last_event(store, "key-1") == ("rerun", 2, OTHER.node)


def test_expired_lease_is_taken_over_and_counted(store: LedgerStore) -> None:
    run_and_expire(store)
    # Expiry alone fences nothing (the old attempt may only be paused): until someone takes
    # over, the holder of fence 1 may still write.
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    claim = store.claim(request(owner=OTHER, task_id="tid-2"))
    assert (claim.gate, claim.fence, claim.found) == (Gate.TAKEOVER, 2, EntryStatus.RUNNING)
    assert claim.executions == 1
    assert [(s.name, s.status, s.fence) for s in claim.steps] == [("charge", StepStatus.STARTED, 1)]
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.owner, entry.task_id) == (
        EntryStatus.RUNNING,
        2,
        OTHER.node,
        "tid-2",
    )
    assert (entry.executions, entry.interruptions) == (2, 1)
    assert entry.lease_until is not None and entry.lease_until > store.now()
    assert last_event(store, "key-1") == ("takeover", 2, OTHER.node)


def test_interrupted_is_taken_over(store: LedgerStore) -> None:
    fence = make_interrupted(store)
    assert fence == 2
    claim = store.claim(request(owner=OTHER))
    assert (claim.gate, claim.fence, claim.found) == (Gate.TAKEOVER, 3, EntryStatus.INTERRUPTED)
    entry = store.get_entry("key-1")
    # The sweep counted the interruption; the takeover must not count it again.
    assert (entry.status, entry.fence, entry.interruptions) == (EntryStatus.RUNNING, 3, 1)
    assert last_event(store, "key-1") == ("takeover", 3, OTHER.node)


def test_blocked_blocks(store: LedgerStore) -> None:
    store.claim(request())
    assert store.settle("key-1", 1, EntryStatus.BLOCKED, reason="step charge may have run")
    claim = store.claim(request(owner=OTHER))
    assert (claim.gate, claim.fence, claim.found) == (Gate.BLOCK, 1, EntryStatus.BLOCKED)
    assert claim.reason == "step charge may have run"
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.executions) == (EntryStatus.BLOCKED, 1, 1)
    assert entry.settled_at is None, "blocked is not settled: it must never be pruned"
    assert last_event(store, "key-1") == ("block-gate", 1, OTHER.node)


def test_same_key_different_arguments_conflicts(store: LedgerStore) -> None:
    store.claim(request())
    store.settle("key-1", 1, EntryStatus.COMPLETED, result="1")
    claim = store.claim(request(owner=OTHER, args_hash="args-2"))
    assert (claim.gate, claim.found) == (Gate.CONFLICT, EntryStatus.COMPLETED)
    assert claim.result is None, "a conflicting delivery must not receive another's result"
    entry = store.get_entry("key-1")
    assert (entry.status, entry.args_hash, entry.fence) == (EntryStatus.COMPLETED, "args-1", 1)
    event = store.entry_events("key-1")[-1]
    assert (event.event, event.actor) == ("conflict", OTHER.node)
    assert event.detail is not None and "args-2" in event.detail


def test_arguments_that_may_change_take_the_new_hash_instead_of_a_conflict(
    store: LedgerStore,
) -> None:
    """guarantees.md § "The hardening faults", fault 13: a retry of an entry keyed by its task id
    may change its arguments
    (``args_may_change``); the claim stores the new hash with the fence it takes, so that the
    next fresh delivery is checked against it."""
    store.claim(request())
    store.settle("key-1", 1, EntryStatus.RETRYING)
    retry = replace(request(owner=OTHER, args_hash="args-2"), args_may_change=True)
    claim = store.claim(retry)
    assert (claim.gate, claim.fence) == (Gate.RUN, 2)
    assert store.get_entry("key-1").args_hash == "args-2"
    store.settle("key-1", 2, EntryStatus.COMPLETED, result="2")
    assert store.claim(request(owner=OTHER)).gate is Gate.CONFLICT  # a fresh one, args-1
    assert store.claim(request(owner=OTHER, args_hash="args-2")).gate is Gate.RETURN


def test_an_entry_without_an_arguments_hash_conflicts_with_nothing(store: LedgerStore) -> None:
    """Entries keyed by task id held ``NO_ARGS_HASH`` ("task-id") before their arguments were
    hashed: that is "no hash". A takeover stores the real one."""
    store.claim(request(args_hash=NO_ARGS_HASH, lease=LEASE_SHORT))
    wait_lease_expired(store, "key-1")
    claim = store.claim(request(owner=OTHER, args_hash="args-2"))
    assert claim.gate is Gate.TAKEOVER
    assert store.get_entry("key-1").args_hash == "args-2"
    store.claim(request(key="key-2", args_hash=NO_ARGS_HASH))
    store.settle("key-2", 1, EntryStatus.COMPLETED, result="1")
    assert store.claim(request(key="key-2", owner=OTHER, args_hash="x")).gate is Gate.RETURN


def test_previous_boot_of_same_node_is_taken_over(store: LedgerStore) -> None:
    store.claim(request())  # long lease, still live
    reboot = Owner(OWNER.node, "boot-a2", 303)
    claim = store.claim(request(owner=reboot))
    assert (claim.gate, claim.fence, claim.found) == (Gate.TAKEOVER, 2, EntryStatus.RUNNING)
    entry = store.get_entry("key-1")
    assert (entry.owner_boot, entry.owner_pid, entry.interruptions) == ("boot-a2", 303, 1)


def test_resume_owner_is_taken_over_at_once(store: LedgerStore) -> None:
    fence = make_interrupted(store)
    resumed = store.begin_resume("key-1", fence, lease_seconds=LEASE_LONG)
    assert resumed is not None and resumed.fence == fence + 1
    entry = store.get_entry("key-1")
    assert (entry.status, entry.owner) == (EntryStatus.RUNNING, RESUME_OWNER)
    assert entry.lease_until is not None and entry.lease_until > store.now()
    claim = store.claim(request(owner=OTHER))
    assert (claim.gate, claim.fence, claim.found) == (Gate.TAKEOVER, fence + 2, EntryStatus.RUNNING)
    entry = store.get_entry("key-1")
    assert (entry.owner, entry.interruptions) == (OTHER.node, 1)


def test_crash_loop_is_blocked_with_the_count(store: LedgerStore) -> None:
    run_and_expire(store, max_interruptions=1)
    first = store.claim(request(owner=OTHER, lease=LEASE_SHORT, max_interruptions=1))
    assert (first.gate, first.fence) == (Gate.TAKEOVER, 2)
    wait_lease_expired(store, "key-1")
    loop = store.claim(request(max_interruptions=1))
    assert (loop.gate, loop.fence) == (Gate.BLOCK, 3)
    assert loop.reason is not None
    assert "crash loop" in loop.reason and "2 times" in loop.reason
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.interruptions) == (EntryStatus.BLOCKED, 3, 2)
    assert entry.reason == loop.reason and entry.lease_until is None
    assert entry.executions == 2, "the blocked claim must not count as an execution"
    assert last_event(store, "key-1") == ("blocked", 3, OWNER.node)
    assert store.claim(request(max_interruptions=1)).gate is Gate.BLOCK


@pytest.mark.parametrize("max_resumes", [0, 2])
def test_claim_and_sweep_decide_a_crash_loop_by_the_ledgers_one_rule(
    store: LedgerStore, max_resumes: int
) -> None:
    """The claim (taking over from a lost attempt) and the sweep (before it resumes) block at
    the same count, with the same reason: both ask ``crash_loop_reason``."""
    assert crash_loop_reason(max_resumes, max_resumes) is None
    reason = crash_loop_reason(max_resumes + 1, max_resumes)
    assert reason == (
        f"crash loop: interrupted {max_resumes + 1} times (ledger_max_resumes={max_resumes})"
    )

    # The claim: every expired attempt it takes over from counts one interruption.
    run_and_expire(store, "by-claim", max_interruptions=max_resumes)
    for n in range(1, max_resumes + 2):
        claim = store.claim(
            request("by-claim", lease=LEASE_SHORT, max_interruptions=max_resumes, task_id=f"t{n}")
        )
        if n <= max_resumes:
            assert claim.gate is Gate.TAKEOVER, (n, claim)
            wait_lease_expired(store, "by-claim")
    assert (claim.gate, claim.reason) == (Gate.BLOCK, reason)
    entry = store.get_entry("by-claim")
    assert (entry.status, entry.reason, entry.interruptions) == (
        EntryStatus.BLOCKED,
        reason,
        max_resumes + 1,
    )
    blocked = store.entry_events("by-claim")[-1]
    # The event names the delivery that found the loop; the entry keeps the task id it ran.
    assert (blocked.event, blocked.task_id, blocked.detail) == ("blocked", f"t{n}", reason)
    assert entry.task_id == (f"t{n - 1}" if max_resumes else "tid-1")

    # The sweep: every expired lease it interrupts counts one; it asks the ledger first.
    run_and_expire(store, "by-sweep", max_interruptions=max_resumes)
    for n in range(1, max_resumes + 2):
        (lost,) = [i for i in store.interrupt_expired() if i.key == "by-sweep"]
        assert lost.interruptions == n
        found = store.block_crash_loop(lost, max_resumes=max_resumes, actor="sweep")
        if n <= max_resumes:
            assert found is None
            assert store.begin_resume("by-sweep", lost.fence, lease_seconds=LEASE_LONG)
            again = store.claim(
                request("by-sweep", lease=LEASE_SHORT, max_interruptions=max_resumes)
            )
            assert again.gate is Gate.TAKEOVER, (n, again)
            wait_lease_expired(store, "by-sweep")
    assert found == CrashLoop(reason, blocked=True)
    entry = store.get_entry("by-sweep")
    assert (entry.status, entry.reason, entry.fence) == (
        EntryStatus.BLOCKED,
        reason,
        lost.fence + 1,
    )
    assert last_event(store, "by-sweep") == ("blocked", lost.fence + 1, "sweep")
    # A second sweeper with the same view: the same decision, a lost race, nothing written.
    assert store.block_crash_loop(lost, max_resumes=max_resumes, actor="sweep-2") == CrashLoop(
        reason, blocked=False
    )
    assert last_event(store, "by-sweep") == ("blocked", lost.fence + 1, "sweep")


def test_crash_loop_via_sweep_is_blocked(store: LedgerStore) -> None:
    fence = make_interrupted(store)  # interruptions == 1
    claim = store.claim(request(owner=OTHER, max_interruptions=0))
    assert (claim.gate, claim.fence) == (Gate.BLOCK, fence + 1)
    assert claim.reason is not None and "1 times" in claim.reason


# == fencing ==============================================================================


def test_superseded_fence_writes_nothing(store: LedgerStore) -> None:
    run_and_expire(store)
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    takeover = store.claim(request(owner=OTHER, task_id="tid-2"))
    assert (takeover.gate, takeover.fence) == (Gate.TAKEOVER, 2)
    entry_before = store.get_entry("key-1")
    steps_before = store.load_steps("key-1")
    events_before = store.entry_events("key-1")

    assert store.renew_lease("key-1", 1, LEASE_LONG * 10) is False
    assert (
        store.write_step("key-1", 1, ("other", "ih", 0), seq=2, status=StepStatus.STARTED) is False
    )
    assert (
        store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.COMPLETED, output="stale")
        is False
    )
    assert store.record_external_ref("key-1", 1, STEP, "ch_stale") is False
    assert store.settle("key-1", 1, EntryStatus.COMPLETED, result="stale") is False

    assert store.get_entry("key-1") == entry_before
    assert store.load_steps("key-1") == steps_before
    assert store.entry_events("key-1") == events_before

    # The new fence may write all of it.
    assert store.renew_lease("key-1", 2, LEASE_LONG)
    assert store.record_external_ref("key-1", 2, STEP, "ch_new")
    assert step_row(store, "key-1").external_ref == "ch_new"
    assert store.settle("key-1", 2, EntryStatus.COMPLETED, result="1")


def test_sweep_fence_bump_stops_a_paused_attempt(store: LedgerStore) -> None:
    make_interrupted(store)
    assert store.renew_lease("key-1", 1, LEASE_LONG) is False
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED) is False
    assert store.settle("key-1", 1, EntryStatus.FAILED, error="late") is False
    entry = store.get_entry("key-1")
    assert (entry.status, entry.error, entry.lease_until) == (EntryStatus.INTERRUPTED, None, None)
    assert store.load_steps("key-1") == ()


def test_settled_entry_refuses_further_writes(store: LedgerStore) -> None:
    store.claim(request())
    assert store.settle("key-1", 1, EntryStatus.COMPLETED, result="1")
    assert store.renew_lease("key-1", 1, LEASE_LONG) is False
    assert store.settle("key-1", 1, EntryStatus.FAILED, error="x") is False
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED) is False
    assert store.get_entry("key-1").result == "1"


def test_settle_rejects_running_and_interrupted(store: LedgerStore) -> None:
    store.claim(request())
    for status in (EntryStatus.RUNNING, EntryStatus.INTERRUPTED):
        with pytest.raises(ValueError, match=status.value):
            store.settle("key-1", 1, status)


def test_renew_lease_extends_on_the_database_clock(store: LedgerStore) -> None:
    store.claim(request(lease=LEASE_SHORT))
    assert store.renew_lease("key-1", 1, LEASE_LONG)
    found = store.peek_status("key-1")
    assert found is not None and found[0] is EntryStatus.RUNNING
    assert found[1] is not None and LEASE_LONG - 5 < found[1] <= LEASE_LONG
    assert store.peek_status("no-such-key") is None


# == replay rows ==========================================================================


def test_step_started_then_completed(store: LedgerStore) -> None:
    store.claim(request())
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    row = step_row(store, "key-1")
    assert (row.status, row.fence, row.seq, row.output, row.completed_at) == (
        StepStatus.STARTED,
        1,
        1,
        None,
        None,
    )
    assert row.ident == STEP and row.started_at is not None
    assert store.record_external_ref("key-1", 1, STEP, "ch_123")
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.COMPLETED, output='"ok"')
    row = step_row(store, "key-1")
    assert (row.status, row.output, row.external_ref) == (StepStatus.COMPLETED, '"ok"', "ch_123")
    assert row.completed_at is not None and row.started_at is not None
    assert row.completed_at >= row.started_at
    assert (row.attempts, row.authorized) == (1, 0)


def test_record_external_ref_needs_a_step_row(store: LedgerStore) -> None:
    """guarantees.md § "The hardening faults", fault 8: a live attempt whose step has no row (a step
    that records no intent)
    is a usage error, never "superseded"; a moved fence is the lost race, and says so."""
    store.claim(request())
    with pytest.raises(ValueError, match="no started row"):
        store.record_external_ref("key-1", 1, STEP, "ch_1")
    assert store.load_steps("key-1") == ()
    assert store.record_external_ref("key-1", 2, STEP, "ch_1") is False  # not the fence
    assert store.settle("key-1", 1, EntryStatus.RETRYING)
    assert store.record_external_ref("key-1", 1, STEP, "ch_1") is False  # not running
    assert store.load_steps("key-1") == ()


def test_completed_step_is_never_overwritten(store: LedgerStore) -> None:
    store.claim(request())
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.COMPLETED, output="1")
    before = step_row(store, "key-1")
    # A second write onto a completed row changes nothing (and reports that nothing changed).
    assert (
        store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.COMPLETED, output="2") is False
    )
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED) is False
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.NOT_EXECUTED) is False
    assert step_row(store, "key-1") == before
    # ... and neither does a later attempt.
    assert store.settle("key-1", 1, EntryStatus.RETRYING)
    assert store.claim(request()).fence == 2
    assert (
        store.write_step("key-1", 2, STEP, seq=1, status=StepStatus.COMPLETED, output="3") is False
    )
    assert step_row(store, "key-1") == before


def test_occurrences_are_separate_rows_in_execution_order(store: LedgerStore) -> None:
    store.claim(request())
    for occurrence, seq in ((0, 1), (1, 3)):
        assert store.write_step(
            "key-1",
            1,
            ("poll", "ih", occurrence),
            seq=seq,
            status=StepStatus.COMPLETED,
            output=str(occurrence),
        )
    assert store.write_step(
        "key-1", 1, ("notify", "ih2", 0), seq=2, status=StepStatus.COMPLETED, output="n"
    )
    rows = store.load_steps("key-1")
    assert [(r.name, r.occurrence, r.seq, r.output) for r in rows] == [
        ("poll", 0, 1, "0"),
        ("notify", 0, 2, "n"),
        ("poll", 1, 3, "1"),
    ]


def test_released_step_rerun_is_authorized_not_duplicate(store: LedgerStore) -> None:
    run_and_expire(store)
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    fence = [i.fence for i in store.interrupt_expired()][0]
    release = store.release("key-1", Verdict.NOT_EXECUTED, by="ops", reason="provider: no charge")
    assert release.fence == fence + 1
    row = step_row(store, "key-1")
    assert (row.status, row.attempts, row.authorized) == (StepStatus.NOT_EXECUTED, 1, 1)

    claim = store.claim(request(owner=OTHER))
    assert claim.gate is Gate.TAKEOVER
    assert [s.status for s in claim.steps] == [StepStatus.NOT_EXECUTED]
    assert store.write_step("key-1", claim.fence, STEP, seq=1, status=StepStatus.STARTED)
    row = step_row(store, "key-1")
    assert (row.status, row.attempts, row.authorized) == (StepStatus.STARTED, 2, 1)
    assert store.write_step(
        "key-1", claim.fence, STEP, seq=1, status=StepStatus.COMPLETED, output="1"
    )
    row = step_row(store, "key-1")
    assert (row.status, row.attempts, row.authorized) == (StepStatus.COMPLETED, 2, 1)
    stats = store.stats()
    assert (stats.entries, stats.duplicate_executions) == (1, 0)
    assert stats.duplicate_execution_rate == 0.0


def test_reconciled_not_executed_rerun_in_same_attempt_is_counted(store: LedgerStore) -> None:
    # The reconciler path: the resuming attempt records not_executed and re-runs the step
    # with its own fence. The re-run is one more attempt, and one authorized.
    run_and_expire(store)
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    claim = store.claim(request(owner=OTHER))
    assert store.write_step(
        "key-1",
        claim.fence,
        STEP,
        seq=1,
        status=StepStatus.NOT_EXECUTED,
        error="reconciler: no charge found",
    )
    row = step_row(store, "key-1")
    assert (row.status, row.attempts, row.authorized) == (StepStatus.NOT_EXECUTED, 1, 1)
    assert store.write_step("key-1", claim.fence, STEP, seq=1, status=StepStatus.STARTED)
    assert store.write_step(
        "key-1", claim.fence, STEP, seq=1, status=StepStatus.COMPLETED, output="1"
    )
    row = step_row(store, "key-1")
    assert (row.status, row.attempts, row.authorized) == (StepStatus.COMPLETED, 2, 1)
    assert store.stats().duplicate_executions == 0


def test_reconciled_completed_is_not_an_execution(store: LedgerStore) -> None:
    # A reconciler that proves the step completed stores its output from the new fence; the
    # body did not run again, so no attempt is added.
    run_and_expire(store)
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    claim = store.claim(request(owner=OTHER))
    assert store.write_step(
        "key-1", claim.fence, STEP, seq=1, status=StepStatus.COMPLETED, output='"found"'
    )
    row = step_row(store, "key-1")
    assert (row.status, row.fence, row.attempts) == (StepStatus.COMPLETED, claim.fence, 1)
    assert store.stats().duplicate_executions == 0


def test_unauthorized_restart_is_a_duplicate(store: LedgerStore) -> None:
    run_and_expire(store)
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    claim = store.claim(request(owner=OTHER))
    assert store.write_step("key-1", claim.fence, STEP, seq=1, status=StepStatus.STARTED)
    row = step_row(store, "key-1")
    assert (row.attempts, row.authorized, row.fence) == (2, 0, claim.fence)
    stats = store.stats()
    assert (stats.entries, stats.duplicate_executions) == (1, 1)
    assert stats.duplicate_execution_rate == 1.0


# == sweeps ===============================================================================


def test_interrupt_expired_bumps_fence_and_is_bounded(store: LedgerStore) -> None:
    for key in ("k-a", "k-b", "k-c"):
        store.claim(request(key, lease=LEASE_SHORT))
    store.claim(request("k-live"))
    for key in ("k-a", "k-b", "k-c"):
        wait_lease_expired(store, key)
    assert store.count_expired() == 3

    first = store.interrupt_expired(limit=2, actor="beat-1")
    assert len(first) == 2
    second = store.interrupt_expired(limit=2, actor="beat-1")
    assert len(second) == 1
    assert store.interrupt_expired(limit=2) == []
    marked = first + second
    assert sorted(i.key for i in marked) == ["k-a", "k-b", "k-c"]
    for item in marked:
        assert (item.fence, item.interruptions, item.has_snapshot) == (2, 1, True)
        assert (item.task_name, item.task_id) == ("shop.charge", "tid-1")
        entry = store.get_entry(item.key)
        assert (entry.status, entry.fence, entry.lease_until) == (EntryStatus.INTERRUPTED, 2, None)
        assert entry.reason == "lease expired"
        assert last_event(store, item.key) == ("interrupted", 2, "beat-1")
    assert store.get_entry("k-live").status is EntryStatus.RUNNING
    assert store.count_expired() == 0


def test_interrupt_previous_boot(store: LedgerStore) -> None:
    old = Owner("worker-a@host", "boot-old", 1)
    new = Owner("worker-a@host", "boot-new", 2)
    store.claim(request("k-old-1", owner=old))
    store.claim(request("k-old-2", owner=old))
    store.claim(request("k-new", owner=new))
    store.claim(request("k-other-node", owner=OTHER))
    store.claim(request("k-old-done", owner=old))
    store.settle("k-old-done", 1, EntryStatus.COMPLETED, result="1")

    marked = store.interrupt_previous_boot(new.node, new.boot)
    assert sorted(i.key for i in marked) == ["k-old-1", "k-old-2"]
    assert all(i.fence == 2 for i in marked)
    assert last_event(store, "k-old-1") == ("interrupted", 2, new.node)
    assert store.get_entry("k-old-1").reason == f"previous boot of {new.node}"
    for key, status in (
        ("k-new", EntryStatus.RUNNING),
        ("k-other-node", EntryStatus.RUNNING),
        ("k-old-done", EntryStatus.COMPLETED),
    ):
        assert store.get_entry(key).status is status
    assert store.interrupt_previous_boot(new.node, new.boot) == []


def test_interrupt_previous_boot_is_bounded(store: LedgerStore) -> None:
    old = Owner("worker-a@host", "boot-old", 1)
    for i in range(3):
        store.claim(request(f"k-{i}", owner=old))
    assert len(store.interrupt_previous_boot(old.node, "boot-new", limit=2)) == 2
    assert len(store.interrupt_previous_boot(old.node, "boot-new", limit=2)) == 1


def test_interrupt_owner_fast_path(store: LedgerStore) -> None:
    store.claim(request())
    why = "WorkerLostError: pool process 101 exited with signal 9"
    assert (
        store.interrupt_owner(
            "key-1", node=OWNER.node, boot=OWNER.boot, pid=999, actor="parent", why=why
        )
        is None
    )
    assert (
        store.interrupt_owner(
            "key-1", node=OWNER.node, boot="boot-x", pid=OWNER.pid, actor="parent", why=why
        )
        is None
    )
    assert store.get_entry("key-1").status is EntryStatus.RUNNING
    got = store.interrupt_owner(
        "key-1", node=OWNER.node, boot=OWNER.boot, pid=OWNER.pid, actor="parent", why=why
    )
    assert got is not None and (got.key, got.fence, got.interruptions) == ("key-1", 2, 1)
    entry = store.get_entry("key-1")
    assert (entry.status, entry.reason) == (EntryStatus.INTERRUPTED, why)
    assert last_event(store, "key-1") == ("interrupted", 2, "parent")
    # Already interrupted: a second report changes nothing.
    assert (
        store.interrupt_owner(
            "key-1", node=OWNER.node, boot=OWNER.boot, pid=None, actor="parent", why=why
        )
        is None
    )
    assert store.get_entry("key-1").fence == 2


def test_interrupt_owner_after_settle_is_a_no_op(store: LedgerStore) -> None:
    store.claim(request())
    store.settle("key-1", 1, EntryStatus.COMPLETED, result="1")
    assert (
        store.interrupt_owner(
            "key-1", node=OWNER.node, boot=OWNER.boot, pid=None, actor="parent", why="lost"
        )
        is None
    )
    assert store.get_entry("key-1").status is EntryStatus.COMPLETED


def test_list_interrupted_oldest_first(store: LedgerStore) -> None:
    store.claim(request("k-1"))
    store.claim(request("k-2", snapshot=None))
    store.claim(request("k-3"))
    for key in ("k-2", "k-1"):
        assert (
            store.interrupt_owner(
                key, node=OWNER.node, boot=OWNER.boot, pid=None, actor="t", why="lost"
            )
            is not None
        )
        time.sleep(0.01)  # distinct updated_at on the database clock
    listed = store.list_interrupted()
    assert [(i.key, i.fence, i.has_snapshot) for i in listed] == [
        ("k-2", 2, False),
        ("k-1", 2, True),
    ]
    assert [i.key for i in store.list_interrupted(limit=1)] == ["k-2"]


def test_begin_resume_is_a_compare_and_set(store: LedgerStore) -> None:
    fence = make_interrupted(store)
    assert store.begin_resume("key-1", fence - 1, lease_seconds=LEASE_LONG) is None
    won = store.begin_resume("key-1", fence, lease_seconds=LEASE_LONG, actor="beat-1")
    assert won is not None and won.fence == fence + 1
    # What the winner re-sends comes back from the same statement.
    entry = store.get_entry("key-1")
    assert (won.task_name, won.task_id, won.snapshot) == (
        entry.task_name,
        entry.task_id,
        entry.snapshot,
    )
    assert store.begin_resume("key-1", fence, lease_seconds=LEASE_LONG, actor="beat-2") is None
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.owner, entry.owner_boot, entry.owner_pid) == (
        EntryStatus.RUNNING,
        fence + 1,
        RESUME_OWNER,
        None,
        None,
    )
    assert [e for e in events_of(store, "key-1") if e[0] == "resuming"] == [
        ("resuming", fence + 1, "beat-1")
    ]
    assert store.list_interrupted() == []


def test_begin_resume_counts_the_completed_replay_rows(store: LedgerStore) -> None:
    claim = store.claim(request(lease=LEASE_SHORT))
    for seq, (name, status) in enumerate(
        [("a", StepStatus.COMPLETED), ("b", StepStatus.COMPLETED), ("c", StepStatus.STARTED)], 1
    ):
        assert store.write_step("key-1", claim.fence, (name, "ih", 0), seq=seq, status=status)
    store.claim(request("other-key"))  # another entry's rows are not counted
    assert store.write_step("other-key", 1, ("a", "ih", 0), seq=1, status=StepStatus.COMPLETED)
    wait_lease_expired(store, "key-1")
    (marked,) = [i for i in store.interrupt_expired() if i.key == "key-1"]
    won = store.begin_resume("key-1", marked.fence, lease_seconds=LEASE_LONG)
    assert won is not None and won.completed_steps == 2


def test_begin_resume_many_counts_each_entrys_own_completed_rows(store: LedgerStore) -> None:
    """The batched resume counts each entry's own completed rows: an entry without steps
    replays none, beside one with two (SQLite counted the whole table for both)."""
    with_steps = store.claim(request("with-steps", lease=LEASE_SHORT))
    for seq, name in enumerate(["a", "b"], 1):
        assert store.write_step(
            "with-steps", with_steps.fence, (name, "ih", 0), seq=seq, status=StepStatus.COMPLETED
        )
    assert store.claim(request("no-steps", lease=LEASE_SHORT)).gate is Gate.RUN
    wait_lease_expired(store, "with-steps")
    wait_lease_expired(store, "no-steps")
    marked = {i.key: i.fence for i in store.interrupt_expired()}
    won = store.begin_resume_many(sorted(marked.items()), lease_seconds=LEASE_LONG)
    assert {k: w.completed_steps for k, w in won.items()} == {"with-steps": 2, "no-steps": 0}


def test_begin_resume_lease_lapses_back_to_the_sweep(store: LedgerStore) -> None:
    fence = make_interrupted(store)
    resumed = store.begin_resume("key-1", fence, lease_seconds=LEASE_SHORT)
    assert resumed is not None and resumed.fence == fence + 1
    wait_lease_expired(store, "key-1")
    again = store.interrupt_expired()
    # The lapse of the resume marker is no interruption of an attempt: nothing ran since the
    # first one (the hardening faults, fault 5: only attempts that started the body count).
    assert [(i.key, i.fence, i.interruptions) for i in again] == [("key-1", fence + 2, 1)]


def test_block_is_fenced(store: LedgerStore) -> None:
    fence = make_interrupted(store)
    assert store.block("key-1", fence - 1, "stale", actor="sweep") is False
    assert store.block("key-1", fence, "step charge may have executed", actor="sweep")
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.reason) == (
        EntryStatus.BLOCKED,
        fence + 1,
        "step charge may have executed",
    )
    assert last_event(store, "key-1") == ("blocked", fence + 1, "sweep")
    assert store.block("key-1", fence, "again", actor="sweep") is False
    assert store.claim(request()).gate is Gate.BLOCK


def test_block_from_running(store: LedgerStore) -> None:
    store.claim(request())
    assert store.block("key-1", 1, "stop", actor="ops") is False  # not interrupted
    assert store.block("key-1", 1, "stop", actor="ops", from_status=EntryStatus.RUNNING)
    assert store.get_entry("key-1").status is EntryStatus.BLOCKED


def test_prune_settled_only_old_settled_rows_bounded(store: LedgerStore) -> None:
    for key in ("k-done", "k-failed"):
        store.claim(request(key))
        assert store.write_step(key, 1, STEP, seq=1, status=StepStatus.COMPLETED, output="1")
    store.settle("k-done", 1, EntryStatus.COMPLETED, result="1")
    store.settle("k-failed", 1, EntryStatus.FAILED, error="e")
    for key, status in (("k-retrying", EntryStatus.RETRYING), ("k-blocked", EntryStatus.BLOCKED)):
        store.claim(request(key))
        assert store.write_step(key, 1, STEP, seq=1, status=StepStatus.STARTED)
        store.settle(key, 1, status, reason="r")
    store.claim(request("k-running"))
    assert store.prune_settled(3600) == 0, "nothing is an hour old"
    time.sleep(0.6)
    store.claim(request("k-recent"))
    store.settle("k-recent", 1, EntryStatus.COMPLETED, result="1")

    assert store.prune_settled(0.4, limit=1) == 1
    assert store.prune_settled(0.4, limit=1) == 1
    assert store.prune_settled(0.4, limit=1) == 0
    for key in ("k-done", "k-failed"):
        with pytest.raises(EntryNotFound):
            store.get_entry(key)
        assert store.load_steps(key) == ()
        assert store.entry_events(key) == []
    for key in ("k-retrying", "k-blocked", "k-running", "k-recent"):
        assert store.get_entry(key).key == key
        assert store.entry_events(key) != []
    assert len(store.load_steps("k-retrying")) == 1
    assert len(store.load_steps("k-blocked")) == 1
    # A redelivery of a pruned key runs again (the documented retention trade-off).
    assert store.claim(request("k-done")).gate is Gate.RUN


# == operator =============================================================================


def test_release_completed_stores_the_result(store: LedgerStore) -> None:
    store.claim(request())
    assert store.write_step("key-1", 1, STEP, seq=1, status=StepStatus.STARTED)
    assert store.settle("key-1", 1, EntryStatus.BLOCKED, reason="ambiguous")
    rel = store.release(
        "key-1",
        Verdict.COMPLETED,
        by="alice",
        reason="charge ch_1 in dashboard",
        result='{"charged":true}',
    )
    assert (rel.verified, rel.from_status, rel.to_status, rel.fence) == (
        Verdict.COMPLETED,
        EntryStatus.BLOCKED,
        EntryStatus.COMPLETED,
        2,
    )
    assert (rel.task_name, rel.task_id) == ("shop.charge", "tid-1")
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.result, entry.reason) == (
        EntryStatus.COMPLETED,
        2,
        '{"charged":true}',
        None,
    )
    assert (entry.released_by, entry.released_reason, entry.released_from) == (
        "alice",
        "charge ch_1 in dashboard",
        "blocked",
    )
    assert entry.released_at is not None and entry.settled_at is not None
    assert step_row(store, "key-1").status is StepStatus.COMPLETED
    event = store.entry_events("key-1")[-1]
    assert (event.event, event.fence, event.actor, event.status) == (
        "released",
        2,
        "alice",
        "completed",
    )
    assert event.detail is not None and "charge ch_1 in dashboard" in event.detail
    claim = store.claim(request(owner=OTHER))
    assert (claim.gate, claim.result) == (Gate.RETURN, '{"charged":true}')


def test_release_not_executed_marks_ambiguous_steps(store: LedgerStore) -> None:
    run_and_expire(store)
    assert store.write_step(
        "key-1", 1, ("lookup", "ih", 0), seq=1, status=StepStatus.COMPLETED, output="1"
    )
    assert store.write_step("key-1", 1, STEP, seq=2, status=StepStatus.STARTED)
    fence = store.interrupt_expired()[0].fence
    rel = store.release("key-1", Verdict.NOT_EXECUTED, by="bob", reason="no charge at provider")
    assert (rel.to_status, rel.fence, rel.steps_released) == (
        EntryStatus.INTERRUPTED,
        fence + 1,
        ("charge",),
    )
    assert rel.snapshot == '{"args":[1],"kwargs":{}}'
    entry = store.get_entry("key-1")
    assert (entry.status, entry.fence, entry.interruptions) == (
        EntryStatus.INTERRUPTED,
        fence + 1,
        0,
    )
    assert (entry.released_by, entry.released_from) == ("bob", "interrupted")
    charge = step_row(store, "key-1", "charge")
    assert (charge.status, charge.authorized, charge.fence) == (
        StepStatus.NOT_EXECUTED,
        1,
        fence + 1,
    )
    lookup = step_row(store, "key-1", "lookup")
    assert (lookup.status, lookup.output, lookup.fence) == (StepStatus.COMPLETED, "1", 1)
    # Released work is recoverable: it is listed for resume.
    assert [i.key for i in store.list_interrupted()] == ["key-1"]


def test_release_not_executed_without_steps_releases_the_body(store: LedgerStore) -> None:
    store.claim(request())
    store.settle("key-1", 1, EntryStatus.BLOCKED, reason="body may have run")
    rel = store.release("key-1", Verdict.NOT_EXECUTED, by="ops", reason="checked")
    assert rel.steps_released == (BODY_STEP,)
    rows = store.load_steps("key-1")
    assert [(r.name, r.status, r.authorized, r.fence) for r in rows] == [
        (BODY_STEP, StepStatus.NOT_EXECUTED, 1, rel.fence)
    ]
    assert store.stats().duplicate_executions == 0


def test_release_is_one_shot(store: LedgerStore) -> None:
    store.claim(request())
    store.settle("key-1", 1, EntryStatus.BLOCKED, reason="body may have run")
    first = store.release("key-1", Verdict.NOT_EXECUTED, by="ops-1", reason="checked")
    with pytest.raises(ReleaseRefused, match="released"):
        store.release("key-1", Verdict.NOT_EXECUTED, by="ops-2", reason="checked too")
    with pytest.raises(ReleaseRefused, match="released"):
        store.release("key-1", Verdict.COMPLETED, by="ops-2", reason="changed my mind", result="1")
    entry = store.get_entry("key-1")
    assert (entry.fence, entry.released_by, entry.status) == (
        first.fence,
        "ops-1",
        EntryStatus.INTERRUPTED,
    )
    assert [e[0] for e in events_of(store, "key-1")].count("released") == 1
    assert step_row(store, "key-1", BODY_STEP).authorized == 1
    # Once the released entry ran again and got stuck again, a new release is allowed.
    claim = store.claim(request(owner=OTHER))
    assert claim.gate is Gate.TAKEOVER
    store.settle("key-1", claim.fence, EntryStatus.BLOCKED, reason="stuck again")
    again = store.release("key-1", Verdict.COMPLETED, by="ops-2", reason="verified", result="1")
    assert again.fence == claim.fence + 1


def test_release_refusals(store: LedgerStore) -> None:
    with pytest.raises(EntryNotFound, match="no-such-key"):
        store.release("no-such-key", Verdict.COMPLETED, by="ops", reason="r")
    with pytest.raises(EntryNotFound):
        store.get_entry("no-such-key")

    store.claim(request("k-live"))
    with pytest.raises(ReleaseRefused, match="live lease"):
        store.release("k-live", Verdict.NOT_EXECUTED, by="ops", reason="r")
    with pytest.raises(ReleaseRefused):
        store.release("k-live", Verdict.UNKNOWN, by="ops", reason="r")
    entry = store.get_entry("k-live")
    assert (entry.status, entry.fence, entry.released_by) == (EntryStatus.RUNNING, 1, None)

    store.claim(request("k-done"))
    store.settle("k-done", 1, EntryStatus.COMPLETED, result="1")
    with pytest.raises(ReleaseRefused, match="completed"):
        store.release("k-done", Verdict.NOT_EXECUTED, by="ops", reason="r")
    assert store.get_entry("k-done").result == "1"
    assert [e[0] for e in events_of(store, "k-done")] == ["claimed", "settled"]


def test_release_of_expired_running_entry_fences_the_old_attempt(store: LedgerStore) -> None:
    run_and_expire(store)
    rel = store.release("key-1", Verdict.NOT_EXECUTED, by="ops", reason="host is gone")
    assert (rel.from_status, rel.fence) == (EntryStatus.RUNNING, 2)
    assert store.settle("key-1", 1, EntryStatus.COMPLETED, result="late") is False


def test_list_entries_filters(store: LedgerStore) -> None:
    store.claim(request("k-live"))
    store.claim(request("k-expired", lease=LEASE_SHORT))
    store.claim(request("k-int", lease=LEASE_SHORT))
    wait_lease_expired(store, "k-int")
    assert store.interrupt_owner(
        "k-int", node=OWNER.node, boot=OWNER.boot, pid=None, actor="t", why="lost"
    )
    store.claim(request("k-blocked"))
    store.settle("k-blocked", 1, EntryStatus.BLOCKED, reason="r")
    store.claim(request("k-done"))
    store.settle("k-done", 1, EntryStatus.COMPLETED, result="1")
    wait_lease_expired(store, "k-expired")

    stuck = {e.key for e in store.list_entries(stuck=True)}
    assert stuck == {"k-expired", "k-int", "k-blocked"}
    assert [e.key for e in store.list_entries(statuses=["completed"])] == ["k-done"]
    assert len(store.list_entries()) == 5
    assert len(store.list_entries(limit=2)) == 2
    assert store.list_entries(task="other.task") == []
    assert len(store.list_entries(task="shop.charge", since_seconds=3600)) == 5
    assert store.find_keys("k-bl") == ["k-blocked"]
    assert set(store.find_keys("tid-1")) == stuck | {"k-live", "k-done"}


def test_stats(store: LedgerStore) -> None:
    make_interrupted(store, "k-int")
    store.claim(request("k-live"))
    store.claim(request("k-expired", lease=LEASE_SHORT))
    store.claim(request("k-done"))
    assert store.write_step("k-done", 1, STEP, seq=1, status=StepStatus.COMPLETED, output="1")
    store.settle("k-done", 1, EntryStatus.COMPLETED, result="1")
    wait_lease_expired(store, "k-expired")
    stats = store.stats()
    assert stats.by_status == {
        "running": 2,
        "completed": 1,
        "failed": 0,
        "retrying": 0,
        "interrupted": 1,
        "blocked": 0,
        # durable time's statuses
        "scheduled": 0,
        "sleeping": 0,
        "cancelled": 0,
        "expired": 0,
    }
    assert stats.by_task_status[("shop.charge", "running")] == 2
    assert stats.expired_running == 1
    assert stats.interruptions == 1
    assert stats.oldest_running_age >= 0.0
    assert (stats.entries, stats.duplicate_executions) == (4, 0)


# == races ================================================================================


def _join_all(threads: list[threading.Thread], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a racing thread did not finish"


def _race(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(i)`` in ``n`` threads released together; return results (errors re-raised)."""
    barrier = threading.Barrier(n, timeout=30)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    _join_all(threads)
    if errors:
        raise errors[0]
    return results


def test_threads_racing_claim_get_exactly_one_run(store: LedgerStore) -> None:
    store.now()  # open the engine and the schema before the race
    for rnd in range(RACE_ROUNDS):
        key = f"race-{rnd}"
        claims: list[Claim] = _race(
            RACE_THREADS,
            lambda i, key=key: store.claim(
                request(key, owner=Owner(f"w{i}@host", "boot", 1000 + i), task_id=f"tid-{i}")
            ),
        )
        gates = Counter(c.gate for c in claims)
        assert gates == {Gate.RUN: 1, Gate.WAIT: RACE_THREADS - 1}, (rnd, gates)
        assert all(c.fence == 1 for c in claims)
        entry = store.get_entry(key)
        assert (entry.fence, entry.executions) == (1, 1)
        winner = next(i for i, c in enumerate(claims) if c.gate is Gate.RUN)
        assert entry.owner == f"w{winner}@host"
        names = Counter(e[0] for e in events_of(store, key))
        assert names == {"claimed": 1, "waited": RACE_THREADS - 1}


def test_threads_racing_begin_resume_get_exactly_one_fence(store: LedgerStore) -> None:
    for rnd in range(RACE_ROUNDS):
        key = f"resume-{rnd}"
        store.claim(request(key, lease=LEASE_SHORT))
        wait_lease_expired(store, key)
        got = store.interrupt_owner(
            key, node=OWNER.node, boot=OWNER.boot, pid=None, actor="t", why="lost"
        )
        assert got is not None
        fences = _race(
            2,
            lambda i, key=key, fence=got.fence: getattr(
                store.begin_resume(key, fence, lease_seconds=LEASE_LONG, actor=f"beat-{i}"),
                "fence",
                None,
            ),
        )
        assert sorted(fences, key=lambda f: f is None) == [got.fence + 1, None], (rnd, fences)
        assert store.get_entry(key).fence == got.fence + 1
        assert [e[0] for e in events_of(store, key)].count("resuming") == 1


def _claim_in_process(url: str, keys: list[str], who: int, barrier: Any, results: Any) -> None:
    """Child process body (spawned): open a store of its own and race the others per key."""
    store = LedgerStore(url)
    try:
        store.now()  # engine + schema check before the first barrier
        for key in keys:
            barrier.wait(timeout=60)
            claim = store.claim(
                request(
                    key, owner=Owner(f"proc-{who}@host", "boot", os.getpid()), task_id=f"tid-{who}"
                )
            )
            results.put((key, who, claim.gate.value, claim.fence))
    except BaseException as exc:  # reported to the parent, then re-raised
        results.put(("error", who, repr(exc), 0))
        raise
    finally:
        store.dispose()


def test_processes_racing_claim_get_exactly_one_run(store: LedgerStore, ledger_url: str) -> None:
    store.now()  # the schema exists before the children start
    ctx = multiprocessing.get_context("spawn")
    keys = [f"proc-race-{rnd}" for rnd in range(RACE_ROUNDS)]
    barrier = ctx.Barrier(RACE_PROCESSES)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_claim_in_process, args=(ledger_url, keys, who, barrier, results), daemon=True
        )
        for who in range(RACE_PROCESSES)
    ]
    got: list[tuple[str, int, str, int]] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        while len(got) < len(keys) * RACE_PROCESSES:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"children reported only {got}"
            try:
                item = results.get(timeout=min(remaining, 5))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a child died: exit codes {dead}; results {got}"
                continue
            assert item[0] != "error", f"child {item[1]} failed: {item[2]}"
            got.append(item)
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0] * RACE_PROCESSES
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()

    for key in keys:
        gates = Counter(gate for k, _, gate, _ in got if k == key)
        assert gates == {Gate.RUN.value: 1, Gate.WAIT.value: RACE_PROCESSES - 1}, (key, gates)
        winner = next(who for k, who, gate, _ in got if k == key and gate == Gate.RUN.value)
        entry = store.get_entry(key)
        assert (entry.fence, entry.executions, entry.owner) == (1, 1, f"proc-{winner}@host")


# == availability =========================================================================


def test_unreachable_database_raises_ledger_unavailable() -> None:
    store = LedgerStore("postgresql://postgres@127.0.0.1:1/x")
    try:
        for _ in range(2):  # and again: a failed first open must not be remembered as good
            with pytest.raises(LedgerUnavailable, match="ledger database unavailable") as info:
                store.claim(request())
            assert "127.0.0.1" in str(info.value) or "port 1" in str(info.value)
    finally:
        store.dispose()


@pytest.fixture
def translations(monkeypatch: pytest.MonkeyPatch) -> list[LedgerUnavailable]:
    """Every ``LedgerUnavailable`` that ``errors.as_unavailable`` (the one translation of a
    driver error) makes from now on, in order."""
    made: list[LedgerUnavailable] = []
    real = ledger_errors.as_unavailable

    def recording(exc: BaseException, dbapi: Any = None) -> LedgerUnavailable | None:
        out = real(exc, dbapi)
        if out is not None:
            made.append(out)
        return out

    monkeypatch.setattr(ledger_errors, "as_unavailable", recording)
    return made


def _refuse_connections(url: str, refuse: bool) -> None:
    """Make new connections to the ledger fail for real (or work again); open ones stay.

    PostgreSQL: the database stops accepting connections. SQLite: its directory moves away,
    so the file cannot be opened.
    """
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1]
        here, moved = os.path.dirname(path), os.path.dirname(path) + ".moved"
        os.rename(*((here, moved) if refuse else (moved, here)))
        return
    import psycopg

    from servers import PG_ADMIN_URL

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_URL.replace("+psycopg", ""), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(not refuse).lower()}')


def test_a_failing_connect_is_translated_by_the_one_function(
    ledger_url: str, tmp_path: Any, translations: list[LedgerUnavailable]
) -> None:
    """Connecting fails on the SQLAlchemy path and on the hot path: both raise the
    ``LedgerUnavailable`` that ``errors.as_unavailable`` made, with the driver's words."""
    if ledger_url.startswith("sqlite"):
        ledger_url = f"sqlite:///{tmp_path / 'ledger-dir' / 'ledger.sqlite3'}"
    store = LedgerStore(ledger_url)
    try:
        store.ensure_ready()  # schema checked; the hot path has not connected yet
        store.engine.dispose()  # no pooled connection left to reuse (on SQLite, the hot
        # path's engine is this one)
        _refuse_connections(ledger_url, True)
        try:
            with pytest.raises(LedgerUnavailable) as slow:
                store.get_entry("key-1")
            with pytest.raises(LedgerUnavailable) as fast:
                store.claim(request())
        finally:
            _refuse_connections(ledger_url, False)
        assert translations == [slow.value, fast.value]
        assert translations[0] is slow.value and translations[1] is fast.value
        from sqlalchemy import exc as sa_exc

        refused = (store.fast.dbapi.OperationalError, sa_exc.OperationalError)
        for raised in translations:
            assert isinstance(raised.__cause__, refused), repr(raised.__cause__)
            assert str(raised).startswith("ledger database unavailable: ")
            assert "sqlalche.me" not in str(raised), "the driver's words, not SQLAlchemy's"
        # Nothing was remembered as broken: both paths connect again.
        assert store.claim(request()).gate is Gate.RUN
        assert store.get_entry("key-1").status is EntryStatus.RUNNING
    finally:
        store.dispose()


def test_a_statement_on_a_terminated_connection_is_translated_by_the_one_function(
    pg_url: str, translations: list[LedgerUnavailable]
) -> None:
    """The server ends every session: the next statement on the hot path's kept connection
    and on the pool's both raise the ``LedgerUnavailable`` that ``as_unavailable`` made."""
    import psycopg

    store = LedgerStore(pg_url)
    try:
        claim = store.claim(request())  # the hot path's connection now waits, idle
        # ... and so does one whose commits do not wait for the flush (``effects`` durability,
        # design.md § "Durability follows effects"), which the settle takes.
        assert store.renew_lease("key-1", claim.fence, 60.0)
        assert store.get_entry("key-1").status is EntryStatus.RUNNING  # and the pool's
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        with pytest.raises(LedgerUnavailable) as fast:
            store.settle("key-1", claim.fence, EntryStatus.COMPLETED, result="1")
        with pytest.raises(LedgerUnavailable) as slow:
            store.get_entry("key-1")
        assert translations == [fast.value, slow.value]
        assert translations[0] is fast.value and translations[1] is slow.value
        from sqlalchemy import exc as sa_exc

        gone = (store.fast.dbapi.OperationalError, sa_exc.OperationalError)
        for raised in translations:
            assert str(raised).startswith("ledger database unavailable: ")
            assert isinstance(raised.__cause__, gone), repr(raised.__cause__)
        assert store.settle("key-1", claim.fence, EntryStatus.COMPLETED, result="1")
    finally:
        store.dispose()


def test_only_the_unavailable_classes_are_translated(store: LedgerStore) -> None:
    """A bug in our SQL (here a unique violation) is not turned into ``LedgerUnavailable``: it
    would retry forever what can never succeed. Every other driver error is (the hardening
    faults, fault 2): a read-only standby, a corrupt SQLite file, a full disk mean "not now", never
    "failed"."""
    from sqlalchemy import exc as sa_exc

    dbapi = store.fast.dbapi
    assert ledger_errors.BUG_ERRORS == (
        "ProgrammingError",
        "IntegrityError",
        "DataError",
        "NotSupportedError",
    )
    assert ledger_errors.UNAVAILABLE_ERRORS == (
        "OperationalError",
        "InterfaceError",
        "InternalError",
        "DatabaseError",
    )
    assert ledger_errors.as_unavailable(ValueError("not a driver error"), dbapi) is None
    for name in ledger_errors.BUG_ERRORS:
        raw = getattr(dbapi, name)("our bug")
        assert ledger_errors.as_unavailable(raw, dbapi) is None, name
        assert ledger_errors.as_unavailable(getattr(sa_exc, name)("INSERT", {}, raw)) is None
    for name in ledger_errors.UNAVAILABLE_ERRORS:
        raw = getattr(dbapi, name)("gone")
        assert str(ledger_errors.as_unavailable(raw, dbapi)) == "ledger database unavailable: gone"
        assert ledger_errors.as_unavailable(raw) is None, "a raw error needs its driver module"
        wrapped = getattr(sa_exc, name)("SELECT 1", {}, raw)
        assert str(ledger_errors.as_unavailable(wrapped)) == "ledger database unavailable: gone"


def test_revoked_write_access_is_unavailable_not_a_bug(pg_url: str) -> None:
    """PostgreSQL files insufficient_privilege (42501) under ProgrammingError; it means the
    database refuses writes, like a read-only standby, so it is unavailability."""
    import psycopg

    raw = psycopg.errors.InsufficientPrivilege("permission denied for table ledger_entries")
    assert ledger_errors.as_unavailable(raw, psycopg) is not None
    assert ledger_errors.as_unavailable(psycopg.errors.UndefinedColumn("typo"), psycopg) is None


def _pool_events(store: LedgerStore, name: str) -> list[object]:
    """Record each ``connect`` (new DBAPI connection) or ``checkout`` (taken from the pool)
    of the hot path's engine from now on."""
    from sqlalchemy import event

    seen: list[object] = []
    event.listen(store.fast.engine, name, lambda conn, *_: seen.append(conn))
    return seen


def test_hot_path_keeps_its_connection_between_tasks(store: LedgerStore) -> None:
    store.ensure_ready()
    taken = _pool_events(store, "checkout")
    for i in range(20):
        claim = store.claim(request(f"key-{i}", task_id=f"tid-{i}"))
        assert claim.gate is Gate.RUN
        assert store.settle(claim.key, claim.fence, EntryStatus.COMPLETED, result="1")
    # In ``effects`` durability the claim waits for the flush and the settle does not. On
    # SQLite each kind of write has a connection of its own; PostgreSQL asks per statement,
    # on one connection (ledger/dialect.py, ``lazy_statement``).
    kinds = 2 if store.is_sqlite else 1
    assert len(taken) == kinds, f"40 writes in one thread should take {kinds} connection(s)"


def test_hot_path_connection_ended_by_the_server_fails_once_and_loses_nothing(
    pg_url: str,
) -> None:
    import psycopg

    store = LedgerStore(pg_url)
    try:
        claim = store.claim(request())
        assert claim.gate is Gate.RUN
        # The connection the settle takes (commits that do not wait for the flush, design.md
        # § "Durability follows effects").
        assert store.renew_lease("key-1", claim.fence, 60.0)
        opened = _pool_events(store, "connect")
        with psycopg.connect(pg_url, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        assert ended, "the store's connections should have been there to end"
        store.engine.dispose()  # the slow path's pooled connection ended too; not under test
        with pytest.raises(LedgerUnavailable, match="ledger database unavailable"):
            store.settle("key-1", claim.fence, EntryStatus.COMPLETED, result="1")
        # The write never reached the database: the entry is still running, and the next
        # call connects again and settles it.
        assert store.get_entry("key-1").status is EntryStatus.RUNNING
        assert store.settle("key-1", claim.fence, EntryStatus.COMPLETED, result="1")
        assert store.get_entry("key-1").status is EntryStatus.COMPLETED
        assert len(opened) == 1
    finally:
        store.dispose()


def exit_code_of_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child and return its exit code: what ``body`` returns, 1 if
    it raised. The child exits without running the atexit hooks it inherited."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def claim_and_settle(store: LedgerStore, key: str) -> bool:
    claim = store.claim(request(key, task_id=f"tid-{key}"))
    ok = store.settle(claim.key, claim.fence, EntryStatus.COMPLETED, result="1")
    return claim.gate is Gate.RUN and ok


def test_forked_child_opens_its_own_connection_and_leaves_the_parents(store: LedgerStore) -> None:
    first = store.claim(request("parent-1", task_id="tid-p1"))
    assert first.gate is Gate.RUN  # the parent's hot-path connection now waits, idle
    assert exit_code_of_child(lambda: 0 if claim_and_settle(store, "child-1") else 1) == 0
    # The parent's connection still works: the child neither used nor ended it.
    assert store.settle("parent-1", first.fence, EntryStatus.COMPLETED, result="1")
    assert store.get_entry("child-1").status is EntryStatus.COMPLETED


def test_forked_child_keeps_the_parents_engines_and_compiled_statements(
    store: LedgerStore,
) -> None:
    """SQLAlchemy's fork pattern (``Engine.dispose(close=False)`` in the child): after the
    worker parent's ``prepare_for_fork``, the child keeps the parent's engines, with their
    dialects initialized, and the hot path's compiled statements, shared copy-on-write,
    instead of building and initializing its own (about 5 MiB of private memory per pool
    process); only the connections are its own."""
    store.prepare_for_fork()
    assert claim_and_settle(store, "parent-2")
    engine, fast_engine = store.engine, store.fast.engine
    compiled = dict(store.fast._compiled)
    assert compiled, "the parent's claim and settle compiled their statements"

    def child() -> int:
        if not claim_and_settle(store, "child-2"):
            return 1
        if store.engine is not engine or store.fast.engine is not fast_engine:
            return 2
        return 0 if all(store.fast._compiled.get(k) is c for k, c in compiled.items()) else 3

    code = exit_code_of_child(child)
    assert code == 0, {
        1: "the child's claim or settle failed",
        2: "the child built engines of its own",
        3: "the child compiled its statements again",
    }.get(code)
    assert store.get_entry("child-2").status is EntryStatus.COMPLETED


def test_forked_child_of_an_unprepared_store_builds_its_own_engines(store: LedgerStore) -> None:
    """Without ``prepare_for_fork`` (a client process, or a worker whose ledger was down when
    it started) nothing says the engines finished their first connect, whose lock a thread
    could hold at the fork: the child builds engines of its own, as before."""
    assert claim_and_settle(store, "parent-3")
    engine = store.engine

    def child() -> int:
        if not claim_and_settle(store, "child-3"):
            return 1
        return 0 if store.engine is not engine else 2

    assert exit_code_of_child(child) == 0
    assert store.get_entry("child-3").status is EntryStatus.COMPLETED


def test_prepare_for_fork_compiles_the_hot_path_and_keeps_no_connection(
    store: LedgerStore,
) -> None:
    """What a worker's parent runs before its pool forks: every statement a task's claim,
    renewal, steps and settle use is compiled there (so the pool processes share it), and
    the parent, which runs no task, keeps no hot-path session open."""
    store.prepare_for_fork()
    assert not store.fast._idle and not store.fast._idle_lazy
    prepared = set(store.fast._compiled)
    assert prepared == set(sql.HOT), prepared ^ set(sql.HOT)
    claim = store.claim(request("warm-1", task_id="tid-w1"))
    assert store.renew_lease("warm-1", claim.fence, 60.0)
    assert store.write_step("warm-1", claim.fence, STEP, seq=1, status=StepStatus.STARTED)
    done = StepStatus.COMPLETED
    assert store.write_step("warm-1", claim.fence, STEP, seq=1, status=done, output="7")
    assert store.write_step("warm-1", claim.fence, ("b", "ih-b", 0), seq=2, status=done)
    assert store.settle("warm-1", claim.fence, EntryStatus.RETRYING, error="e")
    again = store.claim(request("warm-1", task_id="tid-w1"))
    assert store.settle("warm-1", again.fence, EntryStatus.COMPLETED, result="1")
    assert set(store.fast._compiled) == prepared, set(store.fast._compiled) - prepared


def test_prune_skips_an_entry_being_released(pg_url: str) -> None:
    """A release un-settles a failed entry; a concurrent prune must not strip its steps.

    PostgreSQL only: on SQLite every transaction holds the database write lock, so the prune
    and the release cannot interleave at all.
    """
    from sqlalchemy import text

    store = LedgerStore(pg_url)
    try:
        for key in ("key-1", "key-2"):  # key-2: as old, and nobody is releasing it
            store.claim(request(key))
            assert store.write_step(key, 1, STEP, seq=1, status=StepStatus.COMPLETED, output="1")
            assert store.settle(key, 1, EntryStatus.FAILED, error="e")
        time.sleep(0.3)
        done: list[int] = []
        with store.engine.connect() as releaser:
            # What release() does first: lock the entry row.
            releaser.execute(text("SELECT key FROM ledger_entries WHERE key = 'key-1' FOR UPDATE"))
            pruner = threading.Thread(
                target=lambda: done.append(store.prune_settled(0.1)), daemon=True
            )
            pruner.start()
            # A correct prune skips the locked row and returns while the lock is still held;
            # one that waited for it would still be blocked here (bounded: 20 s).
            pruner.join(timeout=20)
            assert not pruner.is_alive(), "the prune waited for the row being released"
            assert done == [1], "the prune should delete key-2 and skip only the locked key-1"
            assert store.get_entry("key-1").status is EntryStatus.FAILED
            with pytest.raises(EntryNotFound):
                store.get_entry("key-2")
            # ... then un-settle it, as release(not_executed) does, and commit.
            releaser.execute(
                text(
                    "UPDATE ledger_entries SET status = 'interrupted', "
                    "settled_at = NULL WHERE key = 'key-1'"
                )
            )
            releaser.commit()
        assert store.get_entry("key-1").status is EntryStatus.INTERRUPTED
        assert [s.output for s in store.load_steps("key-1")] == ["1"]
        assert store.entry_events("key-1") != []
    finally:
        store.dispose()


def test_publish_intent_is_claimed_as_a_first_run(store: LedgerStore) -> None:
    """An intent recorded at publish time: the first claim RUNs it (no ambiguity, no crash
    counted); a lost message's intent expires, is interrupted by the sweep, and still RUNs."""
    assert store.record_intent(request(lease=60))
    assert not store.record_intent(request(lease=60))  # one intent per key
    claim = store.claim(request())
    assert (claim.gate, claim.fence, claim.executions) == (Gate.RUN, 2, 0)
    assert [e.event for e in store.entry_events("key-1")] == ["queued", "claimed"]
    assert store.get_entry("key-1").interruptions == 0


def test_withdrawn_intent_leaves_nothing_to_send(store: LedgerStore) -> None:
    """guarantees.md § "The hardening faults", fault 7: the publish of an intent failed; withdrawing
    it deletes the entry
    (one statement, with a ``withdrawn`` event), only while no claim touched it and only for
    the same task id."""
    assert store.record_intent(request(lease=60))
    assert not store.withdraw_intent("key-1", "another-id", actor="p", why="publish failed")
    assert store.withdraw_intent("key-1", "tid-1", actor="p", why="publish failed: boom")
    assert store.peek_status("key-1") is None
    assert [(e.event, e.actor, e.detail) for e in store.entry_events("key-1")] == [
        ("queued", OWNER.node, None),
        ("withdrawn", "p", "publish failed: boom"),
    ]
    assert not store.withdraw_intent("key-1", "tid-1", actor="p", why="again")
    # The key is free: a later publish records it afresh.
    assert store.record_intent(request(lease=60))


def test_an_intent_a_claim_touched_is_not_withdrawn(store: LedgerStore) -> None:
    assert store.record_intent(request(lease=60))
    assert store.claim(request()).gate is Gate.RUN
    assert not store.withdraw_intent("key-1", "tid-1", actor="p", why="publish failed")
    assert store.get_entry("key-1").status is EntryStatus.RUNNING


def test_an_intent_the_sweep_interrupted_is_still_withdrawn(store: LedgerStore) -> None:
    """The publish took longer than the intent's lease and the sweep got there first: the
    entry is withdrawn all the same (no claim ran it)."""
    assert store.record_intent(request(lease=LEASE_SHORT))
    wait_lease_expired(store, "key-1")
    assert [i.key for i in store.interrupt_expired()] == ["key-1"]
    assert store.withdraw_intent("key-1", "tid-1", actor="p", why="publish failed")
    assert store.peek_status("key-1") is None


def test_lost_publish_intent_is_swept_and_run(store: LedgerStore) -> None:
    assert store.record_intent(request(lease=0.05))
    time.sleep(0.1)
    (lost,) = store.interrupt_expired()
    assert lost.key == "key-1" and lost.has_snapshot
    assert store.begin_resume("key-1", lost.fence, lease_seconds=60) is not None
    claim = store.claim(request())
    assert claim.gate is Gate.RUN and claim.steps == ()


# == due time of a retry (the hardening faults, fault 3) ====================================


def test_retrying_settle_stores_its_due_time_and_the_retrys_snapshot(store: LedgerStore) -> None:
    claim = store.claim(request())
    now = store.now()
    retry = '{"args":[2],"kwargs":{},"queue":null,"ledger_key":null,"retries":1}'
    assert store.settle(
        "key-1", claim.fence, EntryStatus.RETRYING, due_in=30.0, snapshot=retry, actor="w"
    )
    entry = store.get_entry("key-1")
    assert entry.due_at is not None and now + 29.0 < entry.due_at < store.now() + 31.0
    assert entry.snapshot == retry
    assert store.list_overdue_retries() == []  # due in 30 s: not overdue
    # The retry is claimed: it waits for no time any more, and keeps its new snapshot.
    again = store.claim(request(snapshot=None))
    assert again.gate is Gate.RUN
    entry = store.get_entry("key-1")
    assert (entry.due_at, entry.snapshot) == (None, retry)
    # An ETA as seconds since the epoch; any other settle clears the due time.
    assert store.settle("key-1", again.fence, EntryStatus.RETRYING, due_at=now - 5.0)
    assert store.get_entry("key-1").due_at == pytest.approx(now - 5.0)
    assert [o.key for o in store.list_overdue_retries()] == ["key-1"]
    third = store.claim(request())
    assert store.settle("key-1", third.fence, EntryStatus.COMPLETED, result="1")
    entry = store.get_entry("key-1")
    assert (entry.status, entry.due_at) == (EntryStatus.COMPLETED, None)
    with pytest.raises(ValueError, match="only a retrying settle"):
        store.settle("key-1", third.fence, EntryStatus.FAILED, due_in=1.0)


def test_overdue_retry_is_stuck_and_resent_once(store: LedgerStore) -> None:
    claim = store.claim(request())
    assert store.settle("key-1", claim.fence, EntryStatus.RETRYING, due_in=-1.0)
    claim2 = store.claim(request("key-2"))
    assert store.settle("key-2", claim2.fence, EntryStatus.RETRYING, due_in=60.0)
    claim3 = store.claim(request("key-3", snapshot=None))
    assert store.settle("key-3", claim3.fence, EntryStatus.RETRYING, due_in=-1.0)
    # Shown stuck when overdue (with or without a snapshot to re-send from).
    assert {e.key for e in store.list_entries(stuck=True)} == {"key-1", "key-3"}
    [late] = store.list_overdue_retries()  # only what the sweep can re-send
    assert (late.key, late.fence) == ("key-1", claim.fence)
    assert store.begin_resend("key-1", late.fence - 1, resend_after=60.0) is None
    won = store.begin_resend("key-1", late.fence, resend_after=60.0, actor="beat-1")
    assert won is not None and won.fence == late.fence + 1
    assert won.snapshot == store.get_entry("key-1").snapshot
    assert store.begin_resend("key-1", late.fence, resend_after=60.0, actor="beat-2") is None
    entry = store.get_entry("key-1")
    # Still retrying (its claim RUNs it like the retry it stands for), due again later.
    assert entry.status is EntryStatus.RETRYING and entry.due_at > store.now() + 50.0
    assert last_event(store, "key-1") == ("resent", late.fence + 1, "beat-1")
    assert store.list_overdue_retries() == []
    assert store.claim(request()).gate is Gate.RUN


def test_release_is_one_shot_on_executions_not_the_fence(store: LedgerStore) -> None:
    """guarantees.md § "The hardening faults", fault 9: the fence moves without a run (a resume
    whose message is lost, a
    sweep); the release stays one-shot until an attempt runs the body again."""
    claim = store.claim(request())
    assert store.settle("key-1", claim.fence, EntryStatus.BLOCKED, reason="parked")
    first = store.release("key-1", Verdict.NOT_EXECUTED, by="alice", reason="checked")
    assert store.get_entry("key-1").released_executions == 1
    won = store.begin_resume("key-1", first.fence, lease_seconds=LEASE_SHORT)
    assert won is not None
    wait_lease_expired(store, "key-1")
    assert [i.key for i in store.interrupt_expired()] == ["key-1"]
    with pytest.raises(ReleaseRefused, match="one-shot"):
        store.release("key-1", Verdict.NOT_EXECUTED, by="bob", reason="again")
    # It runs (a takeover counts one more execution) and gets stuck again: releasable.
    again = store.claim(request(owner=OTHER))
    assert again.gate is Gate.TAKEOVER and store.get_entry("key-1").executions == 2
    assert store.settle("key-1", again.fence, EntryStatus.BLOCKED, reason="parked again")
    second = store.release("key-1", Verdict.NOT_EXECUTED, by="bob", reason="checked again")
    assert second.to_status is EntryStatus.INTERRUPTED


@pytest.mark.parametrize(
    ("by", "reason", "field"),
    [
        ("", "r", "by"),
        ("a" * 256, "r", "by"),
        ("alice\x1b[2J", "r", "by"),
        ("alice", "  ", "reason"),
        ("alice", "x" * 4097, "reason"),
        ("alice", "ok\x1b]0;owned\x07", "reason"),
    ],
)
def test_release_text_is_bounded_and_printable(
    store: LedgerStore, by: str, reason: str, field: str
) -> None:
    claim = store.claim(request())
    assert store.settle("key-1", claim.fence, EntryStatus.BLOCKED, reason="parked")
    with pytest.raises(OperatorTextError, match=f"release {field} "):
        store.release("key-1", Verdict.NOT_EXECUTED, by=by, reason=reason)
    entry = store.get_entry("key-1")
    assert (entry.status, entry.released_by) == (EntryStatus.BLOCKED, None)
    # The bounds themselves are accepted, and a reason may span lines.
    store.release(
        "key-1", Verdict.NOT_EXECUTED, by="a" * 255, reason="line one\nline two\t" + "x" * 4000
    )


def test_a_received_intent_is_held_to_the_task_lease_and_released_by_its_claim(
    store: LedgerStore,
) -> None:
    """``hold_intents``: a worker that received an intent's message shortens (and renews) its
    lease to the task's; a claim ends the hold; a hold never touches a claimed entry."""
    assert store.record_intent(request(lease=300))
    assert store.record_intent(request("key-2", task_id="tid-2", lease=300))
    assert sorted(store.hold_intents(["key-1", "key-2", "no-such-key"], 0.05)) == [
        "key-1",
        "key-2",
    ]
    # The holder died: nothing renews, and the sweep finds both within that short lease.
    time.sleep(0.1)
    swept = sorted(e.key for e in store.interrupt_expired())
    assert swept == ["key-1", "key-2"]
    # Resumed (an intent again: resume marker, never executed), held, then claimed.
    fence = store.get_entry("key-1").fence
    assert store.begin_resume("key-1", fence, lease_seconds=300) is not None
    assert store.hold_intents(["key-1"], 60) == ["key-1"]
    claim = store.claim(request())
    assert claim.gate is Gate.RUN
    before = store.get_entry("key-1")
    assert store.hold_intents(["key-1"], 0.01) == []  # the claim owns it now
    after = store.get_entry("key-1")
    assert (after.lease_until, after.owner, after.fence) == (
        before.lease_until,
        before.owner,
        before.fence,
    )

"""Store-level faults (guarantees.md § "The hardening faults"): the failing-first tests, on SQLite
and PostgreSQL.

Each test states the behaviour the issue requires, through the store's public methods and
``celery_ledger.recovery.run_sweep`` (with an app that records what it would enqueue), and
fails on the code the audit read. The fault number is in each test's docstring. Time passes
through short leases, polled on the database clock, never through long sleeps.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import pytest

from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    Gate,
    LedgerError,
    LedgerStore,
    LedgerUnavailable,
    Owner,
    ReleaseRefused,
    StepStatus,
    Verdict,
)
from celery_ledger.recovery import run_sweep

#: A lease that expires almost at once, so takeovers need no real waiting.
LEASE_SHORT = 0.05
LEASE_LONG = 60.0
NODE_A = "worker-a@host"
OWNER = Owner(NODE_A, "boot-a1", 101)
OTHER = Owner("worker-b@host", "boot-b1", 202)
SNAPSHOT = '{"args":[1],"kwargs":{},"queue":null,"ledger_key":null}'
#: A snapshot nested 5,000 deep (the hardening faults, fault 12): valid JSON that no default Python
#: decoder reads (RecursionError), written as text so that building it needs no recursion.
DEEP_SNAPSHOT = (
    '{"args":["deep",' + "[" * 5000 + "]" * 5000 + '],"kwargs":{},"queue":null,"ledger_key":null}'
)


def request(
    key: str = "key-1",
    *,
    owner: Owner = OWNER,
    lease: float = LEASE_LONG,
    task_id: str | None = None,
    snapshot: str | None = SNAPSHOT,
    max_interruptions: int = 5,
) -> ClaimRequest:
    return ClaimRequest(
        key=key,
        task_name="shop.charge",
        task_id=task_id or f"tid-{key}",
        args_hash="args-1",
        snapshot=snapshot,
        side_effect="non_idempotent",
        owner=owner,
        lease_seconds=lease,
        max_interruptions=max_interruptions,
    )


def wait_lease_expired(store: LedgerStore, key: str, timeout: float = 60.0) -> None:
    """Poll the database clock until ``key``'s lease is over: bounded by the lease the store
    reports at the start plus ``timeout``, since recovery's back-off lengthens a lease with the
    time an entry has waited, and that time grows with the machine's load. The bound only ends
    a lease that never runs out."""
    first = store.peek_status(key)
    assert first is not None, f"{key} vanished"
    bound = timeout + max(first[1] or 0.0, 0.0)
    deadline = time.monotonic() + bound
    while True:
        found = store.peek_status(key)
        assert found is not None, f"{key} vanished"
        left = found[1]
        if left is None or left < 0:
            return
        assert time.monotonic() < deadline, f"lease of {key} did not expire in {bound:.1f}s"
        time.sleep(min(max(left, 0.01), 0.1))


class RecordingApp:
    """Stands in for the Celery app in sweeps: records the task ids it would enqueue."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self._lock = threading.Lock()

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        with self._lock:
            self.sent.append(options["task_id"])


def sweep(store: LedgerStore, app: RecordingApp, **kw: Any) -> Any:
    options: dict[str, Any] = {
        "lease_seconds": LEASE_LONG,
        "max_resumes": 5,
        "retention_days": 7,
    }
    options.update(kw)
    return run_sweep(store, app, **options)


def interrupted(store: LedgerStore, key: str, **kw: Any) -> int:
    """Claim ``key`` with a short lease, let it lapse, and interrupt it; return its fence."""
    assert store.claim(request(key, lease=LEASE_SHORT, **kw)).gate is Gate.RUN
    wait_lease_expired(store, key)
    marked = [i for i in store.interrupt_expired() if i.key == key]
    assert len(marked) == 1
    return marked[0].fence


def pg_admin(url: str) -> Any:
    import psycopg

    return psycopg.connect(url.replace("+psycopg", ""), autocommit=True)


def waiting_on_locks(admin: Any) -> int:
    """Backends of this database that wait for a lock right now."""
    return int(
        admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        ).fetchone()[0]
    )


def wait_until(predicate: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


# == fault 1: the boot sweep and the fast path race a takeover (PostgreSQL) ==================


@pytest.mark.parametrize("sweeper", ["interrupt_previous_boot", "interrupt_owner"])
def test_interrupt_by_owner_never_hits_the_attempt_that_took_over(
    pg_url: str, sweeper: str
) -> None:
    """Fault 1. Worker A (boot a1) held ``key-1``; its lease expired. Worker B's claim takes it
    over while A's restarted node runs its boot sweep (or A's parent its worker-lost fast path)
    in another connection. Whatever the order, B's live attempt must stay B's: the sweep aimed
    at A's boot/process must interrupt nothing, and B's heartbeat must keep working.

    The race is made deterministic: a third connection holds the row lock; B's claim queues on
    it first, the sweep second (its key list is read before B commits); then the lock is let go.
    """
    store = LedgerStore(pg_url)
    admin = pg_admin(pg_url)
    holder = pg_admin(pg_url)
    results: dict[str, Any] = {}
    try:
        assert store.claim(request(lease=LEASE_SHORT)).gate is Gate.RUN
        wait_lease_expired(store, "key-1")
        holder.execute("BEGIN")
        holder.execute("SELECT key FROM ledger_entries WHERE key = 'key-1' FOR UPDATE")

        def take_over() -> None:
            results["claim"] = store.claim(request(owner=OTHER))

        def run_sweeper() -> None:
            if sweeper == "interrupt_previous_boot":
                results["swept"] = store.interrupt_previous_boot(NODE_A, "boot-a2", actor=NODE_A)
            else:
                found = store.interrupt_owner(
                    "key-1", node=NODE_A, boot="boot-a1", pid=101, actor=NODE_A, why="lost"
                )
                results["swept"] = [] if found is None else [found]

        claimer = threading.Thread(target=take_over, daemon=True)
        claimer.start()
        wait_until(lambda: waiting_on_locks(admin) >= 1, timeout=20, what="B's claim to queue")
        swept = threading.Thread(target=run_sweeper, daemon=True)
        swept.start()
        wait_until(lambda: waiting_on_locks(admin) >= 2, timeout=20, what="the sweep to queue")
        holder.execute("ROLLBACK")
        claimer.join(timeout=30)
        swept.join(timeout=30)
        assert not claimer.is_alive() and not swept.is_alive()

        claim = results["claim"]
        assert claim.gate is Gate.TAKEOVER
        entry = store.get_entry("key-1")
        assert results["swept"] == [], (
            f"{sweeper} for {NODE_A} interrupted the entry B had taken over: "
            f"{results['swept']}; entry now {entry.status.value} fence {entry.fence}"
        )
        assert (entry.status, entry.owner, entry.fence) == (
            EntryStatus.RUNNING,
            OTHER.node,
            claim.fence,
        )
        assert store.renew_lease("key-1", claim.fence, LEASE_LONG), "B's heartbeat was fenced out"
    finally:
        holder.close()
        admin.close()
        store.dispose()


# == fault 2: a ledger that refuses writes is unavailable, never a failure ====================


def test_read_only_postgresql_is_unavailable(pg_url: str) -> None:
    """Fault 2. Failover to a standby (or ``default_transaction_read_only``): PostgreSQL
    raises ReadOnlySqlTransaction. The claim must say LedgerUnavailable (the body does not
    run, the message comes back), on the hot path (new key) and the slow path (existing key)."""
    setup = LedgerStore(pg_url)
    setup.claim(request("existing"))
    setup.dispose()
    dbname = pg_url.rsplit("/", 1)[1]
    with pg_admin(pg_url) as admin:
        admin.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
    store = LedgerStore(pg_url)
    try:
        for key in ("new-key", "existing"):
            with pytest.raises(LedgerUnavailable):
                store.claim(request(key, owner=OTHER))
    finally:
        store.dispose()


def test_corrupt_sqlite_file_is_unavailable(tmp_path: Any) -> None:
    """Fault 2. A SQLite file that is not (any more) a database raises DatabaseError; the
    claim must say LedgerUnavailable."""
    path = tmp_path / "ledger.sqlite3"
    setup = LedgerStore(f"sqlite:///{path}")
    setup.claim(request("existing"))
    setup.dispose()
    for extra in ("-wal", "-shm"):
        (tmp_path / f"ledger.sqlite3{extra}").unlink(missing_ok=True)
    path.write_bytes(b"\x13garbage, not a database " * 4096)
    store = LedgerStore(f"sqlite:///{path}")
    try:
        with pytest.raises(LedgerUnavailable):
            store.claim(request("new-key"))
    finally:
        store.dispose()


def test_full_sqlite_disk_is_unavailable(tmp_path: Any) -> None:
    """Fault 2. Disk full (SQLITE_FULL, here from ``max_page_count``): LedgerUnavailable."""
    path = tmp_path / "ledger.sqlite3"
    setup = LedgerStore(f"sqlite:///{path}")
    setup.ensure_ready()
    setup.dispose()

    def full_disk() -> sqlite3.Connection:
        conn = sqlite3.connect(str(path), check_same_thread=False)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    store = LedgerStore(f"sqlite:///{path}", engine_options={"creator": full_disk})
    try:
        big = '{"args":["' + "x" * 200_000 + '"],"kwargs":{}}'
        with pytest.raises(LedgerUnavailable):
            store.claim(request("new-key", snapshot=big))
    finally:
        store.dispose()


def test_connections_ended_by_the_administrator_are_unavailable(pg_url: str) -> None:
    """Fault 2. ``admin_shutdown`` (pg_terminate_backend, a server restart) ends every
    connection the store holds, the hot path's and the slow path's pool. Each call that meets
    a dead connection must say LedgerUnavailable (and drop it); nothing else may escape, and
    the calls after it reach the ledger again."""
    store = LedgerStore(pg_url)
    try:
        store.claim(request("existing", lease=LEASE_SHORT))
        store.get_entry("existing")  # the slow path's pool holds a connection now
        wait_lease_expired(store, "existing")
        with pg_admin(pg_url) as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        assert ended
        outcomes: list[str] = []
        claim = None
        for _ in range(4):  # hot path, then slow path, may each meet one dead connection
            try:
                claim = store.claim(request("existing", owner=OTHER))
                break
            except LedgerUnavailable:
                outcomes.append("unavailable")
        assert claim is not None, outcomes
        assert claim.gate is Gate.TAKEOVER
    finally:
        store.dispose()


# == fault 3: retrying entries are recovered when their retry is overdue =====================
# (needs the retry's countdown, which only a real task has: tests/test_faults_task.py)


# == fault 4: the sweep does not starve behind entries it cannot resume ======================


def test_sweep_reaches_newer_work_past_entries_without_a_snapshot(store: LedgerStore) -> None:
    """Fault 4. ``batch`` interrupted entries without an argument snapshot must not hide a
    newer interrupted entry from every later sweep."""
    batch = 3
    for i in range(batch):
        assert store.claim(request(f"bare-{i}", lease=LEASE_SHORT, snapshot=None)).gate is Gate.RUN
    for i in range(batch):
        wait_lease_expired(store, f"bare-{i}")
    assert len(store.interrupt_expired()) == batch
    interrupted(store, "fresh")
    app = RecordingApp()
    for _ in range(3):
        sweep(store, app, batch=batch)
    assert "tid-fresh" in app.sent, (
        f"3 sweeps of batch {batch} never resumed the newer entry; "
        f"still {store.get_entry('fresh').status.value}"
    )


# == fault 5: a task that never ran is not a crash loop =======================================


def test_publish_intent_lapsing_repeatedly_is_not_a_crash_loop(store: LedgerStore) -> None:
    """Fault 5. A queue backlog longer than the intent's lease: the intent lapses, the sweep
    re-sends it, the resume marker lapses again, ... more than ``max_resumes`` times. Nothing
    ever started the body, so nothing may be counted as a crash, and the first claim RUNs."""
    assert store.record_intent(request(lease=LEASE_SHORT))
    app = RecordingApp()
    for lapse in range(1, 8):
        wait_lease_expired(store, "key-1")
        sweep(store, app, lease_seconds=LEASE_SHORT, max_resumes=5)
        entry = store.get_entry("key-1")
        assert entry.status is not EntryStatus.BLOCKED, (
            f"blocked after {lapse} lapse(s) of a task that never started: {entry.reason}"
        )
    assert len(app.sent) == 7
    claim = store.claim(request(lease=LEASE_LONG))
    assert claim.gate is Gate.RUN and claim.executions == 0
    assert store.get_entry("key-1").interruptions == 0


def test_resume_marker_lapses_are_not_counted_by_the_claim(store: LedgerStore) -> None:
    """Fault 5, the claim's side: an attempt ran once and was interrupted (1 interruption);
    then its resume message waits in a backlog while the marker lapses again and again. The
    broker's delivery finally arrives: it must take over, not block as a crash loop."""
    interrupted(store, "key-1", max_interruptions=2)
    for _ in range(4):
        fence = store.get_entry("key-1").fence
        won = store.begin_resume("key-1", fence, lease_seconds=LEASE_SHORT)
        assert won is not None
        wait_lease_expired(store, "key-1")
        assert [i.key for i in store.interrupt_expired()] == ["key-1"]
    claim = store.claim(request(owner=OTHER, max_interruptions=2))
    assert claim.gate is Gate.TAKEOVER, (
        f"gate {claim.gate.value}: {store.get_entry('key-1').reason}"
    )
    assert store.get_entry("key-1").interruptions == 1


# == fault 6: a second execution at one name and position is counted =========================


def test_second_execution_at_one_name_and_position_counts_as_a_duplicate(
    store: LedgerStore,
) -> None:
    """Fault 6. The first attempt ran effect step ``charge`` (position 1) with one input; the
    attempt that took over ran ``charge`` at the same position with another input (a timestamp
    read outside the step). If the store lets that second execution start, the
    duplicate-execution rate must count it."""
    first = store.claim(request(lease=LEASE_SHORT))
    ident_1 = ("charge", "1" * 64, 0)
    assert store.write_step("key-1", first.fence, ident_1, seq=1, status=StepStatus.STARTED)
    assert store.write_step(
        "key-1", first.fence, ident_1, seq=1, status=StepStatus.COMPLETED, output='"ch_1"'
    )
    wait_lease_expired(store, "key-1")
    second = store.claim(request(owner=OTHER))
    assert second.gate is Gate.TAKEOVER
    ident_2 = ("charge", "2" * 64, 0)
    try:
        started = store.write_step("key-1", second.fence, ident_2, seq=1, status=StepStatus.STARTED)
    except LedgerError:
        started = False  # refused as drift: nothing ran, nothing to count
    if started:
        assert store.write_step(
            "key-1", second.fence, ident_2, seq=1, status=StepStatus.COMPLETED, output='"ch_2"'
        )
    dup = store.stats().duplicate_executions
    assert not started or dup == 1, (
        f"charge ran twice at position 1 (inputs {ident_1[1][:8]}…, {ident_2[1][:8]}…) and "
        f"the ledger counts {dup} duplicate execution(s)"
    )


# == fault 9: operator release is one-shot across a sweep cycle ===============================


def test_release_stays_one_shot_across_a_resume_that_never_ran(store: LedgerStore) -> None:
    """Fault 9. Release, then a sweep cycle that runs nothing (begin_resume, its lease lapses,
    the sweep interrupts again): the fence moved twice, the body never ran. A second release
    must still be refused, and the first operator's stamp kept."""
    claim = store.claim(request())
    assert store.write_step(
        "key-1", claim.fence, ("charge", "h", 0), seq=1, status=StepStatus.STARTED
    )
    assert store.settle("key-1", claim.fence, EntryStatus.BLOCKED, reason="charge may have run")
    first = store.release("key-1", Verdict.NOT_EXECUTED, by="alice", reason="no charge at PSP")
    assert first.to_status is EntryStatus.INTERRUPTED
    assert store.begin_resume("key-1", first.fence, lease_seconds=LEASE_SHORT) is not None
    wait_lease_expired(store, "key-1")
    assert [i.key for i in store.interrupt_expired()] == ["key-1"]
    assert store.get_entry("key-1").executions == 1  # nothing ran since the release
    with pytest.raises(ReleaseRefused):
        store.release("key-1", Verdict.NOT_EXECUTED, by="bob", reason="retrying the release")
    entry = store.get_entry("key-1")
    assert (entry.released_by, entry.released_reason) == ("alice", "no charge at PSP")


# == fault 12: an entry whose snapshot cannot be read ==========================================


def test_sweep_survives_an_unreadable_snapshot_and_shows_it(store: LedgerStore) -> None:
    """Fault 12. A publish intent whose argument snapshot no worker can read (nested 5,000
    deep). The sweep must neither crash on it (every entry after it in the batch would go
    unresumed, the prune unrun) nor hide it under a live resume lease: the entry is shown
    as stuck, and the next entry is resumed."""
    assert store.record_intent(request("deep", lease=LEASE_SHORT, snapshot=DEEP_SNAPSHOT))
    wait_lease_expired(store, "deep")
    assert [i.key for i in store.interrupt_expired()] == ["deep"]
    assert store.record_intent(request("good", lease=LEASE_SHORT))
    wait_lease_expired(store, "good")
    assert [i.key for i in store.interrupt_expired()] == ["good"]
    app = RecordingApp()
    try:
        sweep(store, app)
    except RecursionError as exc:
        pytest.fail(f"the sweep crashed on the unreadable snapshot: {exc!r}")
    assert "tid-good" in app.sent
    assert "tid-deep" not in app.sent
    stuck = [e.key for e in store.list_entries(stuck=True)]
    assert "deep" in stuck, f"{store.get_entry('deep').status.value}, not shown as stuck"


# == fault 14: names and reasons an operator writes are bounded ================================


@pytest.mark.parametrize("field", ["reason", "by"])
def test_release_refuses_unbounded_operator_text(store: LedgerStore, field: str) -> None:
    """Fault 14. ``release --reason`` of 1 MB was accepted through the API, and every later
    ``show`` took seconds and printed megabytes. The store must refuse it with a clear error
    and write nothing."""
    claim = store.claim(request())
    assert store.settle("key-1", claim.fence, EntryStatus.BLOCKED, reason="parked")
    text_ = {"by": "alice", "reason": "checked"}
    text_[field] = "x" * 1_000_000
    with pytest.raises((LedgerError, ValueError)) as info:
        store.release("key-1", Verdict.NOT_EXECUTED, by=text_["by"], reason=text_["reason"])
    assert field in str(info.value) and len(str(info.value)) < 500
    entry = store.get_entry("key-1")
    assert (entry.status, entry.released_by) == (EntryStatus.BLOCKED, None)


# == guarantees that had no test (docs/guarantees.md) ===========================================


def test_writes_are_durable_before_an_effect_may_begin(store: LedgerStore) -> None:
    """docs/contract.md §5, durability follows effects: the ``started`` row and the claim
    commit with a flush (SQLite: WAL with ``synchronous=FULL``; PostgreSQL:
    ``synchronous_commit`` on), on the connections the store writes with."""
    with store.engine.connect() as conn:
        if store.is_sqlite:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        else:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"

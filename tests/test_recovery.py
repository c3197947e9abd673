"""Recovery with real processes (design.md § "Recovery"): lost workers, paused workers, racing
sweeps, crash loops. Every wait is bounded."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from celery_ledger.codec import arguments_hash, canonical_arguments
from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    LedgerStore,
    Owner,
    StepStatus,
    crash_loop_reason,
)
from celery_ledger.recovery import ResumeOutcome, resume_entry, run_sweep
from helpers import business_key, effect_counts, event_names, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

ORDER_EFFECTS = {"reserve": 1, "charge": 1, "receipt": 1}


def step_completed(url: str, order_id: str, step: str = "reserve") -> bool:
    """Whether the order's step has its `completed` row: killing the worker after this point
    leaves nothing ambiguous (after its effect but before this row, it would)."""
    rows = LedgerStore(url).load_steps(business_key("tests_app.order", order_id=order_id))
    return any(r.name == step and r.status is StepStatus.COMPLETED for r in rows)


def effects_of(url: str, tag: str) -> dict[str, int]:
    return {effect: n for (_, effect), n in effect_counts(url, tag).items()}


@pytest.mark.parametrize("how", ["beat", "boot"])
def test_whole_worker_killed_on_embedded_default_is_recovered(tmp_path, how):
    """filesystem:// loses the in-flight message when the worker dies; the ledger does not.

    ``beat``: a worker with another node name comes up, and only lease expiry + the beat
    sweep can find the entry. ``boot``: the same node restarts and its boot sweep resumes it.
    """
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(
        tmp_path,
        broker=None,
        ledger_url=ledger,
        CELERY_LEDGER_LEASE_SECONDS="3",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        first = procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.order", args=("emb-1", 3), kwargs={"pause": 4.0})
        wait_for(lambda: step_completed(ledger, "emb-1"), timeout=30, what="the first step")
        first.kill()  # SIGKILL the whole worker: parent and pool
        if how == "beat":
            procs.worker("w2", concurrency=1)
            procs.beat()
        else:
            procs.worker("w1", concurrency=1)
        assert result.get(timeout=90)["steps"] == ["reserve:emb-1", "charge:emb-1", "receipt:emb-1"]
    assert effects_of(ledger, "emb-1") == ORDER_EFFECTS
    store = LedgerStore(ledger)
    key = business_key("tests_app.order", order_id="emb-1")
    events = store.entry_events(key)
    interrupted = [e for e in events if e.event == "interrupted"]
    assert interrupted, [e.event for e in events]
    expected = "lease expired" if how == "beat" else "previous boot"
    assert expected in (interrupted[0].detail or "")
    assert store.get_entry(key).status is EntryStatus.COMPLETED


def test_pool_process_killed_is_interrupted_before_its_lease_expires(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, CELERY_LEDGER_LEASE_SECONDS="120")
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.order", args=("fast-1", 1), kwargs={"pause": 5.0})
        wait_for(lambda: step_completed(pg_url, "fast-1"), timeout=30, what="the first step")
        store = LedgerStore(pg_url)
        key = business_key("tests_app.order", order_id="fast-1")
        lease_until = store.get_entry(key).lease_until
        killed_at = store.now()
        for child in worker.children():
            worker.kill_child(child)
        wait_for(
            lambda: "interrupted" in event_names(store, key),
            timeout=20,
            what="the worker-lost fast path",
        )
        marked = next(e for e in store.entry_events(key) if e.event == "interrupted")
        assert marked.at < lease_until, "waited for the lease instead of the fast path"
        assert marked.at - killed_at < 20
        assert "pool process" in (marked.detail or "")
        assert result.get(timeout=60)["order_id"] == "fast-1"
    assert effects_of(pg_url, "fast-1") == ORDER_EFFECTS


def test_paused_worker_is_fenced_out_after_takeover(tmp_path, redis, pg_url):
    """SIGSTOP past the lease: another worker takes over; after SIGCONT the paused attempt's
    next step is refused and nothing happens twice."""
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_LEASE_SECONDS="2",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        zombie = procs.worker("zombie", concurrency=1)
        result = app.send_task("tests_app.order", args=("zz-1", 1), kwargs={"pause": 3.0})
        wait_for(lambda: step_completed(pg_url, "zz-1"), timeout=30, what="the first step")
        zombie.pause()  # SIGSTOP the group: parent, pool process and heartbeat thread
        try:
            procs.worker("w2", concurrency=1)
            procs.beat()
            value = result.get(timeout=90)
        finally:
            zombie.resume()
        zombie.wait_log("superseded", timeout=30)
        # Whatever the woken attempt would still do, it does before its worker exits: a warm
        # shutdown waits for the running task. Count the effects only after that.
        zombie.terminate()
        zombie.proc.wait(timeout=60)
    assert value["steps"] == ["reserve:zz-1", "charge:zz-1", "receipt:zz-1"]
    assert effects_of(pg_url, "zz-1") == ORDER_EFFECTS
    store = LedgerStore(pg_url)
    key = business_key("tests_app.order", order_id="zz-1")
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.COMPLETED and entry.fence >= 3


class RecordingApp:
    """Stands in for the Celery app in sweeps: records what would be enqueued."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self._lock = threading.Lock()

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        with self._lock:
            self.sent.append(options["task_id"])


def make_interrupted(
    store: LedgerStore, n: int, task: str = "tests_app.order", queue: str | None = None
) -> list[str]:
    keys = []
    for i in range(n):
        key = business_key(task, order_id=f"race-{i}")
        snapshot = json.dumps(
            {"args": [f"race-{i}", 1], "kwargs": {}, "queue": queue, "ledger_key": None}
        )
        args_hash = hashlib.sha256(canonical_arguments([[f"race-{i}", 1], {}]).encode()).hexdigest()
        store.claim(
            ClaimRequest(
                key=key,
                task_name=task,
                task_id=f"tid-{i}",
                args_hash=args_hash,
                snapshot=snapshot,
                side_effect="non_idempotent",
                owner=Owner("dead@host", "b0", 1),
                lease_seconds=0.01,
            )
        )
        # The dead attempt had completed its first step: the resumed body replays it (a
        # body with no step rows at all would be ambiguous as a whole, and block).
        ident = ("reserve", arguments_hash([[f"race-{i}", "reserve"], {}]), 0)
        store.write_step(
            key, 1, ident, seq=1, status=StepStatus.COMPLETED, output=f'"reserve:race-{i}"'
        )
        keys.append(key)
    time.sleep(0.05)
    return keys


def test_concurrent_sweeps_resume_each_entry_once(ledger_url):
    store = LedgerStore(ledger_url)
    keys = make_interrupted(store, 20)
    app = RecordingApp()
    errors: list[BaseException] = []

    def sweep() -> None:
        try:
            run_sweep(
                LedgerStore(ledger_url),
                app,
                lease_seconds=60,
                max_resumes=5,
                retention_days=7,
                batch=50,
            )
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=sweep) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert sorted(app.sent) == sorted(f"tid-{i}" for i in range(20))
    for key in keys:
        assert event_names(store, key).count("resuming") == 1


def test_resume_entry_reports_each_outcome_and_takes_the_crash_loop_rule_from_the_ledger(
    ledger_url,
):
    store = LedgerStore(ledger_url)
    make_interrupted(store, 2)
    looping, fine = sorted(store.interrupt_expired(), key=lambda e: e.task_id)
    assert (looping.interruptions, fine.interruptions) == (1, 1)
    app = RecordingApp()

    def resume(entry, max_resumes):
        return resume_entry(store, app, entry, lease_seconds=60, max_resumes=max_resumes)

    # One interruption over ledger_max_resumes=0: the ledger's crash-loop rule blocks it.
    assert resume(looping, 0) is ResumeOutcome.BLOCKED
    entry = store.get_entry(looping.key)
    assert (entry.status, entry.reason) == (EntryStatus.BLOCKED, crash_loop_reason(1, 0))
    assert resume(looping, 0) is ResumeOutcome.LOST_RACE  # the block moved the fence
    # Within the limit: no snapshot is reported, never guessed; with one it is re-sent once.
    assert resume(replace(fine, has_snapshot=False), 1) is ResumeOutcome.NO_SNAPSHOT
    assert resume(fine, 1) is ResumeOutcome.RESUMED
    assert resume(fine, 1) is ResumeOutcome.LOST_RACE  # another resumer won the CAS
    assert app.sent == [fine.task_id]
    assert [o.value for o in ResumeOutcome] == [
        "resumed",
        "blocked",
        "no-snapshot",
        "lost-race",
        "deferred",
    ]


def test_two_beats_resume_each_entry_once(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, CELERY_LEDGER_SWEEP_INTERVAL="1")
    store = LedgerStore(pg_url)
    keys = make_interrupted(store, 10, queue=env["TEST_QUEUE"])
    with processes(tmp_path, env) as procs:
        procs.beat("beat1")
        procs.beat("beat2")
        procs.worker("w1", concurrency=2)
        wait_for(
            lambda: all(store.get_entry(k).status is EntryStatus.COMPLETED for k in keys),
            timeout=90,
            what="every interrupted entry to complete",
        )
    for i, key in enumerate(keys):
        assert event_names(store, key).count("resuming") == 1
        assert effects_of(pg_url, f"race-{i}") == {"charge": 1, "receipt": 1}  # reserve replayed


def test_crash_loop_is_blocked_and_the_queue_keeps_flowing(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, CELERY_LEDGER_MAX_RESUMES="2")
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        bomb = app.send_task("tests_app.crash_always", args=("bomb",))
        orders = [app.send_task("tests_app.order", args=(f"flow-{i}", i)) for i in range(5)]
        with pytest.raises(Exception, match="crash loop") as info:
            bomb.get(timeout=120)
        assert type(info.value).__name__ == "LedgerBlocked"
        assert [r.get(timeout=60)["order_id"] for r in orders] == [f"flow-{i}" for i in range(5)]
    store = LedgerStore(pg_url)
    entry = store.get_entry(key_of("tests_app.crash_always", bomb.id))
    assert entry.status is EntryStatus.BLOCKED
    assert "interrupted 3 times" in (entry.reason or "")


@pytest.mark.parametrize("publish", ["apply_async", "send_task"])
def test_message_lost_before_any_claim_is_resent_from_its_publish_intent(tmp_path, publish):
    """filesystem:// deletes a message when a worker fetches it, so a worker killed between
    fetch and claim takes the message with it. With publish intents (on by default for that
    broker) the ledger knows the task from the moment it was sent, through ``apply_async`` or
    by name through ``send_task``: the intent's lease expires, the sweep re-sends it, and it
    runs once."""
    from pathlib import Path

    from celery_ledger import LedgerTask, create_app

    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    env = test_env(tmp_path, broker=None, ledger_url=ledger, CELERY_LEDGER_SWEEP_INTERVAL="1")
    producer = create_app(
        "producer",
        data_dir=env["CELERY_LEDGER_DATA_DIR"],
        ledger_url=ledger,
        ledger_publish_intent_seconds=2,
        task_default_queue=env["TEST_QUEUE"],
    )

    @producer.task(
        base=LedgerTask, bind=True, name="tests_app.order", key_from=("order_id",), shared=False
    )
    def order(self: Any, order_id: str, amount: int, pause: float = 0.0) -> None:
        raise AssertionError("the producer never runs the body")

    if publish == "apply_async":
        result = order.apply_async(("lost-1", 7))
    else:
        result = producer.send_task("tests_app.order", args=("lost-1", 7))
    queued = list((Path(env["CELERY_LEDGER_DATA_DIR"]) / "broker").glob("*.msg"))
    assert len(queued) == 1
    queued[0].unlink()  # the broker lost it: no worker will ever see this message
    store = LedgerStore(ledger)
    key = business_key("tests_app.order", order_id="lost-1")
    assert store.get_entry(key).executions == 0
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        procs.beat()
        value = result.get(timeout=60)
    assert value["steps"] == ["reserve:lost-1", "charge:lost-1", "receipt:lost-1"]
    assert effects_of(ledger, "lost-1") == ORDER_EFFECTS
    events = event_names(store, key)
    assert events[:2] == ["queued", "interrupted"] and "resuming" in events
    assert events.count("claimed") == 1 and store.get_entry(key).executions == 1


def test_send_task_records_an_intent_only_for_a_ledger_task_it_knows(tmp_path):
    """By name, the publisher records an intent when a ledger app of its process registers
    the name as a LedgerTask; an unknown name, or a plain task, gets none; one publish writes
    one ``queued`` event, whichever way in."""
    from celery_ledger import LedgerTask, create_app

    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    producer = create_app("producer", data_dir=tmp_path / "data", ledger_url=ledger)

    @producer.task(base=LedgerTask, name="intent.ledgered", key_from=("order_id",), shared=False)
    def ledgered(order_id: str) -> None:
        raise AssertionError("never runs here")

    @producer.task(name="intent.plain", shared=False)
    def plain(order_id: str) -> None:
        raise AssertionError("never runs here")

    store = LedgerStore(ledger)
    producer.send_task("intent.ledgered", args=("by-name",))
    ledgered.apply_async(("by-call",))
    producer.send_task("intent.plain", args=("plain",))
    producer.send_task("intent.unknown", args=("unknown",))
    for order_id in ("by-name", "by-call"):
        key = business_key("intent.ledgered", order_id=order_id)
        assert store.get_entry(key).executions == 0
        assert event_names(store, key) == ["queued"]
    assert [e.task_name for e in store.list_entries(limit=10)] == ["intent.ledgered"] * 2


def test_an_intent_whose_canvas_does_not_fit_keeps_its_arguments(tmp_path, caplog):
    """A publish intent's snapshot keeps the task's place in its canvas, so that a re-send
    continues its chain. When the arguments fit ``ledger_max_snapshot_bytes`` but the rest of
    the chain does not, the intent is still recorded, with its arguments alone, and a warning
    says so: without it, a message the broker lost before any claim would not be re-sent at
    all."""
    from celery import chain

    from celery_ledger import LedgerTask, create_app

    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    producer = create_app(
        "producer",
        data_dir=tmp_path / "data",
        ledger_url=ledger,
        ledger_max_snapshot_bytes=2_000,
    )

    @producer.task(base=LedgerTask, name="intent.link", shared=False)
    def link(acc: list[str], note: str) -> None:
        raise AssertionError("never runs here")

    first = link.s([], "first")
    rest = [link.s("x" * 300) for _ in range(10)]  # the chain's rest: over 2,000 bytes
    with caplog.at_level("WARNING", logger="celery_ledger.intents"):
        result = chain(first, *rest).apply_async()
    head = result
    while head.parent is not None:
        head = head.parent
    store = LedgerStore(ledger)
    entry = store.get_entry(key_of("intent.link", head.id))
    assert entry.executions == 0 and event_names(store, entry.key) == ["queued"]
    snapshot = json.loads(entry.snapshot or "{}")
    assert snapshot["args"] == [[], "first"] and not snapshot.get("canvas")
    assert any("no canvas placement" in r.getMessage() for r in caplog.records), caplog.text


# == overdue retries, unreadable snapshots, one bad entry (the hardening faults 3, 4, 12) =====


class OptionsApp(RecordingApp):
    """Also records the args and options each send carried."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[tuple[list[Any], dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        super().send_task(name, args, kwargs, **options)
        self.sends.append((list(args or ()), options))


def retrying(store: LedgerStore, key: str, *, due_in: float, snapshot: str | None) -> int:
    claim = store.claim(
        ClaimRequest(
            key=key,
            task_name="tests_app.retry_once",
            task_id=f"tid-{key}",
            args_hash="task-id",
            snapshot='{"args":["first"],"kwargs":{},"queue":null,"ledger_key":null}',
            side_effect="non_idempotent",
            owner=Owner("w@host", "b0", 1),
            lease_seconds=60.0,
        )
    )
    assert store.settle(key, claim.fence, EntryStatus.RETRYING, due_in=due_in, snapshot=snapshot)
    return claim.fence


def test_sweeps_resend_an_overdue_retry_once_with_the_retrys_arguments(ledger_url):
    store = LedgerStore(ledger_url)
    try:
        retry = '{"args":["second"],"kwargs":{},"queue":"q-1","ledger_key":null,"retries":2}'
        retrying(store, "late", due_in=-1.0, snapshot=retry)
        retrying(store, "not-yet", due_in=60.0, snapshot=retry)
        app = OptionsApp()
        reports: list[Any] = []

        def sweep() -> None:
            reports.append(run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7))

        threads = [threading.Thread(target=sweep) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert app.sent == ["tid-late"]
        [(args, options)] = app.sends
        assert args == ["second"]
        assert (options["queue"], options["retries"], options["headers"]["ledger_redelivery"]) == (
            "q-1",
            2,
            True,
        )
        assert sum(r.resent for r in reports) == 1 and all(r.errors == 0 for r in reports)
        assert event_names(store, "late").count("resent") == 1
        assert store.get_entry("late").status is EntryStatus.RETRYING
    finally:
        store.dispose()


def test_an_overdue_retry_whose_snapshot_cannot_be_read_is_parked(ledger_url):
    store = LedgerStore(ledger_url)
    try:
        deep = '{"args":[' + "[" * 5000 + "]" * 5000 + '],"kwargs":{}}'
        retrying(store, "deep", due_in=-1.0, snapshot=deep)
        app = OptionsApp()
        report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7)
        assert app.sent == [] and report.blocked == 1
        entry = store.get_entry("deep")
        assert entry.status is EntryStatus.BLOCKED and entry.due_at is None
        assert entry.reason.startswith("argument snapshot cannot be read: nested too deeply")
    finally:
        store.dispose()


def test_one_entry_that_fails_never_aborts_the_sweep_or_the_prune(ledger_url, monkeypatch):
    store = LedgerStore(ledger_url)
    try:
        keys = make_interrupted(store, 3)
        done = store.claim(
            ClaimRequest("done", "t", "tid-done", "h", None, "read", Owner("w", "b", 1), 60.0)
        )
        assert store.settle("done", done.fence, EntryStatus.COMPLETED, result="1")
        real = store.block_crash_loop

        def broken(entry: Any, **kw: Any) -> Any:
            if entry.key == keys[0]:
                raise RuntimeError("a bug met by one entry")
            return real(entry, **kw)

        monkeypatch.setattr(store, "block_crash_loop", broken)
        app = RecordingApp()
        report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=-1)
        assert report.errors == 1 and report.resumed == 2 and report.pruned == 1
        assert sorted(app.sent) == ["tid-1", "tid-2"]
    finally:
        store.dispose()


def test_the_sweep_passes_over_entries_it_cannot_resume(ledger_url):
    """guarantees.md § "The hardening faults", fault 4: entries without a snapshot are reported and
    left interrupted (the
    broker may still deliver them); they never fill the batch in front of newer work."""
    store = LedgerStore(ledger_url)
    try:
        bare = [
            store.claim(
                ClaimRequest(
                    f"bare-{i}", "t", f"tid-b{i}", "h", None, "read", Owner("w", "b", 1), 0.01
                )
            )
            for i in range(3)
        ]
        assert len(bare) == 3
        time.sleep(0.05)
        assert len(store.interrupt_expired()) == 3
        keys = make_interrupted(store, 1)
        assert len(store.interrupt_expired()) == 1  # the newest, after the three
        app = RecordingApp()
        report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7, batch=3)
        assert app.sent == ["tid-0"] and report.no_snapshot == 3
        assert store.get_entry(keys[0]).status is EntryStatus.RUNNING  # resumed
        assert {store.get_entry(f"bare-{i}").status for i in range(3)} == {EntryStatus.INTERRUPTED}
    finally:
        store.dispose()

"""The runtime's pieces in one process: the write-retry helper, the argument snapshot, the
limits in settings, and the attempt as the one writer under its fence.

These prove code paths (``apply()`` runs a task in this process, with no broker delivery);
delivery semantics are proven with real workers in ``test_steps_crash``, ``test_recovery`` and
``test_delivery``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu.utils.json import dumps, loads
from sqlalchemy import text

from celery_ledger import LedgerTask, Reconciled, runtime, timing
from celery_ledger.backoff import retry_while_unavailable
from celery_ledger.codec import arguments_hash, encode_snapshot
from celery_ledger.ledger import (
    ArgumentSnapshot,
    ClaimRequest,
    EntryStatus,
    LedgerStore,
    LedgerUnavailable,
    Owner,
    PayloadTooLarge,
    StepStatus,
    entry_key,
)
from celery_ledger.settings import LedgerSettings

# -- the one backoff loop ----------------------------------------------------------------------


class FakeTime:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, result: str = "written") -> tuple[Any, list[int]]:
    calls: list[int] = []

    def write() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise LedgerUnavailable(f"down (call {len(calls)})")
        return result

    return write, calls


def test_backoff_returns_at_once_when_the_write_succeeds() -> None:
    t = FakeTime()
    write, calls = failing(0)
    out = retry_while_unavailable(
        write, seconds=10, first_delay=0.1, max_delay=2.0, sleep=t.sleep, clock=t.clock
    )
    assert (out, len(calls), t.sleeps) == ("written", 1, [])


def test_backoff_doubles_up_to_the_largest_pause_and_returns_the_write() -> None:
    t = FakeTime()
    write, calls = failing(7)
    seen: list[tuple[str, float]] = []
    out = retry_while_unavailable(
        write,
        seconds=60,
        first_delay=0.1,
        max_delay=2.0,
        on_retry=lambda exc, delay: seen.append((str(exc), delay)),
        sleep=t.sleep,
        clock=t.clock,
    )
    assert out == "written" and len(calls) == 8
    assert t.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert [d for _, d in seen] == t.sleeps and seen[0][0] == "down (call 1)"


def test_backoff_gives_up_at_the_deadline_with_the_last_failure() -> None:
    t = FakeTime()
    write, calls = failing(1000)
    with pytest.raises(LedgerUnavailable, match=r"down \(call 5\)"):
        retry_while_unavailable(
            write, seconds=3.0, first_delay=0.1, max_delay=2.0, sleep=t.sleep, clock=t.clock
        )
    # 0.1 + 0.2 + 0.4 + 0.8 = 1.5 s slept; the next pause (1.6 s) would end past 3 s.
    assert t.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert len(calls) == 5 and t.now - 100.0 <= 3.0


def test_backoff_does_not_retry_other_errors() -> None:
    t = FakeTime()
    calls: list[int] = []

    def write() -> None:
        calls.append(1)
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        retry_while_unavailable(
            write, seconds=10, first_delay=0.1, max_delay=2.0, sleep=t.sleep, clock=t.clock
        )
    assert len(calls) == 1 and t.sleeps == []


# -- the argument snapshot ---------------------------------------------------------------------


def test_snapshot_json_is_the_format_entries_already_hold() -> None:
    """Entries written before ``ArgumentSnapshot`` hold this exact text; they must resume."""
    before = dumps({"args": ["o-1", 5], "kwargs": {"note": "x"}, "queue": "q", "ledger_key": None})
    text = encode_snapshot(
        ("o-1", 5), {"note": "x"}, queue="q", ledger_key=None, limit=16 * 1024 * 1024
    )
    assert text == before
    snap = ArgumentSnapshot.from_data(loads(text))
    assert snap == ArgumentSnapshot(args=("o-1", 5), kwargs={"note": "x"}, queue="q")


def test_snapshot_reads_objects_that_lack_keys() -> None:
    assert ArgumentSnapshot.from_data({}) == ArgumentSnapshot()
    snap = ArgumentSnapshot.from_data({"args": [1], "queue": "", "ledger_key": "k"})
    assert (snap.args, dict(snap.kwargs), snap.queue, snap.ledger_key) == ((1,), {}, None, "k")
    assert snap.as_data() == {"args": [1], "kwargs": {}, "queue": None, "ledger_key": "k"}


def test_an_oversized_snapshot_names_its_own_setting() -> None:
    with pytest.raises(PayloadTooLarge) as info:
        encode_snapshot(("x" * 2000,), {}, queue=None, ledger_key=None, limit=1000)
    message = str(info.value)
    assert "ledger_max_snapshot_bytes" in message and "ledger_max_result_bytes" not in message


def test_arguments_hash_is_sha256_of_canonical_json() -> None:
    import hashlib

    expected = hashlib.sha256(b'[["a",1],{"k":true}]').hexdigest()
    assert arguments_hash([["a", 1], {"k": True}]) == expected


# -- limits in settings ------------------------------------------------------------------------


def test_limits_and_backoff_are_settings() -> None:
    default = LedgerSettings.from_mapping({"ledger_url": "sqlite://"}, env={})
    assert (default.max_snapshot_bytes, default.max_exception_bytes) == (16 * 1024**2, 64 * 1024)
    assert (default.write_retry_delay, default.write_retry_delay_max) == (0.1, 2.0)
    tuned = LedgerSettings.from_mapping(
        {"ledger_url": "sqlite://", "ledger_max_snapshot_bytes": "4096"},
        env={
            "CELERY_LEDGER_MAX_EXCEPTION_BYTES": "2048",
            "CELERY_LEDGER_WRITE_RETRY_DELAY": "0.05",
            "CELERY_LEDGER_WRITE_RETRY_DELAY_MAX": "1",
        },
    )
    assert (tuned.max_snapshot_bytes, tuned.max_exception_bytes) == (4096, 2048)
    assert (tuned.write_retry_delay, tuned.write_retry_delay_max) == (0.05, 1.0)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"ledger_max_snapshot_bytes": 0}, "ledger_max_snapshot_bytes must be > 0"),
        ({"ledger_max_exception_bytes": -1}, "ledger_max_exception_bytes must be > 0"),
        ({"ledger_write_retry_delay": 3, "ledger_write_retry_delay_max": 2}, "write_retry"),
    ],
)
def test_bad_limits_are_refused(conf: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LedgerSettings.from_mapping({"ledger_url": "sqlite://", **conf}, env={})


# -- a task run in this process (``apply``) ----------------------------------------------------


def local_app(tmp_path: Path, **conf: Any) -> Celery:
    app = Celery("rt", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", **conf)
    return app


def test_snapshot_too_large_for_the_ledger_is_reported_with_its_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The task still runs; the warning names the limit that refused the snapshot."""
    app = local_app(tmp_path)

    @app.task(base=LedgerTask, bind=True, name="rt.big_args", shared=False)
    def big_args(self: LedgerTask, blob: str) -> int:
        return len(blob)

    blob = "x" * (16 * 1024 * 1024 + 1)  # over the default ledger_max_snapshot_bytes
    with caplog.at_level(logging.WARNING, logger="celery_ledger.delivery"):
        result = big_args.apply(args=(blob,), task_id="big-1")
    assert result.get() == len(blob)
    (warning,) = [r.getMessage() for r in caplog.records if "no argument snapshot" in r.message]
    assert "ledger_max_snapshot_bytes" in warning and "ledger_max_result_bytes" not in warning
    entry = LedgerStore(app.conf.ledger_url).get_entry(entry_key("rt.big_args", "big-1"))
    assert entry.status is EntryStatus.COMPLETED and entry.snapshot is None


@pytest.mark.parametrize(
    "child, words",
    [
        ("not a signature", "send() takes a task signature"),
        # guarantees.md § "Bad input", item 2: an option no publish could send is refused as at
        # send().
        ({"countdown": float("nan")}, "countdown"),
    ],
    ids=["not-a-signature", "countdown-nan"],
)
def test_a_reconciled_child_the_outbox_cannot_keep_parks_the_entry(
    tmp_path: Path, child: Any, words: str
) -> None:
    """A reconciler's ``completed`` whose children cannot be recorded (not a signature, an
    option no publish could send) is no answer: the entry is parked for an operator, and
    neither the verdict nor a child is written (a verdict recorded without its children would
    lose them for good)."""
    app = local_app(tmp_path)
    if isinstance(child, dict):
        child = app.signature("rt.notice", **child)

    @app.task(
        base=LedgerTask,
        bind=True,
        name="rt.charge",
        shared=False,
        reconciler=lambda step: Reconciled.completed("charged", children=[child]),
    )
    def charge(self: LedgerTask, order_id: str) -> Any:
        return self.step("charge", lambda: f"charged {order_id}")

    store = runtime.store_for(app)
    key = entry_key("rt.charge", "t-1")
    dead = Owner(node="celery@gone", boot="old-boot", pid=4242)
    snapshot = json.dumps({"args": ["o-1"], "kwargs": {}, "queue": None, "ledger_key": None})
    claim = store.claim(
        ClaimRequest(
            key=key,
            task_name="rt.charge",
            task_id="t-1",
            args_hash="task-id",
            snapshot=snapshot,
            side_effect="non_idempotent",
            owner=dead,
            lease_seconds=60.0,
        )
    )
    ident = ("charge", arguments_hash([[], {}]), 0)
    assert store.write_step(key, claim.fence, ident, seq=1, status=StepStatus.STARTED)
    assert store.interrupt_owner(
        key, node=dead.node, boot=dead.boot, pid=dead.pid, actor="test", why="killed"
    )
    charge.apply(args=("o-1",), task_id="t-1")
    entry = store.get_entry(key)
    assert entry.status is EntryStatus.BLOCKED, entry.status
    assert words in (entry.reason or ""), entry.reason
    assert [s.status for s in store.load_steps(key)] == [StepStatus.STARTED]
    assert store.children_of(key) == []


def test_a_reconciled_verdict_is_retried_while_the_ledger_is_briefly_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciler's ``completed`` is a fenced write of the attempt like a step's: it goes
    through the same retry, so a blip does not throw the resumed attempt back to the queue."""
    app = local_app(tmp_path, ledger_write_retry_delay=0.01, ledger_write_retry_delay_max=0.01)
    effects: list[str] = []

    @app.task(
        base=LedgerTask,
        bind=True,
        name="rt.charge",
        shared=False,
        reconciler=lambda step: Reconciled.completed(f"charged {step.args[0]}"),
    )
    def charge(self: LedgerTask, order_id: str) -> Any:
        return self.step("charge", lambda: effects.append(order_id) or f"charged {order_id}")

    # An earlier attempt started the step and died: the entry is interrupted, the row started.
    store = runtime.store_for(app)
    key = entry_key("rt.charge", "t-1")
    dead = Owner(node="celery@gone", boot="old-boot", pid=4242)
    snapshot = json.dumps({"args": ["o-1"], "kwargs": {}, "queue": None, "ledger_key": None})
    claim = store.claim(
        ClaimRequest(
            key=key,
            task_name="rt.charge",
            task_id="t-1",
            args_hash="task-id",
            snapshot=snapshot,
            side_effect="non_idempotent",
            owner=dead,
            lease_seconds=60.0,
        )
    )
    ident = ("charge", arguments_hash([[], {}]), 0)
    assert store.write_step(key, claim.fence, ident, seq=1, status=StepStatus.STARTED)
    assert store.interrupt_owner(
        key, node=dead.node, boot=dead.boot, pid=dead.pid, actor="test", why="killed"
    )

    real_write = store.write_step
    refused: list[StepStatus] = []

    def blip(*args: Any, **kwargs: Any) -> bool:
        if kwargs.get("status") is StepStatus.COMPLETED and not refused:
            refused.append(kwargs["status"])
            raise LedgerUnavailable("ledger restarting")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store, "write_step", blip)
    result = charge.apply(args=("o-1",), task_id="t-1")
    assert result.get() == "charged o-1"
    assert refused == [StepStatus.COMPLETED] and effects == []
    assert store.get_entry(key).status is EntryStatus.COMPLETED
    (row,) = store.load_steps(key)
    assert row.status is StepStatus.COMPLETED and loads(row.output) == "charged o-1"


def test_a_retry_is_due_at_its_eta_plus_the_grace_with_its_own_arguments(tmp_path: Path) -> None:
    """design.md § "Recovery": what ``settle(retrying)`` stores so the sweep can re-send a
    lost retry (``timing.retry_due``): the due time (countdown or ETA, plus
    ``ledger_retry_grace_seconds``) and the retry's own arguments and retry count."""
    from datetime import datetime, timezone

    from celery.exceptions import Retry

    app = local_app(tmp_path, ledger_retry_grace_seconds=10)

    @app.task(base=LedgerTask, bind=True, name="rt.later", shared=False)
    def later(self: LedgerTask, value: str) -> str:
        return value

    settings = runtime.settings_for(app)
    later.push_request(id="t-1", retries=0, delivery_info={"routing_key": "q-1"})
    try:
        sig = later.signature_from_request(later.request, ("changed",), {}, countdown=5, retries=1)
        due = timing.retry_due(later, Retry(when=5, sig=sig), settings)
        assert due["due_in"] == 15.0
        assert loads(due["snapshot"]) == {
            "args": ["changed"],
            "kwargs": {},
            "queue": "q-1",
            "ledger_key": None,
            "retries": 1,
        }
        eta = datetime(2030, 1, 1, tzinfo=timezone.utc)
        assert timing.retry_due(later, Retry(when=eta), settings) == {
            "due_at": eta.timestamp() + 10
        }
        naive = eta.replace(tzinfo=None)  # Celery reads a naive ETA as UTC
        assert timing.retry_due(later, Retry(when=naive), settings) == {
            "due_at": eta.timestamp() + 10
        }
        assert timing.retry_due(later, Retry(when=eta.isoformat()), settings)[
            "due_at"
        ] == pytest.approx(eta.timestamp() + 10)
        assert timing.retry_due(later, Retry(), settings) == {"due_in": 10.0}
    finally:
        later.pop_request()
    with pytest.raises(ValueError, match="ledger_retry_grace_seconds must be >= 0"):
        LedgerSettings.from_mapping({"ledger_url": "sqlite://", "ledger_retry_grace_seconds": -1})


def test_events_follow_the_setting_and_are_fixed_when_a_worker_starts() -> None:
    """``events_enabled`` reads ``ledger_send_events``, else ``worker_send_task_events``; a
    worker fixes it at start (``fix_events``, after ``-E`` is copied into the configuration),
    so the pool does not look the setting up for every event."""
    app = Celery("events", broker="memory://", set_as_current=False)
    assert runtime.events_enabled(app) is False
    app.conf.worker_send_task_events = True
    assert runtime.events_enabled(app) is True
    runtime.fix_events(app)
    app.conf.worker_send_task_events = False
    assert runtime.events_enabled(app) is True  # fixed for this worker's life
    explicit = Celery("events-off", broker="memory://", set_as_current=False)
    explicit.conf.worker_send_task_events = True
    explicit.conf.ledger_send_events = False
    runtime.fix_events(explicit)
    assert runtime.events_enabled(explicit) is False


# -- a keyed body without steps, taken over past its provider's key window (the seams' fault 11)


def _keyed_bare(
    app: Celery, effects: list[str], *, ttl: float, reconciler: Any = None
) -> LedgerTask:
    @app.task(
        base=LedgerTask,
        bind=True,
        name="rt.keyed_bare",
        shared=False,
        side_effect="keyed",
        provider_key_ttl=ttl,
        reconciler=reconciler,
    )
    def keyed_bare(self: LedgerTask, order_id: str) -> str:
        effects.append(order_id)  # records no steps: the body is the keyed effect
        return f"charged {order_id}"

    return keyed_bare


def _ran_and_died(app: Celery, *, published_ago: float = 0.0, first_run_ago: float) -> str:
    """An earlier attempt ran the body of ``rt.keyed_bare[t-1]`` ``first_run_ago`` seconds
    ago (its first ``claimed``) and died; its entry is interrupted. With ``published_ago``
    the entry was a publish intent recorded that long ago. Times are moved back in the rows
    (time does not pass here)."""
    store = runtime.store_for(app)
    key = entry_key("rt.keyed_bare", "t-1")
    dead = Owner(node="celery@gone", boot="old-boot", pid=4242)
    snapshot = json.dumps({"args": ["o-1"], "kwargs": {}, "queue": None, "ledger_key": None})
    req = ClaimRequest(
        key=key,
        task_name="rt.keyed_bare",
        task_id="t-1",
        args_hash="task-id",
        snapshot=snapshot,
        side_effect="keyed",
        owner=dead,
        lease_seconds=60.0,
    )
    if published_ago:
        assert store.record_intent(req)
    assert store.claim(req).executions == 0  # this claim is the first execution
    assert store.interrupt_owner(
        key, node=dead.node, boot=dead.boot, pid=dead.pid, actor="test", why="killed"
    )
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE ledger_entries SET created_at = created_at - :s WHERE key = :k"),
            {"s": max(published_ago, first_run_ago), "k": key},
        )
        conn.execute(
            text("UPDATE ledger_events SET at = at - :s WHERE key = :k AND event = 'queued'"),
            {"s": published_ago, "k": key},
        )
        conn.execute(
            text("UPDATE ledger_events SET at = at - :s WHERE key = :k AND event = 'claimed'"),
            {"s": first_run_ago, "k": key},
        )
    return key


def test_a_keyed_body_without_steps_past_its_key_window_is_blocked_not_rerun(
    tmp_path: Path,
) -> None:
    """guarantees.md § "The seams", fault 11: the body ran 5 s ago, the provider forgets keys after
    1 s, no reconciler:
    the takeover does not run it again; the entry is blocked with a reason naming the window."""
    app = local_app(tmp_path)
    effects: list[str] = []
    task = _keyed_bare(app, effects, ttl=1.0)
    key = _ran_and_died(app, first_run_ago=5.0)
    task.apply(args=("o-1",), task_id="t-1")
    entry = runtime.store_for(app).get_entry(key)
    assert effects == [], "the body ran again with a key the provider may have forgotten"
    assert entry.status is EntryStatus.BLOCKED, entry.status
    assert "provider_key_ttl" in (entry.reason or ""), entry.reason


def test_a_keyed_body_without_steps_past_its_key_window_asks_its_reconciler(
    tmp_path: Path,
) -> None:
    """guarantees.md § "The seams", fault 11: past the window, the reconciler finds the charge: it
    is the result, and the body does not run again."""
    app = local_app(tmp_path)
    effects: list[str] = []
    asked: list[str] = []

    def found(step: Any) -> Reconciled:
        asked.append(step.step)
        return Reconciled.completed(f"charged {step.args[0]}")

    task = _keyed_bare(app, effects, ttl=1.0, reconciler=found)
    key = _ran_and_died(app, first_run_ago=5.0)
    assert task.apply(args=("o-1",), task_id="t-1").get() == "charged o-1"
    assert effects == [] and asked == ["__body__"]
    assert runtime.store_for(app).get_entry(key).status is EntryStatus.COMPLETED


def test_a_keyed_body_without_steps_is_judged_from_its_first_execution(tmp_path: Path) -> None:
    """Published 60 s ago (a publish intent) but first run 1 s ago, with a 30 s window: the
    window is judged from the first execution, so the body re-runs with its key as ``keyed``
    allows; the reconciler is not asked."""
    app = local_app(tmp_path)
    effects: list[str] = []
    asked: list[str] = []

    def never(step: Any) -> Reconciled:
        asked.append(step.step)
        return Reconciled.unknown("should not be asked")

    task = _keyed_bare(app, effects, ttl=30.0, reconciler=never)
    key = _ran_and_died(app, published_ago=60.0, first_run_ago=1.0)
    assert task.apply(args=("o-1",), task_id="t-1").get() == "charged o-1"
    assert effects == ["o-1"] and asked == []
    assert runtime.store_for(app).get_entry(key).status is EntryStatus.COMPLETED

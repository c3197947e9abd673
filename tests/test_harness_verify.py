"""``verify``'s harness where the machine's speed used to decide the outcome.

When the settle phase calls a run over (``orchestrate.Workload.settle_tick``): a
ledgered run whose orders are all final while its canvas is not (a chord member still waiting
for its lease and a sweep, a callback still queued) is not idle, however long that takes on a
loaded machine; ``settle``'s own bound is what ends a canvas that never completes.

No worker runs there: the run's effects and ledger are real SQLite files, and the idle clock
is moved back by hand instead of waited out.

A chaos action drawn while no worker of any run is ready (one still starting after a kill) is
taken once one is, not lost: with ``--seed`` the actions taken are the seed's, not the load's.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from celery_ledger.harness import canvas_load, orchestrate
from celery_ledger.harness.processes import ProcessGroup, wait_for
from celery_ledger.harness.verify import KINDS, Chaos, ChaosLog, NoOutage

LEDGERED = next(k for k in KINDS if k.ledgered)


def workload(tmp_path: Path, broker: str | None) -> orchestrate.Workload:
    box = orchestrate.Sandbox.create(prefix="settle", broker=broker, ledger=None, data_dir=tmp_path)
    orchestrate.prepare(box)
    # No order: every order is final. One chain and the chord, none of whose effects exist.
    work = orchestrate.Workload(
        LEDGERED, box, orch=None, orders=0, concurrency=1, env={}, ledger_idle=5.0
    )
    work.canvas_chains = 1
    return work


def idle_for_long(work: orchestrate.Workload) -> None:
    """As if nothing had moved for longer than the run's idle time (the effects counted
    first: a count that changed is progress)."""
    work.refresh()
    work._progress_at = time.monotonic() - 10 * work.ledger_idle


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    from celery_ledger.ledger.engine import make_engine

    eng = make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    try:
        yield eng
    finally:
        eng.dispose()


def test_an_unsettled_chord_keeps_a_run_on_a_real_broker_from_going_idle(
    tmp_path: Path, engine: object
) -> None:
    work = workload(tmp_path, "redis://127.0.0.1:6379/15")
    try:
        idle_for_long(work)
        assert work.settle_tick(engine) is False, "the run went idle with its chord unsettled"
        assert not work.finished
        # Once the chord and the chain are complete, the run is over at once.
        for n in range(canvas_load.CHORD_SIZE):
            work.db.record(work.run, canvas_load.chord_id(work.run), f"link{n}")
        work.db.record(work.run, canvas_load.chord_id(work.run), "join")
        for n in range(1, canvas_load.CHAIN_LENGTH + 1):
            work.db.record(work.run, canvas_load.chain_id(work.run, 0), f"link{n}")
        assert work.settle_tick(engine) is True
    finally:
        work.db.dispose()


def test_on_the_embedded_broker_an_idle_run_ends_with_its_canvas_incomplete(
    tmp_path: Path, engine: object
) -> None:
    # filesystem:// may drop a member before any claim (CanvasReport.strict): idle still ends it.
    work = workload(tmp_path, None)
    try:
        idle_for_long(work)
        assert work.settle_tick(engine) is True
    finally:
        work.db.dispose()


def test_on_the_embedded_broker_a_chord_whose_members_are_done_waits_for_its_callback(
    tmp_path: Path, engine: object
) -> None:
    # Every member done and no callback is a lost join on any broker (CanvasReport.ok): on
    # filesystem:// the callback a killed worker had fetched comes back with its publish
    # intent's re-send, later than the idle time, so the run must not go idle before it.
    work = workload(tmp_path, None)
    try:
        for n in range(canvas_load.CHORD_SIZE):
            work.db.record(work.run, canvas_load.chord_id(work.run), f"link{n}")
        idle_for_long(work)
        assert work.settle_tick(engine) is False, "the run went idle with its chord's join lost"
        work.db.record(work.run, canvas_load.chord_id(work.run), "join")
        idle_for_long(work)
        assert work.settle_tick(engine) is True  # the chain may stay incomplete here
    finally:
        work.db.dispose()


#: A stand-in worker: a parent that forks one child (its pool process), and says " ready."
#: only once the file named by its argument exists.
GATED = r"""
import os, sys, time
from pathlib import Path
if os.fork() == 0:
    while True:
        time.sleep(0.05)
print("starting", flush=True)
while not Path(sys.argv[1]).exists():
    time.sleep(0.05)
print("w1 ready.", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_kill_drawn_before_any_worker_is_ready_is_taken_once_one_is(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with ProcessGroup(tmp_path) as group:
        proc = group.spawn("w1", [sys.executable, "-c", GATED, str(gate)], ready_marker=" ready.")
        proc.wait_log("starting", timeout=60)
        run = SimpleNamespace(workers={"w1": proc}, kind=LEDGERED)
        log = ChaosLog()
        chaos = Chaos([run], random.Random(1), NoOutage("none here"), log)  # type: ignore[list-item]
        chaos.actions, chaos.weights = ["kill-child"], [1]
        chaos.next_at = time.monotonic()
        chaos.tick()  # drawn now: no worker is ready
        assert log.actions == []
        gate.touch()
        proc.wait_ready(timeout=60)
        wait_for(proc.children, timeout=30, what="the pool process")
        chaos.next_at = time.monotonic() + 3600  # nothing new is due: only the drawn kill
        chaos.tick()
        assert [a["action"] for a in log.actions] == ["kill-child"], log.actions


class _Run:
    """A run as ``Stage.settle`` sees it: never finished, moving until ``moving_until``."""

    def __init__(self, moving_until: float, *, ledgered: bool = True) -> None:
        self.finished = False
        self.kind = SimpleNamespace(ledgered=ledgered)
        self.moving_until = moving_until

    def settle_tick(self, ledger_engine: object) -> bool:
        return False

    def moving(self, within: float) -> bool:
        return time.monotonic() < self.moving_until


def _settle(run: _Run, **bounds: float) -> float:
    stage = orchestrate.Stage(box=None, orch=None, ledger_engine=None)
    stage.works.append(run)
    started = time.monotonic()
    stage.settle(interval=0.01, update=lambda: None, **bounds)
    return time.monotonic() - started


def test_settle_stretches_its_bound_while_a_run_still_records_effects() -> None:
    # Moving for 0.6 s: the 0.2 s bound stretches to it (not to the 5 s cap).
    spent = _settle(_Run(time.monotonic() + 0.6), seconds=0.2, while_moving=1.0, cap=5.0)
    assert 0.6 <= spent < 3.0
    # Without ``while_moving`` the bound is the bound.
    assert _settle(_Run(time.monotonic() + 5.0), seconds=0.2) < 1.0
    # A plain run does not stretch it: its redeliveries can record duplicates for ever.
    assert (
        _settle(
            _Run(time.monotonic() + 5.0, ledgered=False), seconds=0.2, while_moving=1.0, cap=5.0
        )
        < 1.0
    )
    # A run that moves for ever is stopped by the cap.
    spent = _settle(_Run(time.monotonic() + 60.0), seconds=0.2, while_moving=1.0, cap=0.5)
    assert 0.5 <= spent < 2.0


def test_an_unsettled_outbox_child_keeps_a_ledgered_run_from_going_idle(tmp_path: Path) -> None:
    """Every order is completed, but the child one of them sent is still running (its message
    lost, waiting for a sweep): work the ledger owns, so the run is neither over nor idle."""
    from celery_ledger.harness import demo_app
    from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner

    box = orchestrate.Sandbox.create(prefix="settle", broker=None, ledger=None, data_dir=tmp_path)
    orchestrate.prepare(box)
    work = orchestrate.Workload(
        LEDGERED, box, orch=None, orders=1, concurrency=1, env={}, ledger_idle=5.0
    )
    (order,) = work.order_ids
    assert demo_app.sends_child(order)
    store = LedgerStore(box.ledger_url)

    def claimed(key: str, task: str) -> int:
        req = ClaimRequest(
            key=key,
            task_name=task,
            task_id=key[:36],
            args_hash="h",
            snapshot=None,
            side_effect="non_idempotent",
            owner=Owner("celery@w1", "boot", 1),
            lease_seconds=60,
        )
        return store.claim(req).fence

    try:
        fence = claimed(demo_app.ledger_key(order), demo_app.LEDGERED)
        assert store.settle(demo_app.ledger_key(order), fence, EntryStatus.COMPLETED, result="1")
        child = demo_app.child_key(order)
        child_fence = claimed(child, demo_app.LEDGERED_NOTIFY)
        idle_for_long(work)
        assert work.settle_tick(store.engine) is False, "the run went idle with its child unsettled"
        assert store.settle(child, child_fence, EntryStatus.COMPLETED, result="1")
        assert work.settle_tick(store.engine) is True
    finally:
        store.dispose()
        work.db.dispose()


def test_keep_leaves_the_runs_redis_keys_for_a_post_mortem(
    tmp_path: Path, engine: object, redis: str
) -> None:
    # A failed run kept with --keep is read afterwards: what its queues and unacked hashes
    # still held is the evidence, so --keep leaves them; without it they are removed.
    # ``redis``: a database of this test's own (skips without Redis, fails under CI=true).
    import redis as redis_client

    from celery_ledger.harness import demo_app

    url = redis
    client = redis_client.Redis.from_url(url, socket_timeout=5)
    box = orchestrate.Sandbox.create(prefix="keep", broker=url, ledger=None, data_dir=tmp_path)
    key = demo_app.redis_keyprefix(box.namespace, "q") + "unacked"
    try:
        client.set(key, "a message a killed worker held")
        box.remove(True, [], engine)
        assert client.exists(key), "--keep removed the run's Redis keys"
        box.remove(False, [], engine)
        assert not client.exists(key)
    finally:
        client.delete(key)
        client.close()

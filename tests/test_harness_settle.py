"""When ``verify``'s settle phase calls a run over (``orchestrate.Workload.settle_tick``): a
ledgered run whose orders are all final while its canvas is not (a chord member still waiting
for its lease and a sweep, a callback still queued) is not idle, however long that takes on a
loaded machine; ``settle``'s own bound is what ends a canvas that never completes.

No worker runs: the run's effects and ledger are real SQLite files, and the idle clock is
moved back by hand instead of waited out.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_ledger.harness import canvas_load, orchestrate
from celery_ledger.harness.verify import KINDS

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

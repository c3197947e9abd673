"""verify counts a chain or chord stopped at a blocked task as blocked, not as lost.

``verify`` on PostgreSQL + Redis once failed with its chord at 9 of 10 members and no
callback, after a settle phase that ran its whole 120 s bound and restarted the workers five
times. A pool process SIGKILLed inside a member's ``effect`` step (its ``started`` row
written, the effect row not yet) leaves a step whose effect the reconciler cannot prove: the
takeover parks the member ``blocked`` for an operator, which is what the ledger promises (a
blocked order is counted as "what a crash cost"). The canvas tally counted the chord as lost
instead, and the settle phase waited for it until its bound.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_ledger.harness import canvas_load, demo_app
from celery_ledger.harness.orchestrate import Phases, staged
from celery_ledger.harness.verify import KINDS
from celery_ledger.ledger import EntryStatus

pytestmark = pytest.mark.processes

LEDGERED = next(k for k in KINDS if k.ledgered)

#: How long the killed task's takeover and the rest of the canvas may take.
WITHIN_SECONDS = 90.0


def test_a_canvas_task_killed_inside_its_effect_step_is_counted_blocked_not_lost(
    tmp_path: Path, redis: str
) -> None:
    env = {
        "CELERY_LEDGER_CRASH_AT": "step-started:effect",
        "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash-once"),
        "CELERY_RESULT_BACKEND": redis,
    }
    with staged(
        "celery-ledger-canvas", broker=redis, ledger=None, keep=False, phases=Phases(1, quiet=True)
    ) as stage:
        work = stage.workload(LEDGERED, orders=0, concurrency=2, env=env)
        app = demo_app.build_app(work.env)
        try:
            keys = canvas_load.enqueue(app, work.run, 1)
        finally:
            app.close()
        work.canvas_chains, work.canvas_keys = 1, keys
        procs = [work.start_worker("w1"), work.start_beat()]
        for p in procs:
            p.wait_ready(60)
        deadline = time.monotonic() + WITHIN_SECONDS
        parked: dict[str, str] = {}
        while time.monotonic() < deadline:
            parked = canvas_load.blocked(stage.ledger_engine, keys)
            report = canvas_load.tally(work.refresh(), work.run, 1, parked=parked)
            if parked and len(report.incomplete) == 1:
                break
            time.sleep(0.5)
        marker = tmp_path / "crash-once.step-started_effect"  # ``crashpoints.crash_point``
        assert marker.exists(), "no task reached the crash point"
        statuses = {
            e["key"]: e["status"] for e in canvas_load.unfinished(stage.ledger_engine, keys)
        }
        assert list(statuses.values()).count(EntryStatus.BLOCKED.value) == 1, statuses
        assert len(parked) == 1, parked
        ((item, reason),) = parked.items()
        assert "effect" in reason, reason
        # The other one of the chain and the chord completed; the blocked one is not lost.
        assert report.incomplete == [item], report
        assert report.lost == [] and report.ok, report
        assert "1 stopped at a task parked blocked" in report.line()
        # The run is over: nothing is left that the ledger would still move by itself.
        assert work.settle_tick(stage.ledger_engine) is True

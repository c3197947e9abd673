"""Celery's ``celery.chord_unlock`` held in the ledger (design.md § "Canvas: chains, groups,
chords, callbacks"), with real workers, a Redis broker and PostgreSQL results (a database
result backend: the chord's callback is published by ``chord_unlock`` polling the members).

A worker killed whole (parent and pool) while it holds a ``chord_unlock`` message leaves that
message unacked in Redis for its visibility timeout (an hour by default): nothing else
brings it back, and the chord never calls back. A ledger app delivers ``chord_unlock`` as a
ledgered task, so its publish intent (first message) or its ``retrying`` entry (a poll's
retry) is re-sent by beat's sweep.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text
from test_canvas import chord_of, crashed

from celery_ledger.ledger.engine import make_engine
from celery_ledger.unlock import CHORD_UNLOCK
from helpers import effect_counts
from procs import processes, test_env
from test_delivery import client_app

pytestmark = pytest.mark.processes

#: Short enough that the sweep re-sends what the dead worker held well within the bound.
RECOVERY = {
    "CELERY_LEDGER_LEASE_SECONDS": "3",
    "CELERY_LEDGER_SWEEP_INTERVAL": "1",
    "CELERY_LEDGER_PUBLISH_INTENT_SECONDS": "3",
    "CELERY_LEDGER_RETRY_GRACE_SECONDS": "3",
}


def database_results_env(tmp_path, redis: str, pg_url: str, **extra: str) -> dict[str, str]:
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, **RECOVERY, **extra)
    env["CELERY_RESULT_BACKEND"] = f"db+postgresql://{pg_url.split('://', 1)[1]}"
    return env


@pytest.mark.parametrize(
    ("point", "pause"), [("chord-unlock", 0.0), ("chord-unlock:retry", 4.0)], ids=["first", "retry"]
)
def test_chord_unlock_held_by_a_worker_killed_whole(tmp_path, redis, pg_url, point, pause):
    """The whole worker dies as ``chord_unlock`` starts: on its first poll (members done), or
    on a retry (members still running at the first poll, so the killed message is a retry's
    countdown message). The other worker gets the sweep's re-send and calls back once."""
    env = database_results_env(
        tmp_path,
        redis,
        pg_url,
        CELERY_LEDGER_CRASH_AT=f"{point}@worker",
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
    )
    app = client_app(env)
    tag = f"unlock-killed-{point}"
    with processes(tmp_path, env) as procs:
        # A free pool process on each worker whatever the members take: the first poll runs
        # while they do, so the retry case kills a retry.
        procs.worker("w1", concurrency=4)
        procs.worker("w2", concurrency=4)
        procs.beat()
        result = chord_of(app, tag, 3, pause).apply_async()
        # Without the ledger's hold: Redis keeps the killed worker's message for an hour.
        assert result.get(timeout=90) == [0, 1, 4]
    assert crashed(tmp_path, point), f"{point} never reached"
    expected = {(tag, f"member{n}"): 1 for n in range(3)}
    expected[(tag, "callback")] = 1
    assert effect_counts(pg_url, tag) == expected
    # The join was a ledgered task: one entry for the chord, run to its end (the client here
    # is a plain Celery app: its first message has Celery's own task id, not ``unlock_id``).
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT status FROM ledger_entries WHERE task_name = :n"), {"n": CHORD_UNLOCK}
            ).all()
    finally:
        engine.dispose()
    assert [r.status for r in rows] == ["completed"], rows

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

import os
import re
import signal
from pathlib import Path

import pytest
from sqlalchemy import text
from test_broker_faults import OwnRedis
from test_canvas import chord_of, crashed

from celery_ledger.ledger.engine import make_engine
from helpers import effect_counts
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

#: Celery's name for the join (``celery_ledger.unlock.CHORD_UNLOCK``; spelled out so that this
#: file also runs against a tree without that module, as it did before the fix).
CHORD_UNLOCK = "celery.chord_unlock"

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


def test_chord_unlock_retry_refused_by_the_broker_is_held(tmp_path, pg_url):
    """The broker (a redis-server of this test's own, never the shared one) goes away while
    ``chord_unlock`` polls a chord whose members still run: the poll's retry cannot be
    published. Celery's task failed the chord there (``ChordError``: "chord_unlock could not
    be retried"); the ledger's settles ``retrying`` without a message, and once the broker is
    back the sweep re-sends it and the chord calls back once."""
    own = OwnRedis(tmp_path)
    own.start()
    try:
        marker = tmp_path / "crash-once"
        env = database_results_env(
            tmp_path,
            own.url,
            pg_url,
            # The first retry's poll is paused as it starts (its pid in the marker file).
            CELERY_LEDGER_CRASH_AT="chord-unlock:retry@stop",
            CELERY_LEDGER_CRASH_ONCE=str(marker),
        )
        app = client_app(env)
        tag = "unlock-broker-cut"
        with processes(tmp_path, env) as procs:
            w1 = procs.worker("w1", concurrency=4)
            procs.beat()
            result = chord_of(app, tag, 2, 8.0).apply_async()
            paused = Path(f"{marker}.chord-unlock_retry")
            wait_for(lambda: paused.exists() and paused.read_text(), timeout=60, what="a poll")
            own.stop()  # the paused poll finds the members running and cannot publish its retry
            os.kill(int(paused.read_text()), signal.SIGCONT)
            wait_for(
                lambda: re.search(r"could not be (retried|published)", w1.log_text()),
                timeout=60,
                what="a poll whose retry the broker refused",
            )
            own.start()
            # A worker on the restarted server (see test_broker_faults.py: one that lived
            # through the restart may never consume again).
            procs.worker("w2", concurrency=2)
            assert result.get(timeout=90) == [0, 1]
    finally:
        own.stop()
    expected = {(tag, f"member{n}"): 1 for n in range(2)}
    expected[(tag, "callback")] = 1
    assert effect_counts(pg_url, tag) == expected

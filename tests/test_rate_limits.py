"""Fleet-wide rate limits (design.md § "Fleet-wide rate limits") with real ``celery worker``
and ``celery beat`` processes over Redis and PostgreSQL: four workers × ``-c 4`` and a limit of
5/s; the provider (a table stamped with the database clock at each call) never sees more than
the limit in any window, a whole worker is SIGKILLed in the middle, and every task completes.

The window measured is ``RATE_TEST_SECONDS`` of saturation (20 s by default, so the suite
stays short; ``RATE_TEST_SECONDS=60`` measures the issue's 60 s). Every wait is bounded.
"""

from __future__ import annotations

import os
import uuid

import pytest
from rate_app import RATE_TASKS, provider_calls
from sqlalchemy import text
from test_time import time_env

from celery_ledger.ledger.engine import make_engine
from procs import processes, redelivering, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

RATE = 5.0
SECONDS = float(os.environ.get("RATE_TEST_SECONDS", "20"))


def most_in_any_window(times: list[float], width: float) -> int:
    """The most calls in any half-open window [t, t + width) that starts at a call."""
    most, j = 0, 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < start + width:
            j += 1
        most = max(most, j - i)
    return most


def test_the_limit_holds_across_four_workers_and_a_worker_kill(tmp_path, redis, pg_url):
    env = time_env(tmp_path, redis, pg_url, TEST_VISIBILITY_TIMEOUT="3")
    client = client_app(env)
    tag = uuid.uuid4().hex[:8]
    total = int(RATE * SECONDS)
    engine = make_engine(pg_url)
    assert provider_calls(engine, tag) == []  # creates the provider's table
    try:
        with redelivering(env), processes(tmp_path, env) as procs:
            workers = [procs.worker(f"w{i}", concurrency=4, extra=RATE_TASKS) for i in range(4)]
            procs.beat()
            results = [
                client.send_task("rate_app.provider_call", args=(tag, n)) for n in range(total)
            ]
            # The middle: a third of the calls made, kill a whole worker (parent and pool).
            wait_for(
                lambda: len(provider_calls(engine, tag)) >= total // 3,
                timeout=SECONDS * 3 + 60,
                what="a third of the provider calls",
            )
            workers[1].kill()
            procs.worker("w-after", concurrency=4, extra=RATE_TASKS)
            values = [r.get(timeout=SECONDS * 4 + 120) for r in results]
        calls = provider_calls(engine, tag)
        with engine.begin() as conn:
            # The limit held deliveries back (acked, sent again for their token), not workers.
            held = conn.execute(
                text("SELECT count(*) FROM ledger_events WHERE event = 'held'")
            ).scalar_one()
    finally:
        engine.dispose()
    assert held > 0
    assert sorted(values) == list(range(total))
    assert {n for n, _ in calls} == set(range(total))
    times = [at for _, at in calls]
    # Capacity one token (as Celery's rate_limit): at most rate × W + 1 in any W seconds.
    seen = {width: most_in_any_window(times, width) for width in (1.0, 5.0, SECONDS)}
    print(f"most calls in any window: {seen}; {len(times)} calls in {times[-1] - times[0]:.1f}s")
    for width, most in seen.items():
        assert most <= RATE * width + 1, (width, most)
    # The limit was reached, not merely respected: the run took about total / rate.
    assert times[-1] - times[0] >= (len(times) - 1) / RATE - 1.0

"""Beat's re-sends hold no Redis subscription (docs/benchmarks.md § "Soak").

With a Redis result backend, Celery's ``send_task`` subscribes the sending process to the task's
result channel (``RedisBackend.on_task_call``), and drops that subscription when the returned
``AsyncResult`` is collected (``AsyncResult.__del__``). A beat that kept what it re-sent would
hold one channel per re-sent task for its whole life, and Redis would buffer every result
published to them. Beat's first sweep re-sends every interrupted entry it finds
(``recovery.resend``): afterwards, beat's own connections must hold no channel.
"""

from __future__ import annotations

import contextlib

import redis as redis_client
from test_recovery import make_interrupted

from celery_ledger.harness.processes import WaitTimeout
from celery_ledger.harness.redisclients import clients_of
from celery_ledger.ledger import LedgerStore
from helpers import event_names
from procs import processes, test_env, wait_for

RESENT = 40


def test_beat_holds_no_subscription_for_the_tasks_it_re_sent(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    store = LedgerStore(pg_url)
    client = redis_client.Redis.from_url(redis)
    try:
        keys = make_interrupted(store, RESENT, queue=env["TEST_QUEUE"])
        with processes(tmp_path, env) as procs:
            beat = procs.beat()
            wait_for(
                lambda: client.llen(env["TEST_QUEUE"]) >= RESENT,
                timeout=60,
                what=f"beat's first sweep to re-send {RESENT} entries",
            )
            assert all(event_names(store, k).count("resuming") == 1 for k in keys)
            held: dict[str, int] = {}

            def none_held() -> bool:
                held.update(clients_of(client, beat.pid))
                return held["connections"] > 0 and held["subscribed"] == 0

            # A subscription Celery drops is gone within a round trip; one kept is never.
            with contextlib.suppress(WaitTimeout):
                wait_for(none_held, timeout=10, what="beat to hold no result channel")
            assert held["connections"] > 0 and held["subscribed"] == 0, held
            assert beat.alive
    finally:
        client.close()
        store.dispose()

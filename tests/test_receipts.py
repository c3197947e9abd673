"""Messages a whole-worker SIGKILL strands in the worker's prefetch, from a producer that does
not know the ledger (guarantees.md § "The seams", fault 15).

A plain Celery producer (``send_task`` by name, no ledger app) records no publish intent: the
worker's parent receives the message, nothing holds it, and if the whole worker is SIGKILLed
while it waits for a pool process, Redis keeps it in ``unacked`` for ``visibility_timeout``
(an hour by default, left so here: only the ledger may bring these back). The worker's parent
knows every ledgered message's class, so it records the missing intent when it starts holding
the message (``celery_ledger.receipts``): the sweep then finds each stranded message within
lease + sweep interval, whoever published it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis as redis_client

from celery_ledger.ledger import LedgerStore
from helpers import business_key, effect_counts, event_names
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

ORDERS = 10
LEASE = 3.0
SWEEP = 1.0
#: A pool process's order takes this long: both busy, six more wait in the worker's prefetch
#: (Celery's own default prefetch multiplier, 4, at ``-c 2``; the ledger's default is 1).
PAUSE = 1.5
WORKER = {"concurrency": 2, "extra": ("--prefetch-multiplier", "4")}
#: From the kill to every order done: the stranded messages' lease + the sweep interval, the
#: new worker's start and the ten orders' own run time, with room for a loaded machine. The
#: visibility timeout that would otherwise bring them back is an hour.
WITHIN = 60.0


def done_orders(url: str, tags: list[str]) -> dict[str, dict[str, int]]:
    """order id -> its effects, for the orders whose three steps all happened."""
    counts: dict[str, dict[str, int]] = {}
    for (tag, effect), n in effect_counts(url).items():
        counts.setdefault(tag, {})[effect] = n
    return {t: counts[t] for t in tags if len(counts.get(t, {})) == 3}


def unacked_on(url: str, queue: str) -> list[str]:
    """Delivery tags of the messages of ``queue`` that Redis keeps in ``unacked``."""
    client = redis_client.Redis.from_url(url)
    try:
        found = []
        for tag, raw in client.hgetall("unacked").items():
            _, _, routing_key = json.loads(raw)
            if routing_key == queue:
                found.append(tag.decode())
        return found
    finally:
        client.close()


def intents_recorded(url: str, tags: list[str]) -> list[str]:
    """The orders whose entry began as a publish intent (its ``queued`` event): with a plain
    producer, those the worker's parent recorded while they waited in its prefetch."""
    store = LedgerStore(url)
    try:
        return [
            t
            for t in tags
            if "queued" in event_names(store, business_key("tests_app.order", order_id=t))
        ]
    finally:
        store.dispose()


def kill_with_a_backlog(tmp_path: Path, broker: str, pg_url: str) -> list[str]:
    """A plain producer sends ``ORDERS`` orders to one worker (``-c 2``, prefetch 4 per pool
    process); with both pool processes inside an order and the rest waiting in its prefetch,
    the whole worker is SIGKILLed, and a new worker and beat start. Every order must be done
    exactly once within ``WITHIN`` of the kill. Returns the delivery tags Redis kept in
    ``unacked`` at the kill (none on RabbitMQ)."""
    env = test_env(
        tmp_path,
        broker=broker,
        ledger_url=pg_url,
        CELERY_LEDGER_LEASE_SECONDS=str(LEASE),
        CELERY_LEDGER_SWEEP_INTERVAL=str(SWEEP),
    )
    redis = broker if broker.startswith("redis") else None
    producer = client_app(env)  # no ledger app in this process: no publish intent
    tags = [f"plain-{i}" for i in range(ORDERS)]
    stranded: list[str] = []
    with processes(tmp_path, env) as procs:
        first = procs.worker("w1", **WORKER)
        results = [
            producer.send_task("tests_app.order", args=(tag, i), kwargs={"pause": PAUSE})
            for i, tag in enumerate(tags)
        ]
        # Both pool processes inside an order (its first step done), the rest fetched.
        wait_for(
            lambda: sum(n for (_, e), n in effect_counts(pg_url).items() if e == "reserve") >= 2,
            timeout=30,
            what="both pool processes under way",
        )
        time.sleep(0.5)  # past the receipt hold's 50 ms: the kill strands held messages
        first.kill()  # SIGKILL the whole worker: parent and pool
        killed_at = time.monotonic()
        if redis is not None:
            stranded = unacked_on(redis, env["TEST_QUEUE"])
            # The running orders and the prefetched ones stay in unacked for the hour.
            assert len(stranded) >= 3, f"the kill stranded too little to test: {stranded}"
        procs.worker("w2", **WORKER)
        procs.beat()
        try:
            wait_for(
                lambda: len(done_orders(pg_url, tags)) == ORDERS,
                timeout=WITHIN,
                what="every order done after the whole worker's kill",
            )
        finally:
            missing = sorted(set(tags) - set(done_orders(pg_url, tags)))
            print(
                f"{len(stranded)} messages stranded in unacked; after "
                f"{time.monotonic() - killed_at:.1f}s, orders not done: {missing}"
            )
        if redis is not None:
            still = set(unacked_on(redis, env["TEST_QUEUE"]))
            assert still & set(stranded), "Redis gave the messages back: the ledger was not tested"
        for r in results:
            assert r.get(timeout=30)["order_id"] in tags
    effects = done_orders(pg_url, tags)
    assert effects == {t: {"reserve": 1, "charge": 1, "receipt": 1} for t in tags}
    # The orders that waited in the killed worker's prefetch (six here) got their intents
    # from its parent: without them, nothing in the ledger would know of those messages.
    recorded = intents_recorded(pg_url, tags)
    assert len(recorded) >= 3, recorded
    return stranded


def test_plain_producer_messages_stranded_by_a_whole_worker_sigkill(tmp_path, redis, pg_url):
    """Redis keeps the killed worker's messages in ``unacked`` for the visibility timeout (an
    hour): only the intents its parent recorded and held bring them back, within lease +
    sweep interval."""
    kill_with_a_backlog(tmp_path, redis, pg_url)


@pytest.mark.rabbitmq
def test_plain_producer_messages_after_a_whole_worker_sigkill_on_amqp(tmp_path, rabbitmq, pg_url):
    """RabbitMQ requeues a dead consumer's unacked messages at once: nothing is stranded, and
    the new worker receives them while the intents the killed parent recorded lapse and the
    sweep sends the same tasks again. Each order still runs exactly once (the claim RUNs an
    intent once; a second message of it WAITs or RETURNs)."""
    kill_with_a_backlog(tmp_path, rabbitmq, pg_url)


def test_a_key_from_that_raises_does_not_stop_the_worker(tmp_path, redis, pg_url):
    """The worker's parent computes the key of every ledgered message it receives (to hold
    it, and to record its intent): a ``key_from`` that raises there is logged, and the worker
    goes on; the delivery fails in its pool process, where the claim runs it again."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    producer = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        bad = producer.send_task("tests_app.keyed_by_code", args=("bad-1",), kwargs={"fail": True})
        good = producer.send_task("tests_app.keyed_by_code", args=("good-1",))
        with pytest.raises(Exception, match="no key for bad-1"):
            bad.get(timeout=30)
        assert good.get(timeout=30) == "keyed:good-1"
        assert worker.alive, worker.log_tail()
    assert effect_counts(pg_url) == {("good-1", "keyed"): 1}

"""Reading what the process tests produced: effects, entries, events."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from celery_ledger.ledger import LedgerStore, entry_key
from celery_ledger.ledger.engine import READ_ONLY, make_engine


def effect_counts(effects_url: str, tag: str | None = None) -> dict[tuple[str, str], int]:
    """(tag, effect) -> how many times it happened."""
    engine = make_engine(effects_url)
    try:
        # A read-only (deferred) transaction: on SQLite it must not take the write lock the
        # workers under test need.
        with engine.connect().execution_options(**{READ_ONLY: True}) as conn:
            if not conn.dialect.has_table(conn, "test_effects"):
                return {}
            q = "SELECT tag, effect, COUNT(*) FROM test_effects"
            params: dict[str, Any] = {}
            if tag is not None:
                q += " WHERE tag = :tag"
                params["tag"] = tag
            rows = conn.execute(text(q + " GROUP BY tag, effect"), params).all()
        return {(t, e): int(n) for t, e, n in rows}
    finally:
        engine.dispose()


def key_of(task_name: str, material: Any) -> str:
    return entry_key(task_name, material)


def business_key(task_name: str, **fields: Any) -> str:
    return entry_key(task_name, fields)


def event_names(store: LedgerStore, key: str) -> list[str]:
    return [e.event for e in store.entry_events(key)]


def configure_queue(app: Any, env: Any) -> None:
    """The test's queue, as the worker and the test's own client declare it.

    ``TEST_QUEUE_TYPE=quorum``: a RabbitMQ quorum queue, the way Celery 5.5+ declares one, on
    a topic exchange, so that countdown messages (the WAIT re-queue) go through native delayed
    delivery instead of waiting in a worker whose prefetch quorum queues keep static.
    ``TEST_DELIVERY_LIMIT``: its ``x-delivery-limit``, dead-lettering to ``<queue>.dead``.
    """
    if env.get("TEST_QUEUE_TYPE") != "quorum":
        return
    from kombu import Exchange, Queue

    name = app.conf.task_default_queue
    arguments: dict[str, Any] = {"x-queue-type": "quorum"}
    if env.get("TEST_DELIVERY_LIMIT"):
        arguments["x-delivery-limit"] = int(env["TEST_DELIVERY_LIMIT"])
        arguments["x-dead-letter-exchange"] = ""
        arguments["x-dead-letter-routing-key"] = f"{name}.dead"
    app.conf.task_queues = [
        Queue(name, Exchange(name, type="topic"), routing_key=name, queue_arguments=arguments)
    ]
    app.conf.task_default_exchange = name
    app.conf.task_default_exchange_type = "topic"
    app.conf.task_default_routing_key = name


#: ``Float`` columns that hold a length of time, not a moment: the fake clock leaves them.
DURATIONS = frozenset({"lease_seconds"})


def time_passes(store: LedgerStore, seconds: float) -> None:
    """A fake clock for the store's tests: the ledger is ``seconds`` further on without
    waiting them. Every stored moment in every ledger table moves back by ``seconds``, so the
    database clock is that much further past each one (leases run out, tokens and due times
    come). A test that waited for a token instead depended on how loaded the machine was:
    two statements meant to run within one token's interval ran 0.54 s apart in CI."""
    from sqlalchemy import Float

    from celery_ledger.ledger.schema import metadata

    with store.engine.begin() as conn:
        for table in metadata.sorted_tables:
            moments = [
                c.name
                for c in table.columns
                if isinstance(c.type, Float) and c.name not in DURATIONS
            ]
            if moments:
                sets = ", ".join(f"{c} = {c} - :d" for c in moments)
                conn.execute(text(f"UPDATE {table.name} SET {sets}"), {"d": seconds})


def time_passes_until(store: LedgerStore, when: float) -> float:
    """``time_passes`` to just past the stored moment ``when``; returns the seconds moved
    (every stored moment the test holds must move back by as much)."""
    moved = max(0.0, when - store.now()) + 1e-3
    time_passes(store, moved)
    return moved

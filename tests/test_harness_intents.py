"""The demo's and verify's own publishes record their intents with the run's ledger settings.

``verify`` on PostgreSQL + Redis once ended with three orders never claimed: their messages
were lost in a cut broker connection before any worker claimed them, and their intents, which
the sweep re-sends once ``ledger_publish_intent_seconds`` pass, had been recorded by the
command's own process with the default (300 s), not the run's settings, so the 120 s settle
phase ended first. The run's settings reached its workers and beat (their environment) but not
the process that publishes the orders.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_ledger import runtime
from celery_ledger.harness import canvas_load, demo_app
from celery_ledger.harness.orchestrate import PUBLISH_INTENT_SECONDS, Phases, Workload, staged
from celery_ledger.harness.verify import KINDS, SETTLE_SECONDS
from celery_ledger.ledger import EntryStatus

pytestmark = pytest.mark.processes

LEDGERED = next(k for k in KINDS if k.ledgered)


def test_the_publishing_app_takes_the_ledger_settings_of_the_env_it_is_built_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CELERY_LEDGER_PUBLISH_INTENT_SECONDS", raising=False)
    env = {
        "CELERY_LEDGER_DATA_DIR": str(tmp_path),
        demo_app.ENV_QUEUE: "q",
        demo_app.ENV_NAMESPACE: "ns",
        demo_app.ENV_EFFECTS_URL: f"sqlite:///{tmp_path / 'effects.sqlite3'}",
        "CELERY_LEDGER_PUBLISH_INTENT_SECONDS": "7",
        "CELERY_LEDGER_LEASE_SECONDS": "3",
    }
    app = demo_app.build_app(env)
    try:
        settings = runtime.settings_for(app)
        assert settings.publish_intent_seconds == 7.0
        assert settings.lease_seconds == 3.0
    finally:
        app.close()


def test_a_run_finds_an_order_lost_before_its_claim_within_the_settle_phase() -> None:
    # The verify report's "never claimed with intent" must be found within its settle phase.
    assert PUBLISH_INTENT_SECONDS + 5 < SETTLE_SECONDS / 2


def test_orders_whose_messages_the_broker_lost_are_resent_and_complete(redis: str) -> None:
    """Publish the orders, lose every message in the broker (as a connection cut mid-BRPOP
    does), then start a worker and beat: the sweep re-sends each intent once it lapses, and
    every order completes once."""
    orders = 4
    with staged(
        "celery-ledger-intents", broker=redis, ledger=None, keep=False, phases=Phases(1, quiet=True)
    ) as stage:
        work = stage.workload(LEDGERED, orders=orders, concurrency=2)
        work.enqueue([0.02] * orders)
        lost = _drop_queue(redis, work)
        assert lost == orders
        procs = [work.start_worker("w1"), work.start_beat()]
        for p in procs:
            p.wait_ready(60)
        deadline = time.monotonic() + PUBLISH_INTENT_SECONDS + 40
        while time.monotonic() < deadline:
            outcomes = demo_app.ledger_outcomes(stage.ledger_engine, work.order_ids)
            if len(outcomes) == orders and all(
                o.status is EntryStatus.COMPLETED for o in outcomes.values()
            ):
                break
            time.sleep(0.5)
        report = work.tally(stage.ledger_engine)
        assert report.completed == orders, report
        assert report.duplicate_effects == 0 and report.never_claimed == 0, report


def test_a_canvas_whose_messages_the_broker_lost_is_resent_in_its_place(redis: str) -> None:
    """Publish a chain and a chord of ledgered tasks (``apply_async``), and a chain's first
    link by name with the rest of the chain (``send_task``, as the outbox publishes a settle's
    next link), lose every message in the broker, then start a worker and beat. The sweep
    re-sends each intent from its snapshot once it lapses; the snapshot must keep the task's
    place in its canvas, or the chains stop after their first link and the chord never calls
    back (verify on PostgreSQL + Redis found both: an outbox-published link whose message a
    broker cut lost ended its chain; a chord's callback never ran)."""
    with staged(
        "celery-ledger-intents", broker=redis, ledger=None, keep=False, phases=Phases(1, quiet=True)
    ) as stage:
        # Redis results: the chord's members count in the backend (on a database backend a
        # ``celery.chord_unlock`` message polls them, and losing it is Celery's own).
        work = stage.workload(
            LEDGERED, orders=0, concurrency=2, env={"CELERY_RESULT_BACKEND": redis}
        )
        app = demo_app.build_app(work.env)
        try:
            canvas_load.enqueue(app, work.run, 1)
            cid = canvas_load.chain_id(work.run, 1)
            app.send_task(
                canvas_load.LINK,
                args=([], work.run, cid, 1),
                chain=[
                    app.signature(canvas_load.LINK, args=(work.run, cid, n))
                    for n in range(canvas_load.CHAIN_LENGTH, 1, -1)
                ],
            )
        finally:
            app.close()
        lost = _drop_queue(redis, work)
        assert lost == 2 + canvas_load.CHORD_SIZE
        procs = [work.start_worker("w1"), work.start_beat()]
        for p in procs:
            p.wait_ready(60)
        deadline = time.monotonic() + PUBLISH_INTENT_SECONDS + 40
        report = canvas_load.tally(work.refresh(), work.run, 2)
        while report.incomplete and time.monotonic() < deadline:
            time.sleep(0.5)
            report = canvas_load.tally(work.refresh(), work.run, 2)
        assert not report.incomplete and report.ok, report


def _drop_queue(broker_url: str, work: Workload) -> int:
    """Delete the run's queue from Redis: every message in it is gone. Returns how many."""
    import redis as redis_client

    client = redis_client.Redis.from_url(broker_url, socket_timeout=5)
    try:
        key = demo_app.redis_keyprefix(work.box.namespace, work.queue) + work.queue
        n = int(client.llen(key))
        client.delete(key)
        return n
    finally:
        client.close()

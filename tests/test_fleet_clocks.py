"""Two beats, the sweep running in two places at once, and workers whose wall clocks are 30 s
apart (docs/operations.md § "Deploying"): the database clock decides every lease.

Worker A's clock runs 30 s ahead, worker B's 30 s behind, and so do the two beats'
(``celery_ledger.harness.clocks``: a ``sitecustomize`` shifts ``time.time`` and
``datetime.now`` in that process only). A is SIGKILLed while two of its orders sleep between
their steps. Then, from the audit events: every interrupted attempt was one of A's (no live
lease of B's was judged expired, though B's clock says its leases ended 30 s ago), each
interruption was resumed exactly once (two beats' sweeps ran concurrently), and every effect
happened exactly once.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import psycopg

from celery_ledger.harness.clocks import skewed
from helpers import effect_counts
from procs import processes, test_env, wait_for

ORDERS = 12
#: Seconds each order sleeps between its first step and its second: longer than a lease
#: renewal period (lease / 3), shorter than the lease.
PAUSE = 2.0
LEASE = 3.0
SKEW = 30.0
CLAIMS = ("claimed", "takeover", "rerun")


def events(pg_url: str) -> list[tuple[str, str, str | None]]:
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT key, event, actor FROM ledger_events ORDER BY id").fetchall()
    return [(k, e, a) for k, e, a in rows]


def steps_in_flight(pg_url: str, node: str) -> int:
    """Steps of the entries ``node`` holds that are ``started`` and not yet completed."""
    with psycopg.connect(pg_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM ledger_steps s JOIN ledger_entries e ON e.key = s.key"
            " WHERE s.status = 'started' AND e.owner LIKE %s",
            (f"{node}-%",),
        ).fetchone()
    return int(row[0]) if row else 0


def effect_rows(url: str) -> list[tuple[str, str, int, float]]:
    """(order id, effect, pid, wall-clock time) of every effect written so far."""
    import sqlite3

    conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30)
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'test_effects'").fetchall():
            return []
        return list(conn.execute("SELECT tag, effect, pid, at FROM test_effects"))
    finally:
        conn.close()


def send(env: dict[str, str], ids: list[str]) -> None:
    from celery import Celery

    sender = Celery(broker=env["CELERY_BROKER_URL"])
    try:
        for order_id in ids:
            sender.send_task("tests_app.order", args=(order_id, 1, PAUSE), queue=env["TEST_QUEUE"])
    finally:
        sender.close()


def test_skewed_workers_and_two_beats_resume_each_interruption_once(
    tmp_path: Path, pg_url: str, redis: str
) -> None:
    effects_url = f"sqlite:///{tmp_path / 'effects.sqlite3'}"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        effects_url=effects_url,
        CELERY_LEDGER_LEASE_SECONDS=str(LEASE),
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    ahead, behind = skewed(SKEW), skewed(-SKEW)
    tag = uuid.uuid4().hex[:6]
    ids = [f"{tag}-{i}" for i in range(ORDERS)]
    with processes(tmp_path, env) as procs:
        # Prefetch 1 with late acks: A holds only the orders it runs, so what A loses is
        # exactly what the sweep must resume.
        one = ["--prefetch-multiplier", "1"]
        a = procs.worker("wa", concurrency=2, env=ahead, extra=one)
        b = procs.worker("wb", concurrency=2, env=behind, extra=one)
        procs.beat("beat-ahead", env=ahead)
        procs.beat("beat-behind", env=behind)
        send(env, ids)

        def a_is_between_steps() -> bool:
            mine = set(a.children())
            rows = effect_rows(effects_url)
            charged = {o for o, e, _, _ in rows if e == "charge"}
            reserved = {o for o, e, pid, _ in rows if e == "reserve" and pid in mine}
            return len(reserved - charged) >= 2

        # A is killed while two orders sleep between their steps, and at no other moment:
        # a kill inside a step (its effect begun, its row not completed) leaves the step
        # ambiguous and the entry blocked by design, which is not what this test is about.
        # So A is frozen first (SIGSTOP), the moment is judged on the frozen state, and A is
        # killed only if it holds no step in flight; otherwise it runs on and is judged again.
        # (Judged while running, a loaded machine once let a charge begin between the look
        # and the kill.)
        for _ in range(20):
            wait_for(a_is_between_steps, timeout=60, what="A running two orders")
            a.pause()
            if a_is_between_steps() and steps_in_flight(pg_url, "wa") == 0:
                break
            a.resume()
        else:
            raise AssertionError("A was never frozen between two orders' steps")
        a_pids = set(a.children())
        a.kill()
        wait_for(
            lambda: all(effect_counts(effects_url).get((o, "receipt")) == 1 for o in ids),
            timeout=90,
            what=f"{ORDERS} orders completed",
            check=lambda: None if b.alive else (_ for _ in ()).throw(AssertionError("B died")),
        )
        b_pids = set(b.children())

    # The fake clocks were in effect: A's effects are stamped ~30 s ahead of B's.
    rows = effect_rows(effects_url)
    a_times = [at for _, _, pid, at in rows if pid in a_pids]
    b_times = [at for _, _, pid, at in rows if pid in b_pids]
    assert a_times and b_times
    assert min(a_times) - max(b_times) > SKEW  # A ran before B finished, 60 s apart by clock

    counts = effect_counts(effects_url)
    assert {counts.get((o, e)) for o in ids for e in ("reserve", "charge", "receipt")} == {1}

    owner: dict[str, str | None] = {}
    interrupted_from: list[str | None] = []
    interrupted, resumed = Counter[str](), Counter[str]()
    for key, event, actor in events(pg_url):
        if event in CLAIMS:
            owner[key] = actor
        elif event == "interrupted":
            interrupted[key] += 1
            interrupted_from.append(owner.get(key))
        elif event == "resuming":
            resumed[key] += 1
    assert interrupted, "A was killed with two orders running: the sweep must interrupt them"
    # No live lease misjudged: every attempt interrupted was one of A's.
    assert all(node is not None and node.startswith("wa-") for node in interrupted_from), (
        interrupted_from
    )
    # Each interruption resumed exactly once, though two beats sent the sweep.
    assert resumed == interrupted, (resumed, interrupted)

"""Concurrency keys (docs/concurrency.md) at the store, on SQLite and PostgreSQL: a claim over
the limit parks its entry (HOLD), a settle's handover serves the waiters first come, first
served, and a dead holder's slot returns when its lease is interrupted, never before."""

from __future__ import annotations

import dataclasses
import threading
import time

from test_store_contract import request, wait_lease_expired

from celery_ledger.ledger import EntryStatus, Gate, LedgerStore, SlotAsk
from celery_ledger.ledger.slots import slot_reason

CUSTOMER = "shop.charge:c-1"


def ask(key: str, *, limit: int = 1, lease: float = 3600.0, ckey: str = CUSTOMER) -> object:
    req = request(key, task_id=f"t-{key}", lease=lease)
    return dataclasses.replace(req, slot=SlotAsk(ckey, limit))


def holders(store: LedgerStore, ckey: str = CUSTOMER) -> list[str]:
    from sqlalchemy import select

    from celery_ledger.ledger.schema import entries
    from celery_ledger.ledger.slots import holding

    with store.engine.connect() as conn:
        return sorted(conn.execute(select(entries.c.key).where(holding(ckey))).scalars())


def test_over_the_limit_a_claim_waits_and_a_settle_hands_over_in_order(
    store: LedgerStore,
) -> None:
    first = store.claim(ask("k-1", limit=2))
    second = store.claim(ask("k-2", limit=2))
    assert first.gate is Gate.RUN and second.gate is Gate.RUN
    waits = [store.claim(ask(f"k-{n}", limit=2)) for n in (3, 4, 5)]
    assert [c.gate for c in waits] == [Gate.HOLD] * 3
    for n in (3, 4, 5):
        e = store.get_entry(f"k-{n}")
        assert e.status is EntryStatus.SLEEPING and e.reason == slot_reason(CUSTOMER)
        assert e.executions == 0  # parked before any run of the body
    # A waiter's own redelivery is held too: it waits in its place, not again.
    assert store.claim(ask("k-3", limit=2)).gate is Gate.HOLD
    assert store.list_due() == []  # waiters have no due time: nothing polls them
    (key_stats,) = store.slot_keys()
    assert (key_stats.key, key_stats.limit, key_stats.holding, key_stats.waiting) == (
        CUSTOMER,
        2,
        2,
        3,
    )
    assert store.settle("k-1", first.fence, EntryStatus.COMPLETED, result="1")
    granted = store.hand_over(CUSTOMER, limit=2)
    assert [g.key for g in granted] == ["k-3"]  # the oldest waiter, and only one
    assert [d.key for d in store.list_due()] == ["k-3"]
    # Another handover finds no free slot: the waiter handed one holds it while woken.
    assert store.hand_over(CUSTOMER, limit=2) == []
    assert holders(store) == ["k-2", "k-3"]
    # A new delivery of another entry queues behind the waiters still there.
    assert store.claim(ask("k-6", limit=2)).gate is Gate.HOLD
    # The wake (the sweep's, or the settling worker's) and its claim: RUN with the slot.
    won = store.begin_wake("k-3", granted[0].fence, EntryStatus.SLEEPING, lease_seconds=60)
    assert won is not None
    third = store.claim(ask("k-3", limit=2))
    assert third.gate is Gate.RUN
    assert holders(store) == ["k-2", "k-3"]
    assert store.settle("k-2", second.fence, EntryStatus.FAILED, error="x")
    assert [g.key for g in store.hand_over(CUSTOMER, limit=2)] == ["k-4"]
    assert store.settle("k-3", third.fence, EntryStatus.COMPLETED, result="3")
    assert [g.key for g in store.hand_over(CUSTOMER, limit=2)] == ["k-5"]
    assert holders(store) == ["k-4", "k-5"]


def test_keys_do_not_share_slots(store: LedgerStore) -> None:
    assert store.claim(ask("a-1", ckey="shop.charge:a")).gate is Gate.RUN
    assert store.claim(ask("b-1", ckey="shop.charge:b")).gate is Gate.RUN
    assert store.claim(ask("a-2", ckey="shop.charge:a")).gate is Gate.HOLD


def test_a_dead_holders_slot_returns_only_when_its_lease_is_interrupted(
    store: LedgerStore,
) -> None:
    dead = store.claim(ask("k-dead", lease=1.0))
    assert dead.gate is Gate.RUN
    assert store.claim(ask("k-next")).gate is Gate.HOLD
    # Its lease still runs: the slot is its own, whatever a handover asks.
    assert store.hand_over(CUSTOMER, limit=1) == []
    wait_lease_expired(store, "k-dead")
    # Lapsed but not yet interrupted: still its own (no TTL guess).
    assert store.hand_over(CUSTOMER, limit=1) == []
    assert [i.key for i in store.interrupt_expired()] == ["k-dead"]
    # The interrupt bumped the fence: the dead holder's writes are refused from now on.
    assert not store.settle("k-dead", dead.fence, EntryStatus.COMPLETED, result="late")
    # The sweep's backstop hands its slot on.
    assert [g.key for g in store.hand_over_all()] == ["k-next"]
    assert holders(store) == ["k-next"]
    # The sweep resumes the dead holder (running under the resume marker): its claim queues
    # behind, its slot went on.
    fence = store.get_entry("k-dead").fence
    assert store.begin_resume("k-dead", fence, lease_seconds=60) is not None
    assert store.claim(ask("k-dead")).gate is Gate.HOLD
    assert holders(store) == ["k-next"]


def test_a_holder_whose_lease_lapsed_takes_its_own_slot_over(store: LedgerStore) -> None:
    first = store.claim(ask("k-own", lease=1.0))
    assert first.gate is Gate.RUN
    assert store.claim(ask("k-other")).gate is Gate.HOLD
    wait_lease_expired(store, "k-own")
    again = store.claim(ask("k-own"))
    assert again.gate is Gate.TAKEOVER and again.fence > first.fence
    assert holders(store) == ["k-own"]


def test_cancelled_waiter_is_skipped_by_the_handover(store: LedgerStore) -> None:
    first = store.claim(ask("k-a"))
    assert store.claim(ask("k-b")).gate is Gate.HOLD
    assert store.claim(ask("k-c")).gate is Gate.HOLD
    store.request_cancel("k-b", by="op", reason="no longer wanted", error="x")
    assert store.settle("k-a", first.fence, EntryStatus.COMPLETED, result="1")
    assert [g.key for g in store.hand_over(CUSTOMER, limit=1)] == ["k-c"]


def test_concurrent_claims_of_one_key_never_exceed_the_limit(store: LedgerStore) -> None:
    gates: dict[str, Gate] = {}
    barrier = threading.Barrier(8)

    def claim(n: int) -> None:
        barrier.wait(timeout=30)
        gates[f"k-{n}"] = store.claim(ask(f"k-{n}", limit=3)).gate

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(g.value for g in gates.values()) == ["hold"] * 5 + ["run"] * 3
    assert len(holders(store)) == 3


def test_a_settle_hands_its_slot_over_in_its_own_transaction(store: LedgerStore) -> None:
    """``settle_in_slot``: the settle and the handover are one write; a superseded attempt
    hands nothing over; a settle with links records them too."""
    first = store.claim(ask("k-1", limit=2))
    second = store.claim(ask("k-2", limit=2))
    assert [store.claim(ask(f"k-{n}", limit=2)).gate for n in (3, 4, 5)] == [Gate.HOLD] * 3
    slot = SlotAsk(CUSTOMER, 2)
    served = store.settle_in_slot(slot, "k-1", first.fence, EntryStatus.COMPLETED, result="1")
    assert served is not None and [g.key for g in served] == ["k-3"]
    assert served[0].task_id == "t-k-3" and served[0].fence == store.get_entry("k-3").fence
    assert served[0].snapshot == store.get_entry("k-3").snapshot
    assert holders(store) == ["k-2", "k-3"]
    assert [d.key for d in store.list_due()] == ["k-3"]
    # Superseded: nothing written, nothing handed over.
    assert store.settle_in_slot(slot, "k-1", first.fence, EntryStatus.FAILED, error="x") is None
    assert holders(store) == ["k-2", "k-3"]
    # A retry gives its slot up too, and the next waiter is served.
    retried = store.settle_in_slot(
        slot, "k-2", second.fence, EntryStatus.RETRYING, error="later", due_in=60.0
    )
    assert retried is not None and [g.key for g in retried] == ["k-4"]
    assert store.get_entry("k-2").status is EntryStatus.RETRYING
    assert "slot-granted" in [e.event for e in store.entry_events("k-4")]


def test_a_claim_that_counted_a_holder_is_served_by_that_holders_settle(pg_url: str) -> None:
    """The race a settle followed by a separate handover loses: a claim counts the holder
    (not yet settled) and parks after the handover looked for waiters, so nobody serves it
    until the sweep. The settle takes the key's lock first, so it waits for that claim and
    then serves it. (PostgreSQL: on SQLite every writer is serialized anyway.)"""
    store = LedgerStore(pg_url)
    try:
        first = store.claim(ask("k-1"))
        assert first.gate is Gate.RUN
        counted, go = threading.Event(), threading.Event()
        claimer: list[threading.Thread] = []

        def pause_before_parking(statement: str) -> None:
            # Only the claim's thread, and only its park (after it counted the holders).
            parks = "waiting_since" in statement and statement.lstrip().upper().startswith(
                ("UPDATE", "WITH")
            )
            if parks and threading.current_thread() in claimer:
                counted.set()
                assert go.wait(timeout=30)

        store.fast.listeners.append(pause_before_parking)
        gates: list[Gate] = []
        claimer.append(threading.Thread(target=lambda: gates.append(store.claim(ask("k-2")).gate)))
        claimer[0].start()
        assert counted.wait(timeout=30), "the claim never reached its park"
        served: list[object] = []
        settler = threading.Thread(
            target=lambda: served.append(
                store.settle_in_slot(
                    SlotAsk(CUSTOMER, 1), "k-1", first.fence, EntryStatus.COMPLETED, result="1"
                )
            )
        )
        settler.start()
        # Either the settle finished (it did not wait for the claim), or it waits for a lock.
        deadline = time.monotonic() + 30
        while settler.is_alive() and not waits_for_a_lock(pg_url):
            assert time.monotonic() < deadline, "the settle neither ended nor waited"
            time.sleep(0.05)
        go.set()
        claimer[0].join(timeout=30)
        settler.join(timeout=30)
        assert gates == [Gate.HOLD]
        assert served and served[0] is not None
        assert [g.key for g in served[0]] == ["k-2"], "the waiter was left to the sweep"
        assert holders(store) == ["k-2"]
    finally:
        go.set()
        store.dispose()


def waits_for_a_lock(pg_url: str) -> bool:
    """Whether a session of ``pg_url``'s database waits for a lock."""
    from sqlalchemy import create_engine, text

    from celery_ledger.ledger.engine import normalize_url

    engine = create_engine(normalize_url(pg_url))
    try:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()

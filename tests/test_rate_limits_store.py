"""Fleet-wide rate limits (design.md § "Fleet-wide rate limits") at the store, on SQLite and
PostgreSQL: the bucket's arithmetic, a held delivery and its wake, the order of held
deliveries, and concurrent claims from several stores (as workers) never over the limit."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from test_store_contract import request

from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    Gate,
    LedgerStore,
    TokenAsk,
    parse_rate_limit,
)
from celery_ledger.ledger.rate_limits import take_token
from helpers import time_passes, time_passes_until

#: A bucket of one token a minute: a second claim never finds one of its own, however slowly
#: the machine runs the two; the tests move the clock (``helpers.time_passes``).
ONE_A_MINUTE = TokenAsk("shop.charge", 60.0, "1/m")


def limited(key: str, ask: TokenAsk = ONE_A_MINUTE) -> ClaimRequest:
    return dataclasses.replace(request(key, task_id=f"t-{key}"), rate=ask)


def test_parse_rate_limit() -> None:
    assert parse_rate_limit("10/s").per_second == 10.0
    assert parse_rate_limit("5/m").interval == pytest.approx(12.0)
    assert parse_rate_limit("360/h").per_second == pytest.approx(0.1)
    per = parse_rate_limit("5/m  per customer_id")
    assert (per.argument, per.rate, per.text) == ("customer_id", "5/m", "5/m per customer_id")
    for bad in ("10", "10/d", "0/s", "-1/s", "5/m per", "5/m per 1x", "five/s", ""):
        with pytest.raises(ValueError, match="ledger_rate_limit"):
            parse_rate_limit(bad)


def test_over_the_limit_is_held_until_its_token_then_runs(store: LedgerStore) -> None:
    first = store.claim(limited("k-1"))
    assert first.gate is Gate.RUN and first.token_due_in is None
    second = store.claim(limited("k-2"))
    assert second.gate is Gate.HOLD
    assert second.token_due_in is not None and 0.0 < second.token_due_in <= 60.0 + 1e-6
    entry = store.get_entry("k-2")
    assert entry.status is EntryStatus.SCHEDULED and entry.executions == 0
    assert entry.reason is not None and "rate limit 1/m" in entry.reason
    assert entry.owner is not None and entry.lease_until is None
    (held,) = store.held_for_tokens()
    assert (held.key, held.bucket, held.rate, held.holds) == ("k-2", "shop.charge", "1/m", 1)
    assert held.due_at == pytest.approx(entry.due_at)
    assert store.held_for_tokens_by_bucket() == {"shop.charge": (1, held.held_since)}
    # A copy of its delivery that arrives before the token is due is held as the entry is.
    assert entry.due_at is not None
    assert store.claim(limited("k-2")).gate is Gate.HOLD
    time_passes_until(store, entry.due_at)
    ran = store.claim(limited("k-2"))
    assert ran.gate is Gate.RUN, ran
    assert store.held_for_tokens() == []
    assert store.get_entry("k-2").status is EntryStatus.RUNNING


def test_held_deliveries_are_due_one_token_apart_in_arrival_order(store: LedgerStore) -> None:
    slow = TokenAsk("slow", 5.0, "12/m")
    assert store.claim(limited("a", slow)).gate is Gate.RUN
    dues = []
    for key in ("b", "c", "d"):
        claim = store.claim(limited(key, slow))
        assert claim.gate is Gate.HOLD
        dues.append(store.get_entry(key).due_at)
    assert dues[1] - dues[0] == pytest.approx(5.0) and dues[2] - dues[1] == pytest.approx(5.0)
    assert [h.key for h in store.held_for_tokens()] == ["b", "c", "d"]
    # Another bucket is not held behind them.
    assert store.claim(limited("other", dataclasses.replace(slow, bucket="x"))).gate is Gate.RUN


def test_the_sweep_wakes_a_held_entry_and_its_claim_takes_the_token(store: LedgerStore) -> None:
    assert store.claim(limited("w-1")).gate is Gate.RUN
    assert store.claim(limited("w-2")).gate is Gate.HOLD
    entry = store.get_entry("w-2")
    assert entry.due_at is not None
    time_passes_until(store, entry.due_at)
    (due,) = store.list_due()
    woke = store.begin_wake("w-2", due.fence, due.status, lease_seconds=30.0)
    assert woke is not None
    assert store.claim(limited("w-2")).gate is Gate.RUN
    assert store.held_for_tokens() == []


def test_a_bucket_gives_one_token_per_interval_on_the_database_clock(store: LedgerStore) -> None:
    ask = TokenAsk("math", 60.0, "1/m")
    with store._one_statement() as conn:
        first = take_token(conn, store.dialect, ask, queued=False)
        second = take_token(conn, store.dialect, ask, queued=False)
        third = take_token(conn, store.dialect, ask, queued=False)
    assert first.admitted and not second.admitted and not third.admitted
    # The second waits for the next token; the third for the slot after it.
    assert second.due_at == pytest.approx(first.now + 60.0)
    assert third.due_at == pytest.approx(first.now + 120.0)
    time_passes_until(store, second.due_at)
    with store._one_statement() as conn:
        # A new delivery does not take the token ahead of the two held ones...
        assert not take_token(conn, store.dialect, ask, queued=False).admitted
        # ... a held one does.
        assert take_token(conn, store.dialect, ask, queued=True).admitted


def test_concurrent_claims_from_many_stores_never_exceed_the_limit(ledger_url: str) -> None:
    """Four stores (four workers' engines) × two threads, claiming as fast as they can until
    20 tokens were admitted (bounded at 60 s, however loaded the machine): consecutive
    admissions, on the database clock, are at least one token interval apart, so no window of
    W seconds holds more than rate × W + 1."""
    ask = TokenAsk("race", 0.05, "20/s")
    stores = [LedgerStore(ledger_url) for _ in range(4)]
    admitted: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    end = time.monotonic() + 60.0
    wanted = 20

    def hammer(s: LedgerStore) -> None:
        try:
            while time.monotonic() < end and len(admitted) < wanted:
                with s._one_statement() as conn:
                    token = take_token(conn, s.dialect, ask, queued=True)
                if token.admitted:
                    with lock:
                        admitted.append(token.now)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in stores for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s in stores:
        s.dispose()
    assert not errors, errors
    admitted.sort()
    assert len(admitted) >= wanted, admitted  # the limit was reached, not starved
    gaps = [b - a for a, b in zip(admitted, admitted[1:], strict=False)]
    assert min(gaps) >= 0.05 - 1e-6, min(gaps)
    span = admitted[-1] - admitted[0]
    assert len(admitted) <= span / 0.05 + 1


def test_takeovers_held_for_a_token_do_not_push_each_other_back_for_ever(
    store: LedgerStore,
) -> None:
    """A takeover that finds no token is not held (its entry stays as it is) and keeps no
    place in the bucket's queue. Had it queued at the end on each claim, two of them, each
    coming back at its own due time, would each find the other's new place past its own and
    be sent back again, for ever (the concurrency keys' model found it: entries resumed after
    a crash never ran). A takeover waits for the bucket's next token instead."""
    slow = TokenAsk("takeovers", 60.0, "1/m")

    def req(key: str, lease: float = 3600.0) -> ClaimRequest:
        return dataclasses.replace(request(key, task_id=f"t-{key}", lease=lease), rate=slow)

    for key in ("a", "b"):
        time_passes(store, slow.interval)
        assert store.claim(req(key, lease=30.0)).gate is Gate.RUN
    time_passes(store, slow.interval)  # both leases run out, and the next token is due
    assert store.claim(req("c")).gate is Gate.RUN  # the bucket's token is taken
    due = {}
    for key in ("a", "b"):
        claim = store.claim(req(key))
        assert claim.gate is Gate.HOLD and claim.token_due_in is not None, claim
        due[key] = store.now() + claim.token_due_in
    ran: set[str] = set()
    for _ in range(8):  # each comes back at its own due time, as its re-sent message does
        for key in sorted(due, key=due.__getitem__):
            if key in ran:
                continue
            moved = time_passes_until(store, due[key])
            due = {k: when - moved for k, when in due.items()}
            claim = store.claim(req(key))
            if claim.gate is Gate.TAKEOVER:
                ran.add(key)
            else:
                assert claim.gate is Gate.HOLD and claim.token_due_in is not None, claim
                due[key] = store.now() + claim.token_due_in
        if ran == {"a", "b"}:
            break
    assert ran == {"a", "b"}, f"takeovers never admitted: due {due}, now {store.now()}"

"""A task with both a concurrency key and a fleet-wide rate limit (docs/concurrency.md § "With a
rate limit"), at the store, on SQLite and PostgreSQL: every delivery that runs took a token
and holds a slot, whatever path brought it there.

The order is the rate limit's gate first, then the slot's, both in the claim's transaction
under the key's lock: a token taken by a delivery that then waits for a slot is not given
back (the pair only ever lets fewer run), and a delivery that a handover gave a slot but that
finds no token gives its slot back as it is held.
"""

from __future__ import annotations

import dataclasses

from test_slots_store import CUSTOMER, holders
from test_store_contract import request

from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    Gate,
    LedgerStore,
    SlotAsk,
    TokenAsk,
)
from celery_ledger.ledger.slots import slot_reason
from helpers import time_passes, time_passes_until

#: One bucket for the task, a token a minute: a claim never finds a token another just took,
#: however slowly the machine runs the two; the tests move the clock (``helpers.time_passes``).
MINUTE = TokenAsk("shop.charge", 60.0, "1/m")
#: A token every 30 s: the second delivery is always held.
SLOW = TokenAsk("shop.slow", 30.0, "2/m")


def both(
    key: str, *, limit: int = 1, rate: TokenAsk = MINUTE, ckey: str = CUSTOMER
) -> ClaimRequest:
    req = request(key, task_id=f"t-{key}", lease=3600.0)
    return dataclasses.replace(req, slot=SlotAsk(ckey, limit), rate=rate)


def test_a_new_keyed_delivery_takes_a_token_too(store: LedgerStore) -> None:
    # A free slot is not enough: the rate limit holds the second new delivery.
    assert store.claim(both("k-1", limit=5, rate=SLOW)).gate is Gate.RUN
    second = store.claim(both("k-2", limit=5, rate=SLOW))
    assert second.gate is Gate.HOLD, second
    assert second.token_due_in is not None and second.token_due_in > 20.0
    entry = store.get_entry("k-2")
    assert entry.status is EntryStatus.SCHEDULED and entry.executions == 0
    assert entry.reason is not None and "rate limit 2/m" in entry.reason
    assert holders(store) == ["k-1"]
    assert [h.key for h in store.held_for_tokens()] == ["k-2"]


def test_a_delivery_with_a_token_but_no_slot_waits_for_the_slot(store: LedgerStore) -> None:
    assert store.claim(both("a")).gate is Gate.RUN
    time_passes(store, MINUTE.interval)
    parked = store.claim(both("b"))
    assert parked.gate is Gate.HOLD and parked.token_due_in is None, parked
    entry = store.get_entry("b")
    assert entry.status is EntryStatus.SLEEPING and entry.reason == slot_reason(CUSTOMER)
    assert holders(store) == ["a"]


def test_a_granted_waiter_held_for_its_token_gives_its_slot_back(store: LedgerStore) -> None:
    """The slot a handover gave ``b`` must not outlive the hold for its token: once held,
    ``d`` takes the slot, and ``b``'s wake and claim must wait for it, not run beside it."""
    first = store.claim(both("a"))
    assert first.gate is Gate.RUN
    time_passes(store, MINUTE.interval)
    assert store.claim(both("b")).gate is Gate.HOLD  # took a token, waits for the slot
    assert store.settle("a", first.fence, EntryStatus.COMPLETED, result="1")
    (granted,) = store.hand_over(CUSTOMER, limit=1)
    assert granted.key == "b" and holders(store) == ["b"]
    assert store.begin_wake("b", granted.fence, EntryStatus.SLEEPING, lease_seconds=60)
    # Another key's delivery of the same task takes the bucket's token first.
    time_passes(store, MINUTE.interval)
    assert store.claim(both("c", ckey="shop.charge:c-2")).gate is Gate.RUN
    held = store.claim(both("b"))
    assert held.gate is Gate.HOLD and held.token_due_in is not None, held
    assert store.get_entry("b").status is EntryStatus.SCHEDULED
    assert holders(store) == []  # held for a token, it holds no slot
    # The slot is free: a new delivery takes it once its own token is due.
    time_passes(store, 3 * MINUTE.interval)
    assert store.claim(both("d")).gate is Gate.RUN
    assert holders(store) == ["d"]
    # b's token is due: the sweep wakes it (its message lost), and its claim must wait for
    # d's slot, never run beside d.
    entry = store.get_entry("b")
    assert entry.due_at is not None
    time_passes_until(store, entry.due_at)
    (due,) = [d for d in store.list_due() if d.key == "b"]
    assert store.begin_wake("b", due.fence, due.status, lease_seconds=60)
    time_passes(store, MINUTE.interval)
    again = store.claim(both("b"))
    assert again.gate is Gate.HOLD, again
    assert holders(store) == ["d"]
    assert store.get_entry("b").reason == slot_reason(CUSTOMER)

"""Durable signals (design.md § "Durable signals") at the store, on SQLite and PostgreSQL: a
signal is kept until a wait takes it, taken by exactly one wait, and a wait takes exactly one;
a waiting entry is made due by its signal; an unknown or settled key keeps nothing."""

from __future__ import annotations

import threading
import time

import pytest
from test_store_contract import request

from celery_ledger.ledger import (
    EntryNotFound,
    EntryStatus,
    Gate,
    LedgerStore,
    SignalRefused,
)
from celery_ledger.ledger.signals import Taken, wait_reason

FAR = time.time() + 3600.0


def _asleep_in_wait(store: LedgerStore, key: str, name: str, *, due_in: float = 3600.0) -> int:
    """Claim ``key`` and settle it asleep in a wait for ``name``, as ``wait_for`` does.
    Returns the fence it sleeps at."""
    claim = store.claim(request(key, task_id=f"t-{key}"))
    assert claim.gate is Gate.RUN
    assert store.settle(
        key, claim.fence, EntryStatus.SLEEPING, due_in=due_in, reason=wait_reason(name)
    )
    return claim.fence


def test_a_signal_is_taken_by_exactly_one_wait_and_replays_to_it(store: LedgerStore) -> None:
    fence = _asleep_in_wait(store, "k-sig", "approved")
    assert store.list_due() == []
    sent = store.send_signal("k-sig", "approved", '{"ok": 1}', by="tester")
    # The waiting entry is due now: the sweep's wake finds it.
    assert sent.due_now and sent.status is EntryStatus.SLEEPING and sent.fence == fence
    assert [d.key for d in store.list_due()] == ["k-sig"]
    first = store.take_signal("k-sig", "approved", 1, deadline=FAR)
    assert first == Taken('{"ok": 1}', False)
    # The same wait again (a replay after a crash): the same signal, not another.
    assert store.take_signal("k-sig", "approved", 1, deadline=FAR) == first
    # The next wait for the name needs a signal of its own.
    assert store.take_signal("k-sig", "approved", 2, deadline=FAR) is None
    store.send_signal("k-sig", "approved", '{"ok": 2}', by="tester")
    assert store.take_signal("k-sig", "approved", 2, deadline=FAR) == Taken('{"ok": 2}', False)
    assert store.take_signal("k-sig", "approved", 1, deadline=FAR) == first
    rows = store.signals_of("k-sig")
    assert [(r.wait, r.payload) for r in rows] == [(1, '{"ok": 1}'), (2, '{"ok": 2}')]


def test_a_signal_before_the_wait_is_kept_and_taken_at_once(store: LedgerStore) -> None:
    claim = store.claim(request("k-early", task_id="t-early"))
    assert claim.gate is Gate.RUN
    sent = store.send_signal("k-early", "go", "[1, 2]", by="tester")
    # Running, not waiting: nothing to make due.
    assert not sent.due_now and sent.status is EntryStatus.RUNNING
    # Another name's wait does not take it.
    assert store.take_signal("k-early", "other", 1, deadline=FAR) is None
    assert store.take_signal("k-early", "go", 1, deadline=FAR) == Taken("[1, 2]", False)


def test_a_signal_sent_twice_is_two_signals_one_per_wait(store: LedgerStore) -> None:
    _asleep_in_wait(store, "k-twice", "go")
    store.send_signal("k-twice", "go", '"a"', by="tester")
    store.send_signal("k-twice", "go", '"b"', by="tester")
    assert store.take_signal("k-twice", "go", 1, deadline=FAR) == Taken('"a"', False)
    assert store.take_signal("k-twice", "go", 1, deadline=FAR) == Taken('"a"', False)
    assert store.take_signal("k-twice", "go", 2, deadline=FAR) == Taken('"b"', False)
    assert store.take_signal("k-twice", "go", 3, deadline=FAR) is None


def test_concurrent_takers_of_one_wait_get_one_signal(store: LedgerStore) -> None:
    """A superseded attempt and its successor reach the same wait at once: one signal is
    taken, both get it, the other stays for the next wait."""
    _asleep_in_wait(store, "k-race", "go")
    for payload in ('"a"', '"b"'):
        store.send_signal("k-race", "go", payload, by="tester")
    got: list[Taken | None] = []
    barrier = threading.Barrier(4)

    def take() -> None:
        barrier.wait()
        got.append(store.take_signal("k-race", "go", 1, deadline=FAR))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 4 and len(set(got)) == 1, got
    taken = [r for r in store.signals_of("k-race") if r.wait is not None]
    assert len(taken) == 1
    left = "b" if got[0] == Taken('"a"', False) else "a"
    assert store.take_signal("k-race", "go", 2, deadline=FAR) == Taken(f'"{left}"', False)


def test_a_wait_times_out_once_and_its_replay_times_out_too(store: LedgerStore) -> None:
    _asleep_in_wait(store, "k-late", "go", due_in=-1.0)
    passed = store.now() - 1.0
    assert store.take_signal("k-late", "go", 1, deadline=passed) == Taken(None, True)
    # A signal after the timeout is kept for the next wait; the timed-out wait's replay
    # still times out.
    store.send_signal("k-late", "go", '"late"', by="tester")
    assert store.take_signal("k-late", "go", 1, deadline=passed) == Taken(None, True)
    assert store.take_signal("k-late", "go", 2, deadline=FAR) == Taken('"late"', False)


def test_a_signal_pending_at_the_deadline_wins_over_the_timeout(store: LedgerStore) -> None:
    _asleep_in_wait(store, "k-both", "go")
    store.send_signal("k-both", "go", "true", by="tester")
    assert store.take_signal("k-both", "go", 1, deadline=store.now() - 1.0) == Taken("true", False)


def test_a_signal_to_an_unknown_or_settled_key_keeps_nothing(store: LedgerStore) -> None:
    with pytest.raises(EntryNotFound, match="no ledger entry with key k-none"):
        store.send_signal("k-none", "go", "1", by="tester")
    claim = store.claim(request("k-done", task_id="t-done"))
    assert store.settle("k-done", claim.fence, EntryStatus.COMPLETED, result="null")
    with pytest.raises(SignalRefused, match="k-done is completed"):
        store.send_signal("k-done", "go", "1", by="tester")
    assert store.signals_of("k-none") == [] and store.signals_of("k-done") == []


def test_only_a_wait_for_that_name_is_made_due(store: LedgerStore) -> None:
    fence = _asleep_in_wait(store, "k-name", "approved")
    assert not store.send_signal("k-name", "rejected", "1", by="tester").due_now
    assert store.list_due() == []
    # A signal the wait's own check finds (sent while the attempt still ran) makes it due.
    assert not store.due_if_signalled("k-name", fence, "approved")
    store.send_signal("k-name", "approved", "1", by="tester")
    assert [d.key for d in store.list_due()] == ["k-name"]
    assert not store.due_if_signalled("k-name", fence + 1, "approved"), "fenced"


def test_the_wait_check_after_its_settle_makes_it_due(store: LedgerStore) -> None:
    """A signal sent while the attempt still ran (before its ``sleeping`` settle) is found
    by the wait's check right after that settle."""
    claim = store.claim(request("k-gap", task_id="t-gap"))
    assert not store.send_signal("k-gap", "go", "1", by="tester").due_now
    assert store.settle(
        "k-gap", claim.fence, EntryStatus.SLEEPING, due_in=3600.0, reason=wait_reason("go")
    )
    assert store.list_due() == []
    assert store.due_if_signalled("k-gap", claim.fence, "go")
    assert [d.key for d in store.list_due()] == ["k-gap"]


def test_a_bad_signal_name_is_refused(store: LedgerStore) -> None:
    _asleep_in_wait(store, "k-bad", "go")
    for name in ("", "  ", "a\nb", "x" * 201):
        with pytest.raises(ValueError, match="signal name"):
            store.send_signal("k-bad", name, "1", by="tester")
    assert store.signals_of("k-bad") == []


def test_retention_prunes_a_settled_entrys_signals(store: LedgerStore) -> None:
    claim = store.claim(request("k-old", task_id="t-old"))
    store.send_signal("k-old", "go", "1", by="tester")
    assert store.take_signal("k-old", "go", 1, deadline=FAR) == Taken("1", False)
    store.send_signal("k-old", "go", "2", by="tester")  # never taken
    assert store.settle("k-old", claim.fence, EntryStatus.COMPLETED, result="null")
    assert store.prune_settled(-60.0) == 1
    assert store.signals_of("k-old") == []

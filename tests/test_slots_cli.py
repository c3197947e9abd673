"""Concurrency keys (docs/concurrency.md) at the operator's surface, on SQLite and PostgreSQL:
``stats`` shows the waiters per key, ``list`` each waiter with why and since when, ``doctor``
warns about a key whose waiters wait past its bound."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_slots_store import CUSTOMER, ask

from celery_ledger.cli.main import main
from celery_ledger.ledger import Gate, LedgerStore


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ledger_url: str) -> Any:
    """``celery-ledger`` in-process against ``ledger_url`` (as ``test_cli``'s)."""
    monkeypatch.setenv("CELERY_LEDGER_URL", ledger_url)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CELERY_LEDGER_OPERATOR_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    runner = CliRunner()
    return lambda *args: runner.invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def waiters(store: LedgerStore) -> LedgerStore:
    """One holder of ``CUSTOMER``'s only slot, and two waiters behind it."""
    assert store.claim(ask("k-hold")).gate is Gate.RUN
    assert store.claim(ask("k-w1")).gate is Gate.HOLD
    assert store.claim(ask("k-w2")).gate is Gate.HOLD
    return store


def test_stats_shows_waiting_per_key(cli: Any, waiters: LedgerStore) -> None:
    data = json.loads(cli("stats", "--json").output)
    (shown,) = data["waiting_for_slots"]
    assert {k: shown[k] for k in ("concurrency_key", "limit", "holding", "waiting")} == {
        "concurrency_key": CUSTOMER,
        "limit": 1,
        "holding": 1,
        "waiting": 2,
    }
    assert shown["oldest_wait_seconds"] >= 0
    text = cli("stats").output
    assert "CONCURRENCY KEY" in text and CUSTOMER in text


def test_list_shows_each_waiter_with_why_and_since_when(cli: Any, waiters: LedgerStore) -> None:
    found = json.loads(cli("list", "--status", "sleeping", "--json").output)["entries"]
    assert sorted(e["key"] for e in found) == ["k-w1", "k-w2"]
    for e in found:
        assert e["concurrency_key"] == CUSTOMER and e["reason"] == f"slot:{CUSTOMER}"
        assert e["waiting_for_slot_seconds"] is not None
        assert f"for a slot of {CUSTOMER}" in e["hint"]
    # The holder says nothing of a wait.
    (holder,) = json.loads(cli("list", "--status", "running", "--json").output)["entries"]
    assert holder["waiting_for_slot_seconds"] is None
    assert "for a slot of" in cli("list").output


def test_doctor_warns_about_waiters_older_than_the_bound(cli: Any, waiters: LedgerStore) -> None:
    def slot_check(*extra: str) -> dict[str, Any]:
        checks = json.loads(cli("doctor", "--json", *extra).output)["checks"]
        return next(c for c in checks if c["name"] == "slot waits")

    assert slot_check()["status"] == "PASS"
    # The waiters must be older than the zero bound below on the database clock (SQLite's
    # reads to the millisecond): wait for that clock to move past their start, bounded.
    since = waiters.get_entry("k-w1").waiting_since
    assert since is not None
    deadline = time.monotonic() + 10
    while waiters.now() <= since and time.monotonic() < deadline:
        time.sleep(0.005)
    late = slot_check("--slot-wait", "0")
    assert late["status"] == "WARN" and CUSTOMER in late["reason"]
    assert "2 waiting" in late["reason"]

"""Durability follows effects (design.md § "Durability follows effects"): which hot-path writes wait
for the flush to
disk, and that the connections they run on really are set that way. That a crash of the
database loses no effect and duplicates none is tests/test_ledger_crash.py's business."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner, StepStatus
from celery_ledger.settings import LedgerSettings

OWNER = Owner("w@host", "b0", 1)


def recording(store: LedgerStore) -> list[tuple[str, bool]]:
    """Record (first word of the statement, lazy) for every hot-path unit of work."""
    fast = store.fast
    real = fast.cursor
    seen: list[tuple[str, bool]] = []

    class Tagging:
        def __init__(self, cur: Any, lazy: bool) -> None:
            self.cur, self.lazy = cur, lazy

        def execute(self, sql: str, params: Any = None) -> Any:
            if not sql.startswith(("BEGIN", "COMMIT", "ROLLBACK")):
                seen.append((sql.split()[0].upper(), self.lazy))
            return self.cur.execute(sql) if params is None else self.cur.execute(sql, params)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.cur, name)

    from contextlib import contextmanager

    @contextmanager
    def cursor(*, lazy: bool = False) -> Any:
        with real(lazy=lazy) as cur:
            yield Tagging(cur, lazy)

    fast.cursor = cursor  # type: ignore[method-assign]
    return seen


def one_task(store: LedgerStore, key: str, side_effect: str) -> dict[str, bool]:
    """Claim, renew, a started and a completed step row, settle: whether each ran lazily."""
    seen = recording(store)
    lazy: dict[str, bool] = {}

    def last() -> bool:
        assert seen, "no hot-path write was seen"
        return seen[-1][1]

    claim = store.claim(ClaimRequest(key, "t", f"tid-{key}", "h", "{}", side_effect, OWNER, 60.0))
    lazy["claim"] = last()
    assert store.renew_lease(key, claim.fence, 60.0)
    lazy["renew"] = last()
    ident = ("charge", "ih", 0)
    assert store.write_step(key, claim.fence, ident, seq=1, status=StepStatus.STARTED)
    lazy["started"] = last()
    assert store.write_step(
        key, claim.fence, ident, seq=1, status=StepStatus.COMPLETED, output='"ok"'
    )
    lazy["completed"] = last()
    assert store.settle(key, claim.fence, EntryStatus.COMPLETED, result="1")
    lazy["settle"] = last()
    return lazy


def test_in_effects_mode_only_the_writes_that_let_an_effect_begin_wait(ledger_url):
    store = LedgerStore(ledger_url, durability="effects")
    try:
        # The default class: its claim is the intent of a body without steps.
        assert one_task(store, "k-non", "non_idempotent") == {
            "claim": False,
            "renew": True,
            "started": False,
            "completed": True,
            "settle": True,
        }
        assert one_task(store, "k-irr", "irreversible")["claim"] is False
        # A class that may re-run: nothing it writes guards an effect, but a step's intent.
        for side_effect in ("idempotent", "read", "keyed"):
            got = one_task(store, f"k-{side_effect}", side_effect)
            assert got["claim"] is True and got["started"] is False, (side_effect, got)
        # A block is what an operator acts on: it waits.
        claim = store.claim(ClaimRequest("k-b", "t", "tid-b", "h", "{}", "idempotent", OWNER, 60))
        seen = recording(store)
        assert store.settle("k-b", claim.fence, EntryStatus.BLOCKED, reason="ambiguous")
        assert seen[-1][1] is False
    finally:
        store.dispose()


def test_in_every_write_mode_every_write_waits(ledger_url):
    store = LedgerStore(ledger_url, durability="every-write")
    try:
        for side_effect in ("non_idempotent", "idempotent"):
            assert set(one_task(store, f"k-{side_effect}", side_effect).values()) == {False}
    finally:
        store.dispose()


def commit_setting(store: LedgerStore, lazy: bool) -> str:
    """What the hot path's connection of that kind says about its commits."""
    query = "PRAGMA synchronous" if store.is_sqlite else "SHOW synchronous_commit"
    with store.fast.cursor(lazy=lazy) as cur:
        cur.execute(query)
        return str(cur.fetchone()[0])


def test_lazy_connections_do_not_wait_for_the_flush_and_the_others_do(ledger_url):
    store = LedgerStore(ledger_url)
    try:
        if store.is_sqlite:  # 1 = NORMAL (WAL not synced at commit), 2 = FULL
            assert (commit_setting(store, True), commit_setting(store, False)) == ("1", "2")
            # Each kind is reused from its own free list, never handed to the other.
            assert commit_setting(store, False) == "2"
        else:
            # PostgreSQL asks per statement, never of the session (dialect.py, ``lazy_statement``).
            assert (commit_setting(store, True), commit_setting(store, False)) == ("on", "on")
    finally:
        store.dispose()


def test_a_lazy_statement_asks_within_its_own_transaction_on_postgresql(pg_url):
    """The lazy twin of a hot statement sets ``synchronous_commit = off`` while it runs, for
    its own transaction: its second row sees it off, the next statement sees it on again."""
    store = LedgerStore(pg_url)
    try:
        probe = store.fast.compiled(
            "probe",
            lambda: select(func.current_setting("synchronous_commit")).select_from(
                func.generate_series(1, 2)
            ),
        )
        sent: list[str] = []
        store.fast.listeners.append(sent.append)
        with store.fast.cursor(lazy=True) as cur:
            cur.execute(probe.sql, probe.params({}))
            assert [row[0] for row in cur.fetchall()] == ["on", "off"]
            cur.execute("SHOW synchronous_commit")
            assert cur.fetchone()[0] == "on"
        with store.fast.cursor(lazy=False) as cur:
            cur.execute(probe.sql, probe.params({}))
            assert [row[0] for row in cur.fetchall()] == ["on", "on"]
        assert ["set_config" in sql for sql in sent] == [True, False, False]
    finally:
        store.dispose()


def test_an_unknown_durability_is_refused_in_the_ledgers_words():
    with pytest.raises(ValueError, match="ledger_durability must be one of effects, every-write"):
        LedgerSettings.from_mapping({"ledger_durability": "sometimes"}, env={})
    with pytest.raises(ValueError, match="ledger durability 'sometimes' is not one of"):
        LedgerStore("sqlite://", durability="sometimes")
    assert LedgerSettings.from_mapping({}, env={}).durability == "effects"

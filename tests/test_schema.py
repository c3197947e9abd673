"""Schema versioning on SQLite and PostgreSQL: create at head, refuse newer, write nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, inspect, text

from celery_ledger.ledger import ClaimRequest, Gate, LedgerStore, Owner, SchemaError, SchemaTooNew
from celery_ledger.ledger.engine import make_engine
from celery_ledger.ledger.migrate import (
    VERSION_TABLE,
    current_revision,
    head_revision,
    pending_revisions,
)
from celery_ledger.ledger.schema import SCHEMA_REVISION, metadata

LEDGER_TABLES = {
    "ledger_entries",
    "ledger_steps",
    "ledger_events",
    "ledger_outbox",
    "ledger_signals",
    "ledger_concurrency_keys",
    "ledger_rate_buckets",
    "ledger_rate_holds",
}

#: The partial indexes on the hot predicates, and a fragment each WHERE clause must hold.
PARTIAL_INDEXES = {
    "ix_ledger_entries_running_lease": "running",
    "ix_ledger_entries_running_owner": "running",
    "ix_ledger_entries_attention": "interrupted",
    "ix_ledger_entries_settled_at": "settled_at",
    "ix_ledger_entries_due": "due_at",
    "ix_ledger_entries_slot_holders": "slot_at",
    "ix_ledger_entries_slot_waiters": "waiting_since",
}


@pytest.fixture
def raw_engine(ledger_url: str) -> Iterator[Engine]:
    """An engine on the test database that bypasses the store (no schema check)."""
    engine = make_engine(ledger_url)
    try:
        yield engine
    finally:
        engine.dispose()


def claim_request() -> ClaimRequest:
    return ClaimRequest(
        key="k",
        task_name="t",
        task_id="tid",
        args_hash="h",
        snapshot=None,
        side_effect="non_idempotent",
        owner=Owner("n", "b", 1),
        lease_seconds=30.0,
    )


def tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def stamp_revision(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
        )
        conn.execute(text(f"INSERT INTO {VERSION_TABLE} VALUES (:v)"), {"v": revision})


def partial_index_clauses(engine: Engine) -> dict[str, str]:
    """Index name -> its definition, for every index on ledger_entries, from the catalog."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.execute(
                text(
                    "SELECT name, sql FROM sqlite_master "
                    "WHERE type = 'index' AND tbl_name = 'ledger_entries' AND sql IS NOT NULL"
                )
            )
        else:
            rows = conn.execute(
                text(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'ledger_entries'"
                )
            )
        return {name: sql for name, sql in rows}


def test_head_revision_matches_schema_module() -> None:
    assert head_revision() == SCHEMA_REVISION == "0012_rate_limits"


def test_fresh_database_gets_schema_at_head(ledger_url: str, raw_engine: Engine) -> None:
    assert tables(raw_engine) == set()
    with raw_engine.connect() as conn:
        assert pending_revisions(conn) == [
            "0001",
            "0002",
            "0003_operators",
            "0004_time",
            "0005_outbox",
            "0006_canvas",
            "0007_events_index",
            "0008_renewed_at",
            "0009_outbox_errors",
            "0010_signals",
            "0011_concurrency",
            "0012_rate_limits",
        ]
        assert current_revision(conn) is None
    store = LedgerStore(ledger_url)
    try:
        assert store.claim(claim_request()).gate is Gate.RUN
    finally:
        store.dispose()
    assert tables(raw_engine) == LEDGER_TABLES | {VERSION_TABLE}
    with raw_engine.connect() as conn:
        assert current_revision(conn) == head_revision()
        assert pending_revisions(conn) == []
    # A second store (another worker starting) finds the schema current and applies nothing.
    again = LedgerStore(ledger_url)
    try:
        assert again.claim(claim_request()).gate is Gate.WAIT
    finally:
        again.dispose()


def test_migrated_schema_matches_the_table_definitions(ledger_url: str, raw_engine: Engine) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    store = LedgerStore(ledger_url)
    store.now()
    store.dispose()
    with raw_engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, metadata)
    assert diff == []


def test_partial_indexes_exist(ledger_url: str, raw_engine: Engine) -> None:
    store = LedgerStore(ledger_url)
    store.now()
    store.dispose()
    clauses = partial_index_clauses(raw_engine)
    for name, fragment in PARTIAL_INDEXES.items():
        assert name in clauses, f"{name} missing; have {sorted(clauses)}"
        definition = clauses[name]
        where = definition[definition.upper().index(" WHERE ") :]
        assert fragment in where, definition
    assert " WHERE " not in clauses["ix_ledger_entries_task_status"].upper()


def test_audit_events_feed_only_the_index_their_readers_use(
    ledger_url: str, raw_engine: Engine
) -> None:
    """Every transition appends an event (two per task on the hot path), so each index on
    ``ledger_events`` is paid for by every task. Its readers (``show``, the Ledger page,
    retention) find events by key; nothing reads them by type, so no index by type is kept
    (``ix_ledger_events_event`` cost 0.02 ms of server time per task)."""
    store = LedgerStore(ledger_url)
    store.now()
    store.dispose()
    indexes = {
        ix["name"]: ix["column_names"] for ix in inspect(raw_engine).get_indexes("ledger_events")
    }
    assert indexes == {"ix_ledger_events_key": ["key", "id"]}


def test_newer_schema_is_refused_and_nothing_is_written(
    ledger_url: str, raw_engine: Engine
) -> None:
    stamp_revision(raw_engine, "9999")
    store = LedgerStore(ledger_url)
    try:
        for _ in range(2):  # a refused open must not be remembered as a good one
            with pytest.raises(SchemaTooNew) as info:
                store.claim(claim_request())
            message = str(info.value)
            assert "9999" in message and "newer" in message
            assert "upgrade celery-ledger" in message
    finally:
        store.dispose()
    assert tables(raw_engine) == {VERSION_TABLE}
    with raw_engine.connect() as conn:
        assert current_revision(conn) == "9999"
        with pytest.raises(SchemaTooNew):
            pending_revisions(conn)


def test_newer_schema_is_refused_without_migrate(ledger_url: str, raw_engine: Engine) -> None:
    stamp_revision(raw_engine, "9999")
    store = LedgerStore(ledger_url, migrate=False)
    try:
        with pytest.raises(SchemaTooNew, match="9999"):
            store.claim(claim_request())
    finally:
        store.dispose()
    assert tables(raw_engine) == {VERSION_TABLE}


def test_no_migrate_on_empty_database_says_run_migrate(ledger_url: str, raw_engine: Engine) -> None:
    store = LedgerStore(ledger_url, migrate=False)
    try:
        with pytest.raises(SchemaError, match="celery-ledger migrate") as info:
            store.claim(claim_request())
        assert not isinstance(info.value, SchemaTooNew)
        with pytest.raises(SchemaError, match="celery-ledger migrate"):
            store.claim(claim_request())
    finally:
        store.dispose()
    assert tables(raw_engine) == set(), "migrate=False must create nothing"


def test_no_migrate_on_current_database_works(ledger_url: str) -> None:
    migrating = LedgerStore(ledger_url)
    migrating.now()
    migrating.dispose()
    store = LedgerStore(ledger_url, migrate=False)
    try:
        assert store.claim(claim_request()).gate is Gate.RUN
    finally:
        store.dispose()


def test_0002_keeps_a_pending_release_one_shot(ledger_url: str, raw_engine: Engine) -> None:
    """Upgrading a 0001 ledger: an entry released and not moved since keeps its one-shot
    protection (``released_executions``); one that moved on may be released again."""
    from alembic import command

    from celery_ledger.ledger.migrate import _config

    with raw_engine.begin() as conn:
        command.upgrade(_config(conn), "0001")
    rows = [
        # (key, fence now, fence of its release event)
        ("pending", 3, 3),
        ("moved-on", 5, 3),
    ]
    with raw_engine.begin() as conn:
        for key, fence, released_fence in rows:
            conn.execute(
                text(
                    "INSERT INTO ledger_entries (key, task_name, task_id, status, fence, "
                    "side_effect, args_hash, executions, interruptions, created_at, updated_at, "
                    "released_by, released_reason, released_at, released_from) VALUES (:k, 't', "
                    "'tid', 'interrupted', :f, 'non_idempotent', 'h', 2, 0, 1, 1, 'alice', 'r', "
                    "1, 'blocked')"
                ),
                {"k": key, "f": fence},
            )
            conn.execute(
                text(
                    "INSERT INTO ledger_events (key, task_id, fence, event, status, at) "
                    "VALUES (:k, 'tid', :f, 'released', 'interrupted', 1)"
                ),
                {"k": key, "f": released_fence},
            )
    store = LedgerStore(ledger_url)  # migrates to head
    try:
        assert store.get_entry("pending").released_executions == 2
        assert store.get_entry("moved-on").released_executions is None
        assert store.get_entry("pending").due_at is None
    finally:
        store.dispose()
    with raw_engine.connect() as conn:
        assert current_revision(conn) == head_revision()


def test_0007_drops_the_events_type_index_and_keeps_every_event(
    ledger_url: str, raw_engine: Engine
) -> None:
    """Upgrading a 0006 ledger drops ``ix_ledger_events_event`` and keeps the audit trail; the
    downgrade puts the index back."""
    from alembic import command

    from celery_ledger.ledger.migrate import _config

    with raw_engine.begin() as conn:
        command.upgrade(_config(conn), "0006_canvas")
        conn.execute(
            text(
                "INSERT INTO ledger_events (key, task_id, fence, event, status, at) "
                "VALUES ('k', 'tid', 1, 'claimed', 'running', 1)"
            )
        )
    assert "ix_ledger_events_event" in {
        i["name"] for i in inspect(raw_engine).get_indexes("ledger_events")
    }
    store = LedgerStore(ledger_url)  # migrates to head
    try:
        assert [e.event for e in store.entry_events("k")] == ["claimed"]
    finally:
        store.dispose()
    names = {i["name"] for i in inspect(raw_engine).get_indexes("ledger_events")}
    assert names == {"ix_ledger_events_key"}
    with raw_engine.begin() as conn:
        command.downgrade(_config(conn), "0006_canvas")
    assert "ix_ledger_events_event" in {
        i["name"] for i in inspect(raw_engine).get_indexes("ledger_events")
    }


def test_0008_keeps_running_rows_and_mark_dead_falls_back_to_their_lease(
    ledger_url: str, raw_engine: Engine
) -> None:
    """Upgrading a 0007 ledger adds ``renewed_at`` and ``lease_seconds`` (NULL on existing
    rows). A row still running under a worker from before the upgrade is judged by its live
    lease, as before; its next renewal stamps the new columns. The downgrade drops them."""
    from alembic import command

    from celery_ledger.ledger import MarkDeadRefused
    from celery_ledger.ledger.migrate import _config

    with raw_engine.begin() as conn:
        command.upgrade(_config(conn), "0007_events_index")
    now = time.time()  # the database's clock on this host; the lease has a minute to spare
    with raw_engine.begin() as conn:  # written as a 0007 worker would: no renewed_at yet
        conn.execute(
            text(
                "INSERT INTO ledger_entries (key, task_name, task_id, status, fence, "
                "side_effect, args_hash, owner, lease_until, executions, interruptions, "
                "created_at, updated_at) VALUES ('k-old', 'shop.charge', 'tid', 'running', "
                "1, 'non_idempotent', 'h', 'celery@a', :until, 1, 0, :now, :now)"
            ),
            {"until": now + 60.0, "now": now},
        )
    store = LedgerStore(ledger_url)  # migrates to head
    try:
        entry = store.get_entry("k-old")
        assert (entry.renewed_at, entry.lease_seconds) == (None, None)
        # Judged by the lease (written ``now``, so renewed at ``now``: a few seconds ago at
        # most, however long the migration took on a loaded machine).
        with pytest.raises(
            MarkDeadRefused, match=r"renewed the lease \ds ago \(the lease is live\)"
        ):
            store.mark_dead("k-old", by="ann", reason="r", grace_seconds=120.0, lease_seconds=60.0)
        assert store.renew_lease("k-old", 1, 90.0)
        entry = store.get_entry("k-old")
        assert entry.renewed_at is not None and entry.lease_seconds == 90.0
    finally:
        store.dispose()
    with raw_engine.begin() as conn:
        command.downgrade(_config(conn), "0007_events_index")
    columns = {c["name"] for c in inspect(raw_engine).get_columns("ledger_entries")}
    assert "renewed_at" not in columns and "lease_seconds" not in columns

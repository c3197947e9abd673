"""Schema versioning with Alembic: check, plan and upgrade the ledger schema.

Every process that opens a ledger calls ``ensure_schema``: an empty database is created, an
older one is upgraded, a newer one is refused. Many workers start at once, so the check and
the upgrade run in one transaction that holds a lock (an advisory lock on PostgreSQL, the
write lock that ``BEGIN IMMEDIATE`` takes on SQLite): exactly one process migrates, the others
wait and then find the schema current.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect, text

from celery_ledger.ledger.errors import SchemaTooNew
from celery_ledger.ledger.schema import SCHEMA_REVISION

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic (and Mako under it) is imported only when a schema must be created, upgraded or
# planned: every pool process checks the schema once at start, and the fast check below needs
# one query and no Alembic, which keeps ~4 MiB out of each process.

VERSION_TABLE = "ledger_alembic_version"
#: Arbitrary constant naming the ledger's migration lock among PostgreSQL advisory locks.
PG_MIGRATION_LOCK = 0x1ED6E2

_MIGRATIONS = Path(__file__).with_name("migrations")


def _config(conn: Connection | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def schema_is_current(engine: Engine) -> bool:
    """True when the database is at this code's revision (one query, no Alembic)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return False
        found = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    return found == [SCHEMA_REVISION]


def current_revision(conn: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return ctx.get_current_revision()


def pending_revisions(conn: Connection) -> list[str]:
    """Revisions that ``upgrade`` would apply, oldest first (read-only).

    Raises:
        SchemaTooNew: when the database holds a revision this code does not know.
    """
    from alembic import util
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_config())
    current = current_revision(conn)
    if current is not None:
        # Alembic raises (rather than returning None) for a revision it has no script for.
        try:
            known = script.get_revision(current) is not None
        except util.CommandError:
            known = False
        if not known:
            raise SchemaTooNew(_too_new_message(current))
    revs = list(script.iterate_revisions("head", current or "base"))
    return [r.revision for r in reversed(revs) if r.revision != current]


def all_revisions() -> list[str]:
    """Every revision from base to head, oldest first: what an empty database is migrated
    through (no connection needed)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_config())
    return [r.revision for r in reversed(list(script.iterate_revisions("head", "base")))]


def _too_new_message(current: str) -> str:
    return (
        f"ledger schema revision {current!r} is newer than this celery-ledger "
        f"(knows up to {head_revision()!r}); upgrade celery-ledger before opening this ledger"
    )


def ensure_schema(engine: Engine) -> list[str]:
    """Create or upgrade the schema to head under a lock; return the revisions applied.

    Raises:
        SchemaTooNew: when the database was migrated by a newer celery-ledger.
    """
    from alembic import command, util  # alembic's command module is slow to import

    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATION_LOCK})
        try:
            pending = pending_revisions(conn)
        except util.CommandError as exc:  # pragma: no cover - damaged version table
            raise SchemaTooNew(str(exc)) from exc
        if pending:
            command.upgrade(_config(conn), "head")
        return pending

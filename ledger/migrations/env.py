"""Alembic environment for the ledger schema.

The store runs migrations through ``celery_ledger.ledger.migrate``, which hands over a connection
that is already inside a transaction holding the migration lock; this file only wires that
connection.
"""

from __future__ import annotations

from alembic import context

from celery_ledger.ledger.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - the CLI always passes one
    raise RuntimeError("run ledger migrations through `celery-ledger migrate`")

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table="ledger_alembic_version",
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()

"""docs/concurrency.md: concurrency keys (``concurrency_key=``, ``concurrency_limit=``).

- ``ledger_entries.concurrency_key``, ``slot_at``, ``waiting_since``: an entry's key, when it
  took (or was handed) a slot, since when it waits for one.
- ``ix_ledger_entries_slot_holders``, ``ix_ledger_entries_slot_waiters``: partial indexes, as
  small as the slots held and the waiters.
- ``ledger_concurrency_keys``: one row per key, locked by every decision about its slots.

Revision ID: 0011_concurrency
Revises: 0010_signals
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_concurrency"
down_revision = "0010_signals"
branch_labels = None
depends_on = None

HOLDING = sa.text("slot_at IS NOT NULL")
WAITING = sa.text("waiting_since IS NOT NULL")


def upgrade() -> None:
    op.add_column("ledger_entries", sa.Column("concurrency_key", sa.String(255)))
    op.add_column("ledger_entries", sa.Column("slot_at", sa.Float))
    op.add_column("ledger_entries", sa.Column("waiting_since", sa.Float))
    op.create_index(
        "ix_ledger_entries_slot_holders",
        "ledger_entries",
        ["concurrency_key"],
        postgresql_where=HOLDING,
        sqlite_where=HOLDING,
    )
    op.create_index(
        "ix_ledger_entries_slot_waiters",
        "ledger_entries",
        ["concurrency_key", "waiting_since"],
        postgresql_where=WAITING,
        sqlite_where=WAITING,
    )
    op.create_table(
        "ledger_concurrency_keys",
        sa.Column("concurrency_key", sa.String(255), primary_key=True),
        sa.Column("slot_limit", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ledger_concurrency_keys")
    op.drop_index("ix_ledger_entries_slot_waiters", table_name="ledger_entries")
    op.drop_index("ix_ledger_entries_slot_holders", table_name="ledger_entries")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("waiting_since")
        batch.drop_column("slot_at")
        batch.drop_column("concurrency_key")

"""design.md § "Durability follows effects": drop ``ix_ledger_events_event``, an index that no query
reads.

Every transition appends an audit event, two per task on the hot path, and every event row
went into this index on (event, key). Nothing reads events by type: ``show``, the Ledger page
and retention find them by key (``ix_ledger_events_key``). Its one reader was 0002's backfill,
which runs before this revision. Measured on PostgreSQL, a claim and a settle with their events
on a bare connection, a fresh database for each case and three pairs of runs: 0.373 ms per
task without the index against 0.394 ms with it (docs/benchmarks.md, "The schema's floor").

Revision ID: 0007_events_index
Revises: 0006_canvas
"""

from alembic import op

revision = "0007_events_index"
down_revision = "0006_canvas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_ledger_events_event", table_name="ledger_events")


def downgrade() -> None:
    op.create_index("ix_ledger_events_event", "ledger_events", ["event", "key"])

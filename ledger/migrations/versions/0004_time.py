"""design.md § "Durable time": durable time. Cancellation, deadlines, and the index a revoke looks
up by.

- ``cancel_requested_at``, ``cancel_by``, ``cancel_reason``: a cancellation asked for while
  the entry may be running. The attempt's next effect step is refused by its own write (no
  extra statement) and the attempt settles ``cancelled``. Indexed while pending.
- ``deadline_at``: no effect step starts after it (database clock).
- ``ix_ledger_entries_task_id``: ``AsyncResult(id).revoke()`` names a task id, not a key.
- ``tombstone_at``: retention keeps a pruned entry's key, final status and settled time (here)
  for a longer window; indexed while set.

The new statuses (``scheduled``, ``sleeping``, ``cancelled``, ``expired``) are values of the
existing ``status`` column; scheduled and sleeping entries wait on the existing due-time index
(0002).

Revision ID: 0004_time
Revises: 0003_operators
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_time"
down_revision = "0003_operators"
branch_labels = None
depends_on = None

TOMBSTONE = sa.text("tombstone_at IS NOT NULL")
PENDING = sa.text(
    "cancel_requested_at IS NOT NULL AND status IN "
    "('running', 'interrupted', 'retrying', 'scheduled', 'sleeping')"
)


def upgrade() -> None:
    op.add_column("ledger_entries", sa.Column("cancel_requested_at", sa.Float))
    op.add_column("ledger_entries", sa.Column("cancel_by", sa.String(255)))
    op.add_column("ledger_entries", sa.Column("cancel_reason", sa.Text))
    op.add_column("ledger_entries", sa.Column("deadline_at", sa.Float))
    op.add_column("ledger_entries", sa.Column("tombstone_at", sa.Float))
    op.create_index(
        "ix_ledger_entries_tombstone",
        "ledger_entries",
        ["tombstone_at"],
        postgresql_where=TOMBSTONE,
        sqlite_where=TOMBSTONE,
    )
    op.create_index(
        "ix_ledger_entries_cancel_pending",
        "ledger_entries",
        ["cancel_requested_at"],
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )
    op.create_index("ix_ledger_entries_task_id", "ledger_entries", ["task_id"])


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_task_id", table_name="ledger_entries")
    op.drop_index("ix_ledger_entries_tombstone", table_name="ledger_entries")
    op.drop_index("ix_ledger_entries_cancel_pending", table_name="ledger_entries")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("tombstone_at")
        batch.drop_column("deadline_at")
        batch.drop_column("cancel_reason")
        batch.drop_column("cancel_by")
        batch.drop_column("cancel_requested_at")

"""design.md § "One envelope, one admission gate": the last sign of life of an entry's attempt, kept
where an interrupt cannot erase it.

- ``renewed_at``: when (database clock) an attempt last showed it was alive: its claim and
  each lease renewal. The sweep's interrupt clears ``lease_until`` and leaves this one, so
  ``mark-dead`` still refuses inside its grace window after the entry was interrupted. An
  attempt's own settle clears it unless an earlier attempt of the entry was lost
  (``interruptions`` > 0): that one may still be paused in the middle of a call.
- ``lease_seconds``: the lease that attempt took (a task's own ``lease_seconds`` may differ
  from ``ledger_lease_seconds``), by which ``mark-dead`` scales its grace window.

Both stay NULL on existing rows until their attempt renews; ``mark-dead`` falls back to
``lease_until`` then. No index: they are read with the entry by its key.

Revision ID: 0008_renewed_at
Revises: 0007_events_index
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_renewed_at"
down_revision = "0007_events_index"
branch_labels = None
depends_on = None

COLUMNS = ("renewed_at", "lease_seconds")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("ledger_entries", sa.Column(name, sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)

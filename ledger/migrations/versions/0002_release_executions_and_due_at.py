"""design.md § "Recovery": one-shot release keyed on executions; the due time of a waiting entry.

- ``released_executions``: the entry's ``executions`` when it was last released. A second
  release is refused while ``executions`` has not moved (the body has not run since), however
  often the fence moved meanwhile (a resume that never ran, a sweep).
- ``due_at``: when recovery acts on an entry that waits for a time (database clock, seconds
  since the epoch): a ``retrying`` entry whose retry has not arrived by then is re-sent.
  Indexed while set, so any later status that waits for a time uses the same index.

Entries that were ``retrying`` before this revision have no due time and are not re-sent;
``celery-ledger list --status retrying`` shows them.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

WAITING = sa.text("due_at IS NOT NULL")


def upgrade() -> None:
    op.add_column("ledger_entries", sa.Column("released_executions", sa.Integer))
    op.add_column("ledger_entries", sa.Column("due_at", sa.Float))
    # Under 0001 a release was one-shot while the entry kept the fence the release wrote. An
    # entry in that state keeps its protection under the new rule; every other one (NULL)
    # may be released, as before.
    op.execute(
        "UPDATE ledger_entries SET released_executions = executions "
        "WHERE released_at IS NOT NULL AND EXISTS (SELECT 1 FROM ledger_events ev "
        "WHERE ev.key = ledger_entries.key AND ev.event = 'released' "
        "AND ev.fence = ledger_entries.fence)"
    )
    op.create_index(
        "ix_ledger_entries_due",
        "ledger_entries",
        ["due_at"],
        postgresql_where=WAITING,
        sqlite_where=WAITING,
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_due", table_name="ledger_entries")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("due_at")
        batch.drop_column("released_executions")

"""design.md § "Canvas: chains, groups, chords, callbacks": a ledgered task's place in Celery's
canvas (``group_id``, ``parent_id``).

``group_id`` is the Celery group (or chord header) a member was published in, ``parent_id``
the task that published it (a chain's previous link, a ledgered task that sent a group):
``celery-ledger show`` of a parent or a group id lists its members and their states. Both are
NULL for a task outside any canvas, and the indexes hold only the rows that have one.

Revision ID: 0006_canvas
Revises: 0005_outbox
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_canvas"
down_revision = "0005_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ledger_entries", sa.Column("group_id", sa.String(255)))
    op.add_column("ledger_entries", sa.Column("parent_id", sa.String(255)))
    op.create_index(
        "ix_ledger_entries_group",
        "ledger_entries",
        ["group_id"],
        postgresql_where=sa.text("group_id IS NOT NULL"),
        sqlite_where=sa.text("group_id IS NOT NULL"),
    )
    op.create_index(
        "ix_ledger_entries_parent",
        "ledger_entries",
        ["parent_id"],
        postgresql_where=sa.text("parent_id IS NOT NULL"),
        sqlite_where=sa.text("parent_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_parent", table_name="ledger_entries")
    op.drop_index("ix_ledger_entries_group", table_name="ledger_entries")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("parent_id")
        batch.drop_column("group_id")

"""guarantees.md § "Bad input": a child the broker publish refuses every time never holds back the
others.

- ``publish_errors``: how many publishes of this child failed for a fault of its own (a bad
  option, a payload that cannot be opened), not the broker's; the sweep lists the children
  with the fewest first, so a bad one waits behind the good ones instead of in front of them.
- ``last_error``: the last such failure, shown by ``show`` and the Ledger page.
- ``dropped_reason``: an operator dropped this child (``celery-ledger outbox drop``): who and
  why. ``published_at`` is set then too: the outbox no longer owes it.

The index of what the sweep publishes follows its new order.

Revision ID: 0009_outbox_errors
Revises: 0008_renewed_at
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_outbox_errors"
down_revision = "0008_renewed_at"
branch_labels = None
depends_on = None

UNPUBLISHED = sa.text("published_at IS NULL")


def upgrade() -> None:
    op.add_column(
        "ledger_outbox",
        sa.Column("publish_errors", sa.Integer, nullable=False, server_default=sa.text("0")),
    )
    op.add_column("ledger_outbox", sa.Column("last_error", sa.Text))
    op.add_column("ledger_outbox", sa.Column("dropped_reason", sa.Text))
    op.drop_index("ix_ledger_outbox_unpublished", table_name="ledger_outbox")
    op.create_index(
        "ix_ledger_outbox_unpublished",
        "ledger_outbox",
        ["publish_errors", "created_at"],
        postgresql_where=UNPUBLISHED,
        sqlite_where=UNPUBLISHED,
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_outbox_unpublished", table_name="ledger_outbox")
    op.create_index(
        "ix_ledger_outbox_unpublished",
        "ledger_outbox",
        ["created_at"],
        postgresql_where=UNPUBLISHED,
        sqlite_where=UNPUBLISHED,
    )
    with op.batch_alter_table("ledger_outbox") as batch:
        for name in ("dropped_reason", "last_error", "publish_errors"):
            batch.drop_column(name)

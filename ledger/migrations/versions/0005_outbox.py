"""design.md § "Transaction steps and the transactional outbox": the transactional outbox
(``ledger_outbox``).

A child task a step sends is recorded here in the same transaction as the step's
``completed`` row, and published after that row commits; ``published_at`` is set once the
broker confirmed it. The sweep publishes the rows still unpublished (index on
``created_at`` while ``published_at IS NULL``).

Revision ID: 0005_outbox
Revises: 0004_time
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_outbox"
down_revision = "0004_time"
branch_labels = None
depends_on = None

UNPUBLISHED = sa.text("published_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "ledger_outbox",
        sa.Column("child_id", sa.String(255), primary_key=True),
        sa.Column("parent_key", sa.String(64), nullable=False),
        sa.Column("step", sa.String(255), nullable=False),
        sa.Column("occurrence", sa.Integer, nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("published_at", sa.Float),
    )
    op.create_index("ix_ledger_outbox_parent", "ledger_outbox", ["parent_key", "occurrence", "n"])
    op.create_index(
        "ix_ledger_outbox_unpublished",
        "ledger_outbox",
        ["created_at"],
        postgresql_where=UNPUBLISHED,
        sqlite_where=UNPUBLISHED,
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_outbox_unpublished", table_name="ledger_outbox")
    op.drop_index("ix_ledger_outbox_parent", table_name="ledger_outbox")
    op.drop_table("ledger_outbox")

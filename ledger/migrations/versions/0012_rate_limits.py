"""design.md § "Fleet-wide rate limits": the token buckets, and the entries held for a token.

- ``ledger_rate_buckets``: one row per bucket (a limited task, or a task and an argument
  value): ``tat``, when its next token is due (database clock), ``queue_end``, when the slot
  after its last held delivery is, ``admitted``, the last claim that took a token.
- ``ledger_rate_holds``: one row per entry held for a token (``scheduled``), with since when.

Self-contained: it adds two tables and touches no other.

Revision ID: 0012_rate_limits
Revises: 0011_concurrency
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_rate_limits"
down_revision = "0011_concurrency"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_rate_buckets",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("tat", sa.Float, nullable=False),
        sa.Column("queue_end", sa.Float, nullable=False),
        sa.Column("admitted", sa.String(255)),
    )
    op.create_table(
        "ledger_rate_holds",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("bucket", sa.String(255), nullable=False),
        sa.Column("rate", sa.String(64), nullable=False),
        sa.Column("held_since", sa.Float, nullable=False),
        sa.Column("due_at", sa.Float, nullable=False),
        sa.Column("holds", sa.Integer, nullable=False, server_default=sa.text("1")),
    )
    op.create_index("ix_ledger_rate_holds_bucket", "ledger_rate_holds", ["bucket", "held_since"])


def downgrade() -> None:
    op.drop_index("ix_ledger_rate_holds_bucket", table_name="ledger_rate_holds")
    op.drop_table("ledger_rate_holds")
    op.drop_table("ledger_rate_buckets")

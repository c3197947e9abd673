"""design.md § "Durable signals": the payloads sent to entries, and which wait took each.

- ``ledger_signals``: one row per signal sent (``celery_ledger.signal``), and one per wait
  that timed out. ``wait`` is the occurrence of the wait that took it, unique per (key, name):
  a signal is taken by one wait, a wait takes one signal.
- ``ix_ledger_signals_pending``: the signals no wait took yet, the only ones a wait reads.

Revision ID: 0010_signals
Revises: 0009_outbox_errors
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_signals"
down_revision = "0009_outbox_errors"
branch_labels = None
depends_on = None

PENDING = sa.text('"wait" IS NULL')


def upgrade() -> None:
    op.create_table(
        "ledger_signals",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("payload", sa.Text),
        sa.Column("sent_by", sa.String(255)),
        sa.Column("sent_at", sa.Float, nullable=False),
        sa.Column("wait", sa.Integer),
        sa.Column("taken_at", sa.Float),
        sa.Column("timed_out", sa.Integer, nullable=False, server_default=sa.text("0")),
    )
    op.create_index(
        "uq_ledger_signals_wait", "ledger_signals", ["key", "name", "wait"], unique=True
    )
    op.create_index(
        "ix_ledger_signals_pending",
        "ledger_signals",
        ["key", "name", "id"],
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_signals_pending", table_name="ledger_signals")
    op.drop_index("uq_ledger_signals_wait", table_name="ledger_signals")
    op.drop_table("ledger_signals")

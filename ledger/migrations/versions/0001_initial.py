"""Initial ledger schema: entries, replay rows (steps), events.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

RUNNING = sa.text("status = 'running'")
ATTENTION = sa.text("status IN ('interrupted', 'blocked', 'retrying')")
SETTLED = sa.text("settled_at IS NOT NULL")


def _partial_index(name: str, cols: list[str], where: sa.TextClause) -> None:
    op.create_index(name, "ledger_entries", cols, postgresql_where=where, sqlite_where=where)


def upgrade() -> None:
    op.create_table(
        "ledger_entries",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("side_effect", sa.String(16), nullable=False),
        sa.Column("args_hash", sa.String(64), nullable=False),
        sa.Column("snapshot", sa.Text),
        sa.Column("owner", sa.String(255)),
        sa.Column("owner_boot", sa.String(64)),
        sa.Column("owner_pid", sa.Integer),
        sa.Column("lease_until", sa.Float),
        sa.Column("result", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("reason", sa.Text),
        sa.Column("executions", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("interruptions", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("settled_at", sa.Float),
        sa.Column("released_by", sa.String(255)),
        sa.Column("released_reason", sa.Text),
        sa.Column("released_at", sa.Float),
        sa.Column("released_from", sa.String(16)),
    )
    _partial_index("ix_ledger_entries_running_lease", ["lease_until"], RUNNING)
    _partial_index("ix_ledger_entries_running_owner", ["owner", "owner_boot"], RUNNING)
    _partial_index("ix_ledger_entries_attention", ["status", "updated_at"], ATTENTION)
    _partial_index("ix_ledger_entries_settled_at", ["settled_at"], SETTLED)
    op.create_index("ix_ledger_entries_task_status", "ledger_entries", ["task_name", "status"])

    op.create_table(
        "ledger_steps",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("input_hash", sa.String(64), primary_key=True),
        sa.Column("occurrence", sa.Integer, primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output", sa.Text),
        sa.Column("external_ref", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("authorized", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("completed_at", sa.Float),
    )

    unauthorized = sa.text("attempts > authorized + 1")
    op.create_index(
        "ix_ledger_steps_unauthorized",
        "ledger_steps",
        ["key"],
        postgresql_where=unauthorized,
        sqlite_where=unauthorized,
    )

    op.create_table(
        "ledger_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("task_id", sa.String(255)),
        sa.Column("fence", sa.BigInteger),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16)),
        sa.Column("actor", sa.String(255)),
        sa.Column("detail", sa.Text),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.create_index("ix_ledger_events_key", "ledger_events", ["key", "id"])
    op.create_index("ix_ledger_events_event", "ledger_events", ["event", "key"])


def downgrade() -> None:
    op.drop_table("ledger_events")
    op.drop_table("ledger_steps")
    op.drop_table("ledger_entries")

"""design.md § "Operators": the death-signal gate on release, and a fenced attempt's signs of life.

- ``dead_fence``, ``dead_by``, ``dead_reason``, ``dead_at``: an operator's assertion
  (``mark-dead``) that every attempt of the entry up to fence ``dead_fence`` is dead. Under
  ``ledger_release_requires_death_signal`` a ``not-executed`` release of an ambiguous step
  needs it to cover the fence that started the step.
- ``seen_alive_at``, ``seen_alive_fence``, ``seen_alive_owner``: the last time (database
  clock) a superseded attempt tried to write (a refused renewal or step write), which attempt
  and which worker: "seen alive at ...", shown by ``show`` and the Ledger page, and the reason
  ``mark-dead`` refuses within its grace window.

No index: they are read with the entry by its key.

Revision ID: 0003_operators
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_operators"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = (
    ("dead_fence", sa.BigInteger),
    ("dead_by", lambda: sa.String(255)),
    ("dead_reason", sa.Text),
    ("dead_at", sa.Float),
    ("seen_alive_at", sa.Float),
    ("seen_alive_fence", sa.BigInteger),
    ("seen_alive_owner", lambda: sa.String(255)),
)


def upgrade() -> None:
    for name, type_ in COLUMNS:
        op.add_column("ledger_entries", sa.Column(name, type_()))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)

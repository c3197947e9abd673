"""The ledger's tables. Data only: every rule about them lives in the store.

Times are seconds since the epoch as floats, read from the database clock
(``celery_ledger.ledger.dbclock``), so that leases compare on one clock whichever host wrote them
and both SQLite and PostgreSQL index them the same way.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData()

#: Bumped with every Alembic revision; the migration head must equal it.
SCHEMA_REVISION = "0012_rate_limits"

KEY = String(64)

entries = Table(
    "ledger_entries",
    metadata,
    Column("key", KEY, primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("task_id", String(255), nullable=False),
    Column("status", String(16), nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("side_effect", String(16), nullable=False),
    Column("args_hash", String(64), nullable=False),
    Column("snapshot", Text),
    Column("owner", String(255)),
    Column("owner_boot", String(64)),
    Column("owner_pid", Integer),
    Column("lease_until", Float),
    Column("result", Text),
    Column("error", Text),
    Column("reason", Text),
    Column("executions", Integer, nullable=False, server_default=text("0")),
    Column("interruptions", Integer, nullable=False, server_default=text("0")),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("settled_at", Float),
    Column("released_by", String(255)),
    Column("released_reason", Text),
    Column("released_at", Float),
    Column("released_from", String(16)),
    # ``executions`` when the last release was made: release is one-shot until the body runs
    # again (executions moves), whatever the fence did meanwhile (0002).
    Column("released_executions", Integer),
    # When recovery acts on an entry that waits for a time, on the database clock: a retry
    # whose message has not arrived by then is re-sent. Set only while the entry waits (0002),
    # and kept on an entry woken from ``scheduled``/``sleeping`` until a claim runs it: the
    # mark that no attempt has run the body since that clean settle (its claim is a RUN).
    Column("due_at", Float),
    # mark-dead: every attempt up to this fence is asserted dead, by whom, why, when (0005).
    Column("dead_fence", BigInteger),
    Column("dead_by", String(255)),
    Column("dead_reason", Text),
    Column("dead_at", Float),
    # The last refused write of a superseded attempt: when, its fence, its worker (0005).
    Column("seen_alive_at", Float),
    Column("seen_alive_fence", BigInteger),
    Column("seen_alive_owner", String(255)),
    # design.md § "Durable time" (0004_time): a cancellation asked for while the entry may be
    # running; the
    # attempt stops at its next effect step (the step's own write refuses it) and settles
    # ``cancelled``.
    Column("cancel_requested_at", Float),
    Column("cancel_by", String(255)),
    Column("cancel_reason", Text),
    # design.md § "Durable time" (0004_time): the latest time (database clock) at which an effect
    # step may start.
    Column("deadline_at", Float),
    # design.md § "Durable time" (0004_time): a tombstone. Retention pruned this settled entry's
    # steps, events,
    # result and snapshot and kept the key, its final status and its settled time (here; then
    # ``settled_at`` is NULL) for ``ledger_tombstone_days``: a late delivery finds it.
    Column("tombstone_at", Float),
    # The Celery group (or chord header) this task was published in, and the task that
    # published it (a chain's previous link, a task that sent a group): ``show`` lists a
    # parent's members (0006_canvas). NULL outside any canvas.
    Column("group_id", String(255)),
    Column("parent_id", String(255)),
    # The last sign of life of an attempt (its claim, each lease renewal; database clock) and
    # the lease it took (a task's own may differ from the global one): what ``mark-dead``
    # judges its grace by. The interrupt leaves both (0008_renewed_at).
    Column("renewed_at", Float),
    Column("lease_seconds", Float),
    # Concurrency keys (0011_concurrency; docs/concurrency.md): the task's concurrency key,
    # when it holds a slot of it (a claim took one, or a settle handed it one; cleared when
    # it leaves ``running``), and since when it waits for one (``sleeping`` with the reason
    # ``slot:<key>``; the order in which waiters are served).
    Column("concurrency_key", String(255)),
    Column("slot_at", Float),
    Column("waiting_since", Float),
)

# Hot predicates. Partial indexes stay as small as the work in flight, so the stale-lease
# sweep and the boot sweep cost the same at 1 row or at 1,000,000 settled rows.
Index(
    "ix_ledger_entries_running_lease",
    entries.c.lease_until,
    postgresql_where=entries.c.status == "running",
    sqlite_where=entries.c.status == "running",
)
Index(
    "ix_ledger_entries_running_owner",
    entries.c.owner,
    entries.c.owner_boot,
    postgresql_where=entries.c.status == "running",
    sqlite_where=entries.c.status == "running",
)
Index(
    "ix_ledger_entries_attention",
    entries.c.status,
    entries.c.updated_at,
    postgresql_where=entries.c.status.in_(["interrupted", "blocked", "retrying"]),
    sqlite_where=entries.c.status.in_(["interrupted", "blocked", "retrying"]),
)
Index(
    "ix_ledger_entries_settled_at",
    entries.c.settled_at,
    postgresql_where=entries.c.settled_at.is_not(None),
    sqlite_where=entries.c.settled_at.is_not(None),
)
Index("ix_ledger_entries_task_status", entries.c.task_name, entries.c.status)
# Entries waiting for a time (``retrying`` today; any later status that waits for a due time
# joins without a new index). ``due_at < :now`` implies ``due_at IS NOT NULL`` on both
# databases, so the sweep's range query uses it; it holds only the entries that wait.
Index(
    "ix_ledger_entries_due",
    entries.c.due_at,
    postgresql_where=entries.c.due_at.is_not(None),
    sqlite_where=entries.c.due_at.is_not(None),
)

# Cancellations not yet carried out (design.md § "Durable time"): stays as small as the
# cancellations in flight.
CANCEL_PENDING = ("running", "interrupted", "retrying", "scheduled", "sleeping")
Index(
    "ix_ledger_entries_cancel_pending",
    entries.c.cancel_requested_at,
    postgresql_where=entries.c.cancel_requested_at.is_not(None)
    & entries.c.status.in_(CANCEL_PENDING),
    sqlite_where=entries.c.cancel_requested_at.is_not(None) & entries.c.status.in_(CANCEL_PENDING),
)
Index(
    "ix_ledger_entries_tombstone",
    entries.c.tombstone_at,
    postgresql_where=entries.c.tombstone_at.is_not(None),
    sqlite_where=entries.c.tombstone_at.is_not(None),
)
# Concurrency keys (0011_concurrency): the slots held per key, and the waiters in order.
Index(
    "ix_ledger_entries_slot_holders",
    entries.c.concurrency_key,
    postgresql_where=entries.c.slot_at.is_not(None),
    sqlite_where=entries.c.slot_at.is_not(None),
)
Index(
    "ix_ledger_entries_slot_waiters",
    entries.c.concurrency_key,
    entries.c.waiting_since,
    postgresql_where=entries.c.waiting_since.is_not(None),
    sqlite_where=entries.c.waiting_since.is_not(None),
)
# ``revoke(task_id)`` names a task id, not a key (design.md § "Durable time").
Index("ix_ledger_entries_task_id", entries.c.task_id)

steps = Table(
    "ledger_steps",
    metadata,
    Column("key", KEY, primary_key=True),
    Column("name", String(255), primary_key=True),
    Column("input_hash", String(64), primary_key=True),
    Column("occurrence", Integer, primary_key=True),
    Column("seq", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("output", Text),
    Column("external_ref", Text),
    Column("error", Text),
    Column("fence", BigInteger, nullable=False),
    # How often the body of this step was started, and how many of those re-runs an
    # authorized not_executed verdict allowed: the duplicate-execution rate is
    # sum(attempts - 1 - authorized) over effect steps and should stay 0.
    Column("attempts", Integer, nullable=False, server_default=text("1")),
    Column("authorized", Integer, nullable=False, server_default=text("0")),
    Column("started_at", Float, nullable=False),
    Column("completed_at", Float),
)

events = Table(
    "ledger_events",
    metadata,
    # Integer on SQLite so the column is the rowid alias and autoincrements.
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("key", KEY, nullable=False),
    Column("task_id", String(255)),
    Column("fence", BigInteger),
    Column("event", String(32), nullable=False),
    Column("status", String(16)),
    Column("actor", String(255)),
    Column("detail", Text),
    Column("at", Float, nullable=False),
)
# Steps whose body started more often than 1 + the authorized re-runs: the duplicates the
# ledger promises never to make. Normally empty, so stats() reads nothing.
Index(
    "ix_ledger_steps_unauthorized",
    steps.c.key,
    postgresql_where=steps.c.attempts > steps.c.authorized + 1,
    sqlite_where=steps.c.attempts > steps.c.authorized + 1,
)

Index(
    "ix_ledger_entries_group",
    entries.c.group_id,
    postgresql_where=entries.c.group_id.is_not(None),
    sqlite_where=entries.c.group_id.is_not(None),
)
Index(
    "ix_ledger_entries_parent",
    entries.c.parent_id,
    postgresql_where=entries.c.parent_id.is_not(None),
    sqlite_where=entries.c.parent_id.is_not(None),
)

# Events are read by key (``show``, the Ledger page, retention), never by type: every task
# appends two, so an index by type would be paid by every task for no reader (0007).
Index("ix_ledger_events_key", events.c.key, events.c.id)

# The transactional outbox (0005_outbox): a child task a step sends, recorded in the same
# transaction as the step's ``completed`` row and published after it commits. ``child_id`` is
# the child's task id, derived from (parent_key, step, occurrence, n), so a re-publish is the
# same message and the child's own claim deduplicates it.
outbox = Table(
    "ledger_outbox",
    metadata,
    Column("child_id", String(255), primary_key=True),
    Column("parent_key", KEY, nullable=False),
    Column("step", String(255), nullable=False),
    # The step's occurrence (its position among the steps of that name), and the n-th send
    # inside that one step run.
    Column("occurrence", Integer, nullable=False),
    Column("n", Integer, nullable=False),
    Column("task_name", String(255), nullable=False),
    # JSON: {"args": [...], "kwargs": {...}, "options": {...}} (kombu's JSON).
    Column("payload", Text, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    # When the broker confirmed it, or an operator dropped it: the outbox no longer owes it.
    Column("published_at", Float),
    # Publishes that failed for a fault of the child's own (not the broker's), and the last
    # one's error (0009_outbox_errors): the sweep lists the fewest first, so a bad child waits
    # behind the good ones, never in front of them.
    Column("publish_errors", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    # An operator dropped it (``drop_child``): who and why.
    Column("dropped_reason", Text),
)
Index("ix_ledger_outbox_parent", outbox.c.parent_key, outbox.c.occurrence, outbox.c.n)
# What the sweep publishes: only the children not yet confirmed, normally none.
Index(
    "ix_ledger_outbox_unpublished",
    outbox.c.publish_errors,
    outbox.c.created_at,
    postgresql_where=outbox.c.published_at.is_(None),
    sqlite_where=outbox.c.published_at.is_(None),
)

# Durable signals (0010_signals; design.md § "Durable signals"): a payload sent to an entry by
# ``celery_ledger.signal``, kept until a ``wait_for`` of its name takes it. ``wait`` is the
# occurrence of that wait among the body's waits for the name (1, 2, ...): set when a wait
# takes the signal, and unique per (key, name), so no two waits take one signal and no wait
# takes two. A wait that times out writes a row of its own (``timed_out``, no payload), so that
# its replay times out again whatever arrives later.
signals = Table(
    "ledger_signals",
    metadata,
    # Integer on SQLite so the column is the rowid alias and autoincrements.
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("key", KEY, nullable=False),
    Column("name", String(255), nullable=False),
    # JSON text, sealed (``fernet:...``) when ``ledger_snapshot_keys`` is set; None on a
    # timed-out wait's row.
    Column("payload", Text),
    Column("sent_by", String(255)),
    Column("sent_at", Float, nullable=False),
    Column("wait", Integer),
    Column("taken_at", Float),
    Column("timed_out", Integer, nullable=False, server_default=text("0")),
)
Index("uq_ledger_signals_wait", signals.c.key, signals.c.name, signals.c.wait, unique=True)
# What a wait takes: the signals of a key and name no wait took yet, oldest first.
Index(
    "ix_ledger_signals_pending",
    signals.c.key,
    signals.c.name,
    signals.c.id,
    postgresql_where=signals.c.wait.is_(None),
    sqlite_where=signals.c.wait.is_(None),
)

# Concurrency keys (0011_concurrency; docs/concurrency.md): one row per key, the row every
# claim, settle and handover of that key locks first, so that counting its holders and taking
# a slot are one decision; ``slot_limit`` is the limit the last claim asked for.
concurrency_keys = Table(
    "ledger_concurrency_keys",
    metadata,
    Column("concurrency_key", String(255), primary_key=True),
    Column("slot_limit", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# Fleet-wide rate limits (0012_rate_limits; design.md § "Fleet-wide rate limits"): one token
# bucket per limited task (or per task and argument value, ``"5/m per customer_id"``), kept as
# a theoretical arrival time (GCRA): ``tat`` is when the next token is due, ``queue_end`` when
# the slot after the last held delivery is. ``admitted`` names the last claim that took a
# token (how a claim reads, in the same statement, whether it was the one).
rate_buckets = Table(
    "ledger_rate_buckets",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("tat", Float, nullable=False),
    Column("queue_end", Float, nullable=False),
    Column("admitted", String(255)),
)

# The entries held for a token (a ``scheduled`` entry with a row here): which bucket, since
# when (the first hold; a re-hold keeps it), until when, and how often it was held.
rate_holds = Table(
    "ledger_rate_holds",
    metadata,
    Column("key", KEY, primary_key=True),
    Column("bucket", String(255), nullable=False),
    Column("rate", String(64), nullable=False),
    Column("held_since", Float, nullable=False),
    Column("due_at", Float, nullable=False),
    Column("holds", Integer, nullable=False, server_default=text("1")),
)
Index("ix_ledger_rate_holds_bucket", rate_holds.c.bucket, rate_holds.c.held_since)

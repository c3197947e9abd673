"""The hot path's statements, built once per dialect with bind parameters.

Constructing a SQLAlchemy statement costs more than executing it on a warm connection (about
half a millisecond for the claim's CTE). Claim, step writes, lease renewal and settle run once
or more per task, so they are built here once and executed with parameters; SQLAlchemy's
compiled cache then hits every time, and psycopg prepares them server-side after a few uses.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    String,
    Text,
    bindparam,
    case,
    func,
    insert,
    literal,
    select,
    update,
)

from celery_ledger.ledger.admission import offered_deadline, open_predicates
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.dialect import Dialect
from celery_ledger.ledger.identity import DECLARED_PREFIX
from celery_ledger.ledger.schema import entries, events, steps
from celery_ledger.ledger.states import EntryStatus, StepStatus

_EVENT_COLS = ["key", "task_id", "fence", "event", "status", "actor", "detail", "at"]
RETURNED = (entries.c.key, entries.c.task_id, entries.c.fence, entries.c.status)
_RUNNING = EntryStatus.RUNNING.value


def B(name: str, type_: Any = None) -> Any:  # noqa: N802 - reads like SQL
    return bindparam(name, type_=type_)


def with_event(dialect: Dialect, dml: Any) -> Any:
    """``dml`` (an entries INSERT/UPDATE returning ``RETURNED``) plus its audit event.

    With ``dialect.event_in_statement`` (PostgreSQL): one statement, a data-modifying CTE, so
    one round trip, atomic even in autocommit; the event takes the bind parameters
    ``ev_event``, ``ev_actor``, ``ev_detail``. Otherwise (SQLite): ``dml`` alone; the store's
    event writer (``StoreCore._write_with_event``) inserts the events with ``event_insert()``
    in the same transaction.
    """
    if not dialect.event_in_statement:
        return dml
    written = dml.cte("written")
    logged = (
        insert(events)
        .from_select(
            _EVENT_COLS,
            select(
                written.c.key,
                written.c.task_id,
                written.c.fence,
                B("ev_event", String),
                written.c.status,
                B("ev_actor", String),
                B("ev_detail", Text),
                db_now(),
            ),
        )
        .cte("logged")
    )
    return select(written).add_cte(logged)


@cache
def event_insert() -> Any:
    """One audit event; ``at`` on the database clock."""
    return insert(events).values(
        key=B("key", String),
        task_id=B("task_id", String),
        fence=B("fence", Integer),
        event=B("event", String),
        status=B("status", String),
        actor=B("actor", String),
        detail=B("detail", Text),
        at=db_now(),
    )


@cache
def claim_insert(dialect: Dialect) -> Any:
    """Insert a new entry as running with fence 1, or nothing if the key exists.

    ``executions`` is 1 for a claim (the body is about to run) and 0 for a publish intent
    (``HotPath.record_intent``: nothing has run yet).
    """
    now = db_now()
    lease = B("lease", Float)
    # A claim is its attempt's first sign of life (``renewed_at``, design.md § "One envelope, one
    # admission gate"); a publish intent
    # (no execution) is nobody's.
    claimed = B("executions", Integer) > 0
    ins = (
        dialect.insert(entries)
        .values(
            key=B("key"),
            task_name=B("task_name"),
            task_id=B("task_id"),
            status=_RUNNING,
            fence=1,
            side_effect=B("side_effect"),
            args_hash=B("args_hash"),
            snapshot=B("snapshot", Text),
            owner=B("owner"),
            owner_boot=B("owner_boot"),
            owner_pid=B("owner_pid", Integer),
            lease_until=now + lease,
            executions=B("executions", Integer),
            group_id=B("group_id", String),
            parent_id=B("parent_id", String),
            renewed_at=case((claimed, now), else_=None),
            lease_seconds=case((claimed, lease), else_=None),
            interruptions=0,
            created_at=now,
            updated_at=now,
            # The admission gate's deadline: a relative one counts from this row's creation,
            # on the database clock (``admission.offered_deadline``).
            deadline_at=offered_deadline(now, B("dl_at"), B("dl_after")),
        )
        .on_conflict_do_nothing(index_elements=[entries.c.key])
        # The deadline and the clock, compared by the caller: SQLite 3.40 compares a REAL
        # column with an expression inside RETURNING wrongly for some values (1e10 read as
        # less than 1.7e9), so no comparison is made there.
        .returning(*RETURNED, entries.c.deadline_at, now.label("now"))
    )
    return with_event(dialect, ins)


@cache
def claim_takeover(dialect: Dialect) -> Any:
    """Hand an existing entry to the claiming attempt: running, its fence, task id, arguments
    hash, owner and lease, one more execution (the claim's slow path, under the row lock its
    read took). The claim is the new attempt's first sign of life (``renewed_at``)."""
    now = db_now()
    lease = B("lease", Float)
    upd = (
        update(entries)
        .where(entries.c.key == B("k"))
        .values(
            status=_RUNNING,
            fence=B("new_fence", Integer),
            task_id=B("new_task_id", String),
            args_hash=B("new_args_hash", String),
            snapshot=B("new_snapshot", Text),
            owner=B("new_owner", String),
            owner_boot=B("new_owner_boot", String),
            owner_pid=B("new_owner_pid", Integer),
            lease_until=now + lease,
            renewed_at=now,
            lease_seconds=lease,
            executions=entries.c.executions + 1,
            interruptions=B("new_interruptions", Integer),
            updated_at=now,
            # A claimed retry waits for no time any more; a claimed wake no longer marks a
            # clean settle that nothing ran since (``claim_gates._run_gate``).
            due_at=None,
            # Tightened under the claim's row lock (``admission.earliest_of``): never later.
            deadline_at=B("new_deadline", Float),
            # A publish intent knows no canvas (the claim does); a re-send keeps it.
            group_id=func.coalesce(B("new_group_id", String), entries.c.group_id),
            parent_id=func.coalesce(B("new_parent_id", String), entries.c.parent_id),
        )
        .returning(*RETURNED)
    )
    return with_event(dialect, upd)


@cache
def settle_update(dialect: Dialect, settled: bool) -> Any:
    """Move a running entry at ``fence`` to ``status`` (a terminal one when ``settled``).

    ``due_at`` becomes db-now + ``due_in``, else ``due_abs``, else NULL: only a ``retrying``
    settle passes either, so every other settle clears it. ``new_snapshot``, when given,
    replaces the argument snapshot (a retry's own arguments), else it is kept.
    (Bind parameters of an UPDATE may not share a column's name, hence ``k``, ``f`` ...)
    """
    now = db_now()
    upd = (
        update(entries)
        .where(entries.c.key == B("k"), entries.c.fence == B("f"), entries.c.status == _RUNNING)
        .values(
            status=B("to_status"),
            result=B("new_result", Text),
            error=B("new_error", Text),
            reason=B("new_reason", Text),
            lease_until=None,
            updated_at=now,
            settled_at=now if settled else None,
            due_at=func.coalesce(now + B("due_in", Float), B("due_abs", Float)),
            snapshot=func.coalesce(B("new_snapshot", Text), entries.c.snapshot),
            # A slot of its concurrency key is held while running only (``ledger.slots``).
            slot_at=None,
            # The attempt ended itself: its renewals say nothing of a paused zombie, unless
            # an earlier attempt of the entry was lost (``interruptions``): that one may be
            # paused mid-call, and the latest sign of life (no older than its own) stands
            # for it until the grace runs out (design.md § "One envelope, one admission gate").
            renewed_at=case((entries.c.interruptions > 0, entries.c.renewed_at), else_=None),
        )
        .returning(*RETURNED)
    )
    return with_event(dialect, upd)


@cache
def renew_update() -> Any:
    """Extend the lease of the attempt at ``fence`` and stamp its sign of life (``renewed_at``,
    with the lease it took), in the same statement: the interrupt clears the lease, never
    these, so ``mark-dead`` still sees a recent renewal after it (design.md § "One envelope, one
    admission gate")."""
    now = db_now()
    lease = B("lease", Float)
    return (
        update(entries)
        .where(entries.c.key == B("k"), entries.c.fence == B("f"), entries.c.status == _RUNNING)
        .values(lease_until=now + lease, renewed_at=now, lease_seconds=lease)
    )


def live_entry(key: Any, fence: Any, *, may_start: bool = False) -> Any:
    """The entry row an attempt still owns, share-locked.

    FOR SHARE makes a concurrent takeover (which updates the row) and this attempt's write
    serialize: either the write lands first and the takeover's replay load sees it, or the
    takeover commits first and the re-checked WHERE finds the fence moved.

    ``may_start`` (an effect step's ``started`` write, a transaction step's commit): also the
    admission gate (``admission.open_predicates``: no cancellation pending, no deadline
    passed on the database clock), so the step boundary's check rides on the write the step
    makes anyway; a refused start is explained by ``worker/timing.py``.
    """
    cond = [entries.c.key == key, entries.c.fence == fence, entries.c.status == _RUNNING]
    if may_start:
        cond += open_predicates(db_now())
    return select(entries.c.key).where(*cond).with_for_update(read=True)


def _second_at_position() -> Any:
    """1 for a new row, 2 when a row of another input already started or completed at the same
    step name and position (``occurrence``): that is the step running a second time.

    Only rows that sit at a position compare: a declared identity (``DECLARED_PREFIX``) has
    none. The probe reads the primary key's (key, name) prefix, so it costs one index range
    over the entry's rows of that step name, inside the same statement.
    """
    other = steps.alias("other")
    ran_there = (
        select(literal(1))
        .where(
            other.c.key == B("key", String),
            other.c.name == B("name", String),
            other.c.occurrence == B("occurrence", Integer),
            other.c.input_hash != B("input_hash", String),
            ~other.c.input_hash.like(DECLARED_PREFIX + "%"),  # the prefix has no wildcard
            other.c.status != StepStatus.NOT_EXECUTED.value,  # started or completed: it may run
        )
        .exists()
    )
    return case((ran_there, 2), else_=1)


@cache
def step_upsert(
    dialect: Dialect, started: bool, *, at_position: bool = False, gated: bool = False
) -> Any:
    """Upsert one replay row, fenced on the entry (see ``HotPath.write_step``).

    ``at_position``: a ``started`` row of a step that sits at a position; a new one counts a
    second execution when another input already ran there (``_second_at_position``).
    ``gated``: a ``completed`` row that is itself the effect (a transaction step's commit)
    asks the admission gate, as every ``started`` row does.
    """
    now = db_now()
    values: dict[str, Any] = {
        "key": B("key", String),
        "name": B("name", String),
        "input_hash": B("input_hash", String),
        "occurrence": B("occurrence", Integer),
        "seq": B("seq", Integer),
        "status": B("status", String),
        "output": B("output", Text),
        "error": B("error", Text),
        "fence": B("fence", Integer),
        "attempts": _second_at_position() if at_position else literal(1),
        "authorized": B("authorized", Integer),
        "started_at": now,
        "completed_at": None if started else now,
    }
    source = live_entry(B("key"), B("fence"), may_start=started or gated).with_only_columns(
        *values.values()
    )
    ins = dialect.insert(steps).from_select(list(values), source)
    ex = ins.excluded
    # An attempt of the step's body is a ``started`` write onto an existing row, from a new
    # fence or after a not_executed verdict (a reconciler's verdict carries the same fence as
    # the re-run it authorizes). A ``completed`` write onto a started row from a new fence is a
    # reconciler's proof, not a run: counting it would report a duplicate that never happened.
    rerun = (steps.c.fence != ex.fence) | (steps.c.status == StepStatus.NOT_EXECUTED.value)
    return ins.on_conflict_do_update(
        index_elements=[steps.c.key, steps.c.name, steps.c.input_hash, steps.c.occurrence],
        set_={
            "status": ex.status,
            "output": ex.output,
            "error": ex.error,
            "fence": ex.fence,
            "attempts": (steps.c.attempts + rerun.cast(Integer) if started else steps.c.attempts),
            "authorized": steps.c.authorized + ex.authorized,
            "started_at": ex.started_at if started else steps.c.started_at,
            "completed_at": ex.completed_at,
        },
        where=steps.c.status != StepStatus.COMPLETED.value,
    ).returning(steps.c.fence)  # rowcount is not reliable for INSERT; RETURNING is


#: The hot path's statements (``FastPath``), by the key each is compiled under: the builder of
#: each for a dialect. Every call site compiles its statement through ``StoreCore._hot`` by key,
#: and ``HotPath.prepare_for_fork`` compiles them all before a worker forks its pool.
HOT: dict[Any, Callable[[Dialect], Any]] = {
    "claim": claim_insert,
    "renew": lambda _dialect: renew_update(),
    "event": lambda _dialect: event_insert(),
    # A transaction step's completed row: its commit is the effect (``ledger.transactions``).
    "step-commit": partial(step_upsert, started=False, gated=True),
    **{("settle", flag): partial(settle_update, settled=flag) for flag in (True, False)},
    **{
        ("step", started, at_position): partial(
            step_upsert, started=started, at_position=at_position
        )
        for started in (True, False)
        for at_position in (True, False)
    },
}

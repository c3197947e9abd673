"""The time-and-cancellation workload of ``verify``: deadlines, held countdowns, cancellations
and retries of ledgered tasks, under the same chaos as the orders.

Sent into the ledgered run beside its orders (the ledgered workers run with a hold threshold of
``HOLD_THRESHOLD`` seconds), in groups of ``per_group(tasks)`` items each:

- ``expire-backlog``: published before any worker is up, with ``expires`` of 1 s: the deadline
  passes in the queue, and no effect of theirs may ever run;
- ``run-backlog``: published beside them with a long ``expires``: they run;
- ``expire-mid``: published behind the orders, three effects apart, with an ``expires`` drawn
  from a few seconds: some expire in the queue, some between two effects, some complete;
- ``held``: a countdown past the hold threshold: the ledger holds them and the sweep wakes them
  under the chaos; every third also expires before it is due;
- ``held-cancel``: held, then cancelled by task id (the path of ``revoke()``) before they are due;
- ``cancel``: four effects apart; cancelled mid-run (``timing.cancel_entry``, the path of the
  CLI's ``cancel``) as soon as their first effect is seen;
- ``retry``: one effect, ``self.retry()`` once (a short countdown, Celery's ETA message, or a
  long one the ledger holds), then a second effect.

Every effect is a step whose ``started`` write is the admission gate; its effect row is written
on the effects database's clock, which is the ledger's database whenever the ledger is a server
(with ``--crash-ledger``, and with SQLite, both are this machine's clock). The count compares
**each effect's gate**, its step's ``started_at`` (the ledger's database clock, written by the
gated statement itself) with the entry's ``cancel_requested_at`` and ``deadline_at`` (the same
clock): an effect that started after either is a fault. Each effect row must also lie after its
gate (an effect with no gate before it ran outside the ledger). An effect that *started* before
a cancellation may land after it: a running attempt finds out at its next effect step.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import DBAPIError

from celery_ledger.ledger import BODY_STEP, EntryStatus, LedgerError, StepStatus, entry_key
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.schema import entries, events, steps
from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled

log = logging.getLogger(__name__)

#: Effects one after another, ``gap`` seconds apart.
TIMED = "celery_ledger.demo.timed"
#: One effect, one ``self.retry(countdown=)``, a second effect.
RETRIED = "celery_ledger.demo.timed_retry"
#: The ledgered run's ``ledger_hold_threshold_seconds``: a countdown past it is held by the
#: ledger and woken by the sweep (the default, 600 s, would outlast any run).
HOLD_THRESHOLD = 2.0
#: A step's ``started_at`` and the gate's ``now`` are two readings of the database clock in one
#: statement (PostgreSQL's ``clock_timestamp()`` is read per call): the first may trail the
#: second by the statement's own microseconds. A fault is seconds late, never this little.
CLOCK_EPSILON = 0.01
#: A cancel victim not seen running this long after its publish is cancelled anyway.
CANCEL_FALLBACK_SECONDS = 30.0
#: The statuses an item may end in: settled, or parked with a reason.
TERMINAL = frozenset(
    {
        EntryStatus.COMPLETED,
        EntryStatus.FAILED,
        EntryStatus.CANCELLED,
        EntryStatus.EXPIRED,
        EntryStatus.BLOCKED,
    }
)
GROUPS = ("expire-backlog", "run-backlog", "expire-mid", "held", "held-cancel", "cancel", "retry")


def per_group(tasks: int) -> int:
    """Items per group: one per 20 orders, at least 3, at most 25: the orders stay the load."""
    return max(3, min(25, tasks // 20))


def record_on_db_clock(db: Any, run: str, item_id: str, effect: str) -> str:
    """Perform one effect: append its row, timed on the effects database's clock."""
    with db.engine.begin() as conn:
        conn.execute(
            insert(db.tables.effects).values(
                run=run, order_id=item_id, effect=effect, pid=os.getpid(), at=db_now()
            )
        )
    return f"{effect}:{item_id}"


def _reconciler(db: Any) -> Callable[[AmbiguousStep], Reconciled]:
    """The orders' argument (``demo_app.make_reconciler``): a row is the effect; no row is
    unknown (a paused attempt may still write it); no step row at all is not executed."""

    def reconcile(step: AmbiguousStep) -> Reconciled:
        if step.step == BODY_STEP:
            return Reconciled.not_executed("every effect is a fenced step, and no step row exists")
        item_id = step.kwargs.get("item_id") or step.args[1]
        if db.count(item_id, step.step) >= 1:
            return Reconciled.completed(f"{step.step}:{item_id}", note="the effect row exists")
        return Reconciled.unknown("no effect row yet; a paused attempt may still write it")

    return reconcile


def register(app: Any, db: Any) -> None:
    """Register the two tasks on ``app`` (``shared=False``, like the orders), keyed by item."""
    from celery_ledger.task import LedgerTask

    def record(run: str, item_id: str, effect: str) -> str:
        # A closure, not a step argument: a step's arguments are its identity (JSON).
        return record_on_db_clock(db, run, item_id, effect)

    @app.task(
        base=LedgerTask,
        bind=True,
        name=TIMED,
        shared=False,
        key_from=("item_id",),
        reconciler=_reconciler(db),
    )
    def timed(self: Any, run: str, item_id: str, effects: int, gap: float) -> list[str]:
        done = []
        for i in range(effects):
            if i:
                time.sleep(gap)
            done.append(self.step(f"e{i}", record, run, item_id, f"e{i}"))
        return done

    @app.task(
        base=LedgerTask,
        bind=True,
        name=RETRIED,
        shared=False,
        key_from=("item_id",),
        reconciler=_reconciler(db),
        max_retries=5,
    )
    def timed_retry(self: Any, run: str, item_id: str, countdown: float) -> list[str]:
        first = self.step("e0", record, run, item_id, "e0")
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return [first, self.step("e1", record, run, item_id, "e1")]


def item_key(task: str, item_id: str) -> str:
    return entry_key(task, {"item_id": item_id})


@dataclass
class Item:
    """One task of the workload, and what verify did to it."""

    item_id: str
    group: str
    task: str
    args: tuple[Any, ...]
    options: dict[str, Any]
    task_id: str = ""
    #: ``time.monotonic()`` of its publish (0: not yet).
    published: float = 0.0
    #: "cancel_entry" or "by task id" once verify asked for its cancellation.
    cancelled_by: str = ""

    @property
    def key(self) -> str:
        return item_key(self.task, self.item_id)


class TimeLoad:
    """The workload's items, their publishes and cancellations, and the count."""

    def __init__(self, run: str, tasks: int, rng: random.Random) -> None:
        self.run = run
        n = per_group(tasks)
        #: The longest ``expires`` of ``expire-mid``: about when the orders ahead are done.
        self.mid_expires = 2.0 + 0.3 * tasks
        self.items: list[Item] = []
        for group in GROUPS:
            for i in range(n):
                self.items.append(self._item(group, i, rng))

    def _item(self, group: str, i: int, rng: random.Random) -> Item:
        item_id = f"{self.run}-{group}-{i:03d}"
        timed = (self.run, item_id)
        if group == "expire-backlog":
            return Item(item_id, group, TIMED, (*timed, 2, 0.1), {"expires": 1.0})
        if group == "run-backlog":
            return Item(item_id, group, TIMED, (*timed, 2, 0.1), {"expires": 600.0})
        if group == "expire-mid":
            return Item(
                item_id,
                group,
                TIMED,
                (*timed, 3, 0.4),
                {"expires": round(rng.uniform(2.0, self.mid_expires), 2)},
            )
        if group in ("held", "held-cancel"):
            countdown = round(HOLD_THRESHOLD + rng.uniform(1.0, 6.0), 2)
            options: dict[str, Any] = {"countdown": countdown}
            if group == "held" and i % 3 == 0:
                options["expires"] = round(countdown - 1.0, 2)  # passes before it is due
            return Item(item_id, group, TIMED, (*timed, 2, 0.2), options)
        if group == "cancel":
            return Item(item_id, group, TIMED, (*timed, 4, 0.6), {})
        if group == "retry":
            countdown = 0.3 if i % 2 == 0 else HOLD_THRESHOLD + 1.0  # Celery's ETA; held
            return Item(item_id, group, RETRIED, (*timed, countdown), {})
        raise ValueError(group)

    def keys(self) -> list[str]:
        return [item.key for item in self.items]

    def group(self, *groups: str) -> list[Item]:
        return [item for item in self.items if item.group in groups]

    # -- publishing and cancelling -------------------------------------------------------------

    def publish(self, app: Any, groups: tuple[str, ...]) -> int:
        """Publish the items of ``groups`` through ``app`` (the run's own: publish intents,
        holds). Returns how many."""
        sent = 0
        for item in self.group(*groups):
            result = app.tasks[item.task].apply_async(item.args, **item.options)
            item.task_id = result.id
            item.published = time.monotonic()
            sent += 1
        return sent

    def tick(self, app: Any, store: Any, snapshot: Any) -> None:
        """Cancel what is due: a ``cancel`` item once its first effect is in ``snapshot`` (or
        ``CANCEL_FALLBACK_SECONDS`` after its publish), a ``held-cancel`` item a second after
        its publish (before it is due). A ledger that cannot be reached now is asked again at
        the next tick."""
        from celery_ledger.timing import cancel_entry, cancel_task_ids

        now = time.monotonic()
        for item in self.items:
            if item.cancelled_by or not item.published:
                continue
            try:
                if item.group == "cancel":
                    seen = snapshot.orders.get(item.item_id)
                    running = seen is not None and seen.has("e0")
                    if running or now - item.published > CANCEL_FALLBACK_SECONDS:
                        cancel_entry(app, store, item.key, by="verify", reason="cancelled mid-run")
                        item.cancelled_by = "cancel_entry"
                elif item.group == "held-cancel" and now - item.published > 1.0:
                    cancel_task_ids(app, [item.task_id], by="verify", reason="held, cancelled")
                    item.cancelled_by = "task id"
            except (DBAPIError, LedgerError) as exc:
                log.debug("cancel of %s deferred: %s", item.key, exc)

    # -- counting ------------------------------------------------------------------------------

    def statuses(self, ledger_engine: Any) -> dict[str, tuple[EntryStatus, int]]:
        """key -> (status, executions) of the items that have an entry."""
        found: dict[str, tuple[EntryStatus, int]] = {}
        with ledger_engine.connect() as conn:
            for key, status, executions in conn.execute(
                select(entries.c.key, entries.c.status, entries.c.executions).where(
                    entries.c.key.in_(self.keys())
                )
            ):
                found[key] = (EntryStatus(status), int(executions))
        return found

    def pending(self, ledger_engine: Any) -> int:
        """Items not yet terminal (the run is not over while one is; no entry counts too)."""
        found = self.statuses(ledger_engine)
        return sum(1 for k in self.keys() if k not in found or found[k][0] not in TERMINAL)

    def tally(self, db: Any, ledger_engine: Any) -> TimeReport:
        """Count the workload from the effects table and the ledger (see the module)."""
        keys = self.keys()
        t = db.tables.effects
        effect_rows: dict[tuple[str, str], list[float]] = defaultdict(list)
        with db.engine.connect() as conn:
            for order_id, effect, at in conn.execute(
                select(t.c.order_id, t.c.effect, t.c.at).where(t.c.run == self.run)
            ):
                effect_rows[(order_id, effect)].append(float(at))
        rows: dict[str, Any] = {}
        started: dict[tuple[str, str], Any] = {}
        woken: set[str] = set()
        with ledger_engine.connect() as conn:
            for row in conn.execute(select(entries).where(entries.c.key.in_(keys))):
                rows[row.key] = row
            for row in conn.execute(select(steps).where(steps.c.key.in_(keys))):
                started[(row.key, row.name)] = row
            for (key,) in conn.execute(
                select(events.c.key).where(events.c.key.in_(keys), events.c.event == "woken")
            ):
                woken.add(key)
        r = TimeReport(items=len(self.items), clock="database")
        for item in self.items:
            row = rows.get(item.key)
            status = EntryStatus(row.status) if row is not None else None
            r.by_group.setdefault(item.group, Counter())[status.value if status else "none"] += 1
            mine = {e: ats for (o, e), ats in effect_rows.items() if o == item.item_id}
            r.effects += sum(len(ats) for ats in mine.values())
            r.duplicate_effects += sum(len(ats) - 1 for ats in mine.values())
            if item.cancelled_by:
                r.cancels_requested += 1
            if item.key in woken:
                r.woken += 1
            if row is None:
                r.lost += 1
                r.lost_items.append(item.item_id)
                continue
            for effect, ats in mine.items():
                step = started.get((item.key, effect))
                gate = None if step is None else float(step.started_at)
                if gate is None or min(ats) < gate - CLOCK_EPSILON:
                    r.ungated_effects += 1
                    r.violations.append(
                        f"{item.item_id} {effect}: effect at {min(ats):.3f} "
                        f"with no gate before it (started_at {gate})"
                    )
                    continue
                if row.deadline_at is not None and gate > row.deadline_at + CLOCK_EPSILON:
                    r.effects_after_deadline += 1
                    r.violations.append(
                        f"{item.item_id} {effect}: started {gate:.3f}, "
                        f"{gate - row.deadline_at:.3f}s after its deadline"
                    )
                cancel_at = row.cancel_requested_at
                if cancel_at is not None and gate > cancel_at + CLOCK_EPSILON:
                    r.effects_after_cancel += 1
                    r.violations.append(
                        f"{item.item_id} {effect}: started {gate:.3f}, "
                        f"{gate - cancel_at:.3f}s after its cancellation"
                    )
                if cancel_at is not None and max(ats) > cancel_at:
                    r.landed_after_cancel += 1
            for (key, _name), step in started.items():
                if key == item.key and step.status != StepStatus.NOT_EXECUTED.value:
                    r.ledger_duplicate_executions += max(0, step.attempts - 1 - step.authorized)
            if status is EntryStatus.FAILED:
                r.failed_items.append({"item": item.item_id, "error": (row.error or "")[:300]})
            if status is EntryStatus.BLOCKED:
                r.blocked_items.append({"item": item.item_id, "reason": row.reason or ""})
                if not row.reason:
                    r.violations.append(f"{item.item_id}: blocked with no reason")
            elif status is not None and status not in TERMINAL:
                if int(row.executions) == 0:
                    r.never_claimed += 1  # an intent the broker dropped; the sweep re-sends it
                else:
                    r.lost += 1
                    r.lost_items.append(f"{item.item_id} ({status.value})")
            if status is EntryStatus.EXPIRED:
                if mine:
                    r.expired_midway += 1
                else:
                    r.expired_unrun += 1
            if status is EntryStatus.CANCELLED and mine:
                r.cancelled_midway += 1
            if item.group == "retry" and status is EntryStatus.COMPLETED:
                r.retried += 1  # its second effect runs only after a retry
        r.by_group = {g: dict(c) for g, c in r.by_group.items()}
        r.lost_items = r.lost_items[:20]
        r.violations = r.violations[:20]
        r.failed_items = r.failed_items[:20]
        return r


@dataclass
class TimeReport:
    """What the time-and-cancellation workload measured (the JSON field ``time``)."""

    items: int = 0
    #: Which clock the effects and the gates were compared on.
    clock: str = "database"
    #: group -> status -> items ("none": no entry).
    by_group: dict[str, Any] = field(default_factory=dict)
    effects: int = 0
    #: Effects whose gate (their step's ``started_at``) is past the entry's deadline.
    effects_after_deadline: int = 0
    #: Effects whose gate is past the entry's recorded cancellation.
    effects_after_cancel: int = 0
    #: Effect rows with no gate (started step) before them.
    ungated_effects: int = 0
    duplicate_effects: int = 0
    ledger_duplicate_executions: int = 0
    #: Claimed, and neither settled nor parked; or no entry at all (publish intents are on).
    lost: int = 0
    #: Only a publish intent, not yet terminal: the broker dropped the message before a claim.
    never_claimed: int = 0
    #: Expired with no effect, and expired after some effects (between two of them).
    expired_unrun: int = 0
    expired_midway: int = 0
    #: Cancelled after some effects (mid-run).
    cancelled_midway: int = 0
    #: Cancelled effects that started before the cancellation and landed after it (allowed).
    landed_after_cancel: int = 0
    cancels_requested: int = 0
    #: Items the sweep woke from a hold (a held countdown or a held retry).
    woken: int = 0
    retried: int = 0
    lost_items: list[str] = field(default_factory=list)
    blocked_items: list[dict[str, str]] = field(default_factory=list)
    failed_items: list[dict[str, str]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.effects_after_deadline
            or self.effects_after_cancel
            or self.ungated_effects
            or self.duplicate_effects
            or self.ledger_duplicate_executions
            or self.lost
            or self.violations
        )

    def line(self) -> str:
        done = self.by_group
        total = Counter[str]()
        for statuses in done.values():
            total.update(statuses)
        ends = ", ".join(f"{n} {s}" for s, n in sorted(total.items()))
        return (
            f"time & cancellation: {self.items} tasks ({ends}); {self.woken} woken from a hold, "
            f"{self.retried} retried, {self.cancels_requested} cancels ({self.cancelled_midway} "
            f"mid-run), {self.expired_midway} expired mid-run; effects started after "
            f"a deadline {self.effects_after_deadline}, after a cancellation "
            f"{self.effects_after_cancel}; {self.lost} lost, {self.duplicate_effects} duplicated"
        )

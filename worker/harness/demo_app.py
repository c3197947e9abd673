"""The workload ``celery-ledger demo`` and ``celery-ledger verify`` run, and how to count it.

An *order* is four steps: ``quote`` (a read), then three effects: ``reserve`` stock, ``charge``
the card, send the ``receipt``. Each effect appends one row to the namespace's effects table,
which has no unique constraint, so an effect that ran twice is two rows. The same body runs
three ways, so the only difference between the columns of the demo's table is the task class:

- ``plain_order``: a plain Celery task with Celery's default early ack;
- ``plain_order_acks_late``: a plain task with ``acks_late`` and ``reject_on_worker_lost``;
- ``ledgered_order``: a ``LedgerTask`` keyed by ``order_id`` whose steps go through ``self.step``.

``celery -A celery_ledger.harness.demo_app worker`` builds the app on first attribute access
(PEP 562) from the ``CELERY_LEDGER_DEMO_*`` environment variables the demo sets for each process,
never at import. The counting half (``effect_counts``, ``ledger_outcomes``, ``drop_namespace``) is
used by the commands, which import this module without building an app.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    delete,
    func,
    insert,
    select,
)
from sqlalchemy.exc import DBAPIError

from celery_ledger.codec import decode
from celery_ledger.harness import canvas_load, time_load
from celery_ledger.ledger import BODY_STEP, EntryStatus, StepStatus, child_task_id, entry_key
from celery_ledger.ledger.engine import READ_ONLY, make_engine
from celery_ledger.ledger.schema import entries, events, outbox, steps
from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciled

log = logging.getLogger(__name__)

# -- what the commands set for each process ------------------------------------------------

#: Queue the worker consumes and the app sends to (one per run, so runs never mix).
ENV_QUEUE = "CELERY_LEDGER_DEMO_QUEUE"
#: SQLAlchemy URL of the database holding the effects tables.
ENV_EFFECTS_URL = "CELERY_LEDGER_DEMO_EFFECTS_URL"
#: Namespace: names the effects tables and prefixes the Redis keys, so cleanup is exact.
ENV_NAMESPACE = "CELERY_LEDGER_DEMO_NAMESPACE"
#: Redis only: a visibility timeout (seconds) that makes the broker redeliver live tasks.
ENV_VISIBILITY = "CELERY_LEDGER_DEMO_VISIBILITY_TIMEOUT"
#: ``worker_prefetch_multiplier`` (default 1): Celery's own default, 4, keeps messages waiting
#: in a worker, where a SIGKILL strands them.
ENV_PREFETCH = "CELERY_LEDGER_DEMO_PREFETCH"

PLAIN = "celery_ledger.demo.plain_order"
PLAIN_ACKS_LATE = "celery_ledger.demo.plain_order_acks_late"
LEDGERED = "celery_ledger.demo.ledgered_order"
#: The child a ledgered order sends through the outbox (design.md § "Transaction steps and the
#: transactional outbox"): one ``notify`` effect.
LEDGERED_NOTIFY = "celery_ledger.demo.ledgered_notify"

#: The effect steps of an order, in order.
EFFECTS = ("reserve", "charge", "receipt")
#: The effect of the child a ledgered order sends.
CHILD_EFFECT = "notify"
#: Every n-th ledgered order sends a child: enough to prove the outbox under the chaos, few
#: enough that the ledgered run's length (its exposure to the chaos) stays about the same.
CHILD_EVERY = 5


def sends_child(order_id: str) -> bool:
    """Whether the ledgered order ``order_id`` (``<run>-<n>``) sends a child."""
    number = order_id.rsplit("-", 1)[-1]
    return number.isdigit() and int(number) % CHILD_EVERY == 0


@contextmanager
def reading(engine: Engine) -> Iterator[Connection]:
    """A read-only connection: a deferred transaction on SQLite, which never blocks writers."""
    with engine.connect() as conn:
        yield conn.execution_options(**{READ_ONLY: True})


# -- the effects tables ---------------------------------------------------------------------


@dataclass(frozen=True)
class EffectTables:
    """The namespace's two tables: effects, and what the reconciler answered."""

    metadata: MetaData
    effects: Table
    answers: Table


def effect_tables(namespace: str) -> EffectTables:
    """Tables named after ``namespace`` (which must be short and alphanumeric)."""
    if not namespace.replace("_", "").isalnum() or len(namespace) > 40:
        raise ValueError(f"namespace {namespace!r} must be alphanumeric, at most 40 chars")
    md = MetaData()
    effects = Table(
        f"celery_ledger_demo_{namespace}_effects",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("run", String(64), nullable=False),
        Column("order_id", String(128), nullable=False),
        Column("effect", String(32), nullable=False),
        Column("pid", Integer, nullable=False),
        Column("at", Float, nullable=False),
    )
    answers = Table(
        f"celery_ledger_demo_{namespace}_answers",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("order_id", String(128), nullable=False),
        Column("step", String(64), nullable=False),
        Column("verdict", String(16), nullable=False),
        Column("at", Float, nullable=False),
    )
    return EffectTables(md, effects, answers)


class EffectsDb:
    """The effects database of one namespace, with an engine per process (fork safety)."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.namespace = namespace
        self.tables = effect_tables(namespace)
        self._engine: Engine | None = None
        self._pid = -1

    @property
    def engine(self) -> Engine:
        # A pool process inherits the parent's engine object across fork; a pooled
        # connection shared by two processes corrupts both, so each process makes its own.
        if self._engine is None or self._pid != os.getpid():
            self._engine = make_engine(self.url)
            self._pid = os.getpid()
        return self._engine

    def create(self) -> None:
        """Create the tables (the command does, before it starts any worker)."""
        try:
            self.tables.metadata.create_all(self.engine)
        except DBAPIError:
            # Two processes created it at the same moment (PostgreSQL's catalog race).
            self.tables.metadata.create_all(self.engine)

    def drop(self) -> None:
        self.tables.metadata.drop_all(self.engine)

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def record(self, run: str, order_id: str, effect: str) -> str:
        """Perform one effect: append its row. Returns what the step returns."""
        with self.engine.begin() as conn:
            conn.execute(
                insert(self.tables.effects).values(
                    run=run, order_id=order_id, effect=effect, pid=os.getpid(), at=time.time()
                )
            )
        return f"{effect}:{order_id}"

    def record_on(self, conn: Connection, run: str, order_id: str, effect: str) -> str:
        """Perform one effect on ``conn``, in its transaction (a transaction step's block)."""
        conn.execute(
            insert(self.tables.effects).values(
                run=run, order_id=order_id, effect=effect, pid=os.getpid(), at=time.time()
            )
        )
        return f"{effect}:{order_id}"

    def count(self, order_id: str, effect: str) -> int:
        t = self.tables.effects
        with reading(self.engine) as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(t)
                    .where(t.c.order_id == order_id, t.c.effect == effect)
                ).scalar_one()
            )

    def note_answer(self, order_id: str, step: str, verdict: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                insert(self.tables.answers).values(
                    order_id=order_id, step=step, verdict=verdict, at=time.time()
                )
            )


# -- the order, three ways ------------------------------------------------------------------

StepRunner = Callable[..., Any]


def quote(order_id: str, amount: int) -> dict[str, Any]:
    """A read: look up the price (pure, so it may run any number of times)."""
    return {"order_id": order_id, "amount": amount, "currency": "EUR"}


def run_order(
    step: StepRunner,
    db: EffectsDb,
    run: str,
    order_id: str,
    amount: int,
    gap: float,
    transaction: StepRunner | None = None,
) -> dict[str, Any]:
    """The order's body, shared by the plain and the ledgered task.

    ``gap`` is work between the effects (talking to the warehouse, the bank): it is where a
    crash usually lands, and why a crash leaves orders half done. ``transaction`` (a ledgered
    order whose effects table is in the ledger's database): the receipt is a transaction
    step, its row committed with the step's own.
    """
    price = step("quote", quote, order_id, amount, effect=False)
    reserved = step("reserve", db.record, run, order_id, "reserve")
    time.sleep(gap)
    charged = step("charge", db.record, run, order_id, "charge")
    time.sleep(gap)
    if transaction is not None:
        receipt = transaction("receipt", db.record_on, run, order_id, "receipt")
    else:
        receipt = step("receipt", db.record, run, order_id, "receipt")
    return {"order_id": order_id, "amount": price["amount"], "steps": [reserved, charged, receipt]}


def _plain_step(name: str, fn: Callable[..., Any], *args: Any, effect: bool | None = None) -> Any:
    return fn(*args)


def make_reconciler(db: EffectsDb) -> Callable[[AmbiguousStep], Reconciled]:
    """The reconciler of ``ledgered_order``: ask the "provider" (the effects table).

    Safety argument, per answer:

    - an effect step whose row exists **completed**: the effect happened exactly once, and a
      paused attempt that wakes up can no longer record or repeat it (its next write is
      fenced);
    - an effect step whose row is absent is **unknown**, never "not executed": a paused
      (SIGSTOP) attempt may have written ``started`` and still be about to insert the row;
      re-running would then charge twice. The entry is parked ``blocked`` for an operator;
    - ``__body__`` (killed after the claim, before the first step row) is **not executed**:
      every effect of this task runs inside a step whose ``started`` row is written fenced
      *before* the effect, and the takeover found no step row at all, so no effect began
      under an older fence and none can begin now.
    """

    def reconcile(step: AmbiguousStep) -> Reconciled:
        order_id = step.kwargs.get("order_id") or step.args[1]
        if step.step == BODY_STEP:
            db.note_answer(order_id, step.step, "not_executed")
            return Reconciled.not_executed(
                "every effect of an order is a fenced step, and no step row exists"
            )
        if step.step in (*EFFECTS, CHILD_EFFECT) and db.count(order_id, step.step) >= 1:
            db.note_answer(order_id, step.step, "completed")
            return Reconciled.completed(
                f"{step.step}:{order_id}", note="the effect row is at the provider"
            )
        db.note_answer(order_id, step.step, "unknown")
        return Reconciled.unknown("no effect row yet; a paused attempt may still write it")

    return reconcile


# -- the app --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo process reads from its environment, once, at app creation."""

    data_dir: Path
    queue: str
    namespace: str
    effects_url: str
    broker_url: str | None = None
    ledger_url: str | None = None
    result_backend: str | None = None
    visibility_timeout: float | None = None
    prefetch: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DemoConfig:
        """Raises: KeyError naming the variable the demo should have set."""
        vis = env.get(ENV_VISIBILITY)
        return cls(
            data_dir=Path(env["CELERY_LEDGER_DATA_DIR"]),
            queue=env[ENV_QUEUE],
            namespace=env[ENV_NAMESPACE],
            effects_url=env[ENV_EFFECTS_URL],
            broker_url=env.get("CELERY_BROKER_URL"),
            ledger_url=env.get("CELERY_LEDGER_URL"),
            result_backend=env.get("CELERY_RESULT_BACKEND"),
            visibility_timeout=float(vis) if vis else None,
            prefetch=int(env[ENV_PREFETCH]) if env.get(ENV_PREFETCH) else None,
        )


def redis_keyprefix(namespace: str, queue: str = "") -> str:
    """Every Redis key of a namespace starts with this (kombu's ``global_keyprefix``).

    One prefix per queue: kombu keeps unacked messages in one hash per prefix, and a worker
    with a short visibility timeout restores every message in it, whoever holds it; a run
    must only ever redeliver its own.
    """
    return f"celery-ledger-demo-{namespace}:" + (f"{queue}:" if queue else "")


def build_app(env: Mapping[str, str] | None = None) -> Celery:
    """The demo's app: the embedded default, or the broker and ledger the environment names."""
    from celery_ledger.app import create_app  # here: building the app is what needs Celery wiring

    cfg = DemoConfig.from_env(os.environ if env is None else env)
    app = create_app(
        "celery_ledger_demo",
        data_dir=cfg.data_dir,
        broker_url=cfg.broker_url,
        result_backend=cfg.result_backend,
        ledger_url=cfg.ledger_url,
    )
    # The process that publishes a run's orders (the demo's and verify's own) builds its app
    # from the run's environment, not its own: its publish intents must take the run's
    # settings, as its workers and beat do (they read their environment themselves).
    app.conf.update(ledger_conf_from_env(env if env is not None else os.environ))
    app.conf.update(
        task_default_queue=cfg.queue,
        # The commands count effects and ledger rows; Celery results would only be clutter.
        task_ignore_result=True,
        # No pidbox queues: nothing here is remote-controlled, and on Redis they would be
        # keys outside the namespace prefix.
        worker_enable_remote_control=False,
        # How long the pool's parent waits for a dead pool process's result before it
        # declares WorkerLostError (Celery's default: 10 s). Only then does acks_late requeue,
        # early ack record the failure, and the ledger's worker-lost fast path run; 1 s keeps
        # those within the run. It changes when, not what, for all three tasks alike.
        worker_lost_wait=1.0,
    )
    if cfg.prefetch:
        app.conf.worker_prefetch_multiplier = cfg.prefetch
    options = dict(app.conf.broker_transport_options or {})
    broker = cfg.broker_url or "filesystem://"
    if broker.startswith("filesystem"):
        options["polling_interval"] = 0.1  # kombu's default (1 s) would dominate a demo
    if broker.startswith("redis"):
        options["global_keyprefix"] = redis_keyprefix(cfg.namespace, cfg.queue)
        if cfg.visibility_timeout:
            options["visibility_timeout"] = cfg.visibility_timeout
            # kombu scans for expired unacked messages every interval * throttle seconds
            # (100 s by default); once a second makes the redelivery happen within a run.
            options["unacked_restore_interval"] = 1
            options["unacked_restore_throttle"] = 1
    app.conf.broker_transport_options = options
    # Transaction steps need the effects table in the ledger's own database (verify and demo
    # with --ledger: one database; the embedded default keeps two SQLite files).
    shared = cfg.ledger_url is not None and cfg.effects_url == cfg.ledger_url
    register(app, EffectsDb(cfg.effects_url, cfg.namespace), transactions=shared)
    return app


def ledger_conf_from_env(env: Mapping[str, str]) -> dict[str, str]:
    """The ``ledger_*`` Celery settings that ``CELERY_LEDGER_*`` variables in ``env`` name
    (the ledger's URL and data directory excepted: ``create_app`` takes those)."""
    from celery_ledger.settings import LedgerSettings

    names = {f.name for f in fields(LedgerSettings)} - {"url"}
    return {
        f"ledger_{name}": env[f"CELERY_LEDGER_{name.upper()}"]
        for name in sorted(names)
        if f"CELERY_LEDGER_{name.upper()}" in env
    }


def register(app: Celery, db: EffectsDb, *, transactions: bool = False) -> None:
    """Register the three order tasks (and the ledgered order's child) on ``app``, and on
    ``app`` only (``shared=False``): the demo's commands build one app per run in one
    process, each with its own effects table.

    The ledgered order ends by sending its child (``notify``) through the outbox from a step
    of its own; with ``transactions`` its receipt, and the child's effect, are transaction
    steps."""
    from celery_ledger.task import LedgerTask

    @app.task(name=PLAIN, shared=False)
    def plain_order(run: str, order_id: str, amount: int, gap: float) -> dict[str, Any]:
        return run_order(_plain_step, db, run, order_id, amount, gap)

    @app.task(name=PLAIN_ACKS_LATE, acks_late=True, reject_on_worker_lost=True, shared=False)
    def plain_order_acks_late(run: str, order_id: str, amount: int, gap: float) -> dict[str, Any]:
        return run_order(_plain_step, db, run, order_id, amount, gap)

    @app.task(
        base=LedgerTask,
        bind=True,
        name=LEDGERED,
        shared=False,
        key_from=("order_id",),
        reconciler=make_reconciler(db),
    )
    def ledgered_order(
        self: Any, run: str, order_id: str, amount: int, gap: float
    ) -> dict[str, Any]:
        txn = self.transaction_step if transactions else None
        result = run_order(self.step, db, run, order_id, amount, gap, transaction=txn)
        # Its own step, not the receipt's: a reconciler's "completed" verdict on an ambiguous
        # effect step records no children, and this step is never ambiguous (effect=False).
        if sends_child(order_id):
            result["child"] = self.step(
                "send-notify", lambda: self.send(ledgered_notify.s(run, order_id)), effect=False
            )
        result["replayed"] = self.ledger_attempt.replayed
        return result

    @app.task(
        base=LedgerTask,
        bind=True,
        name=LEDGERED_NOTIFY,
        shared=False,
        reconciler=make_reconciler(db),
    )
    def ledgered_notify(self: Any, run: str, order_id: str) -> str:
        if transactions:
            return str(
                self.transaction_step(CHILD_EFFECT, db.record_on, run, order_id, CHILD_EFFECT)
            )
        return str(self.step(CHILD_EFFECT, db.record, run, order_id, CHILD_EFFECT))

    canvas_load.register(app, db)
    time_load.register(app, db)


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    global _app
    if name in ("app", "celery"):
        if _app is None:
            _app = build_app()
        return _app
    raise AttributeError(name)


# -- counting -------------------------------------------------------------------------------


@dataclass
class OrderEffects:
    """What happened to one order in the outside world."""

    counts: dict[str, int] = field(default_factory=dict)
    #: pid of the process that performed each effect last.
    pids: dict[str, int] = field(default_factory=dict)
    #: When each effect was performed last (``time.time()`` of the process that did it).
    at: dict[str, float] = field(default_factory=dict)

    def has(self, effect: str) -> bool:
        return self.counts.get(effect, 0) > 0


@dataclass
class EffectsSnapshot:
    """Every order of one run, as the effects table sees it."""

    orders: dict[str, OrderEffects]
    rows: int
    last_at: float | None

    def with_effect(self, effect: str) -> set[str]:
        return {o for o, e in self.orders.items() if e.has(effect)}

    def duplicate_effects(self) -> int:
        return sum(max(0, n - 1) for e in self.orders.values() for n in e.counts.values())

    def charged_twice(self) -> int:
        return sum(1 for e in self.orders.values() if e.counts.get("charge", 0) > 1)


def effect_counts(db: EffectsDb, run: str) -> EffectsSnapshot:
    """One grouped query over the effects of ``run``."""
    t = db.tables.effects
    q = (
        select(t.c.order_id, t.c.effect, func.count(), func.max(t.c.pid), func.max(t.c.at))
        .where(t.c.run == run)
        .group_by(t.c.order_id, t.c.effect)
    )
    orders: dict[str, OrderEffects] = {}
    rows, last = 0, None
    with reading(db.engine) as conn:
        if not conn.dialect.has_table(conn, t.name):
            return EffectsSnapshot({}, 0, None)
        for order_id, effect, n, pid, at in conn.execute(q):
            o = orders.setdefault(order_id, OrderEffects())
            o.counts[effect] = int(n)
            o.pids[effect] = int(pid)
            o.at[effect] = float(at)
            rows += int(n)
            last = at if last is None else max(last, at)
    return EffectsSnapshot(orders, rows, last)


def reconciler_answers(db: EffectsDb) -> dict[str, int]:
    """verdict -> how many times the reconciler gave it."""
    t = db.tables.answers
    with reading(db.engine) as conn:
        if not conn.dialect.has_table(conn, t.name):
            return {}
        return {
            v: int(n)
            for v, n in conn.execute(select(t.c.verdict, func.count()).group_by(t.c.verdict))
        }


def ledger_key(order_id: str) -> str:
    """The entry key ``ledgered_order`` claims for ``order_id`` (``key_from=("order_id",)``)."""
    return entry_key(LEDGERED, {"order_id": order_id})


def child_key(order_id: str) -> str:
    """The entry key of the ``notify`` child the ledgered order of ``order_id`` sends: keyed
    by its task id, which the outbox derives from the parent's key and the sending step."""
    return entry_key(LEDGERED_NOTIFY, child_task_id(ledger_key(order_id), "send-notify", 0, 0))


def child_statuses(ledger_engine: Engine, order_ids: Iterable[str]) -> dict[str, EntryStatus]:
    """order id -> the status of its child's entry, for the orders that send a child
    (``sends_child``) and whose child has an entry."""
    by_key = {child_key(o): o for o in order_ids if sends_child(o)}
    keys = list(by_key)
    found: dict[str, EntryStatus] = {}
    with reading(ledger_engine) as conn:
        for i in range(0, len(keys), 500):
            for key, status in conn.execute(
                select(entries.c.key, entries.c.status).where(entries.c.key.in_(keys[i : i + 500]))
            ):
                found[by_key[key]] = EntryStatus(status)
    return found


@dataclass(frozen=True)
class LedgerOutcome:
    """One ledgered order's entry, as the ledger sees it."""

    order_id: str
    key: str
    status: EntryStatus
    executions: int
    replayed: int
    reason: str | None
    error: str | None
    #: Steps left ``started`` (the ambiguous ones), for blocked entries.
    ambiguous_steps: tuple[str, ...]
    #: Step-body runs beyond the first that no not-executed verdict authorized (the ledger's
    #: own duplicate count: sum of max(0, attempts - 1 - authorized) over its effect steps).
    unauthorized_reruns: int


def ledger_outcomes(ledger_engine: Engine, order_ids: Iterable[str]) -> dict[str, LedgerOutcome]:
    """The entry of each order that has one (an order without one was never claimed)."""
    by_key = {ledger_key(o): o for o in order_ids}
    keys = list(by_key)
    found: dict[str, LedgerOutcome] = {}
    with reading(ledger_engine) as conn:
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            started: dict[str, list[str]] = {}
            reruns: dict[str, int] = {}
            for key, name, status, attempts, authorized in conn.execute(
                select(
                    steps.c.key, steps.c.name, steps.c.status, steps.c.attempts, steps.c.authorized
                ).where(steps.c.key.in_(chunk))
            ):
                if status == StepStatus.STARTED.value:
                    started.setdefault(key, []).append(name)
                if status != StepStatus.NOT_EXECUTED.value:
                    reruns[key] = reruns.get(key, 0) + max(0, attempts - 1 - authorized)
            for row in conn.execute(
                select(
                    entries.c.key,
                    entries.c.status,
                    entries.c.executions,
                    entries.c.result,
                    entries.c.reason,
                    entries.c.error,
                ).where(entries.c.key.in_(chunk))
            ):
                result = decode(row.result) if row.result else None
                replayed = result.get("replayed", 0) if isinstance(result, dict) else 0
                found[by_key[row.key]] = LedgerOutcome(
                    by_key[row.key],
                    row.key,
                    EntryStatus(row.status),
                    int(row.executions),
                    int(replayed),
                    row.reason,
                    _error_line(row.error),
                    tuple(started.get(row.key, ())),
                    reruns.get(row.key, 0),
                )
    return found


def _error_line(error: str | None) -> str | None:
    if not error:
        return None
    try:
        data = decode(error)
        text = f"{data['exc_type']}: {' '.join(map(str, data['exc_message']))}"
    except (ValueError, KeyError, TypeError):
        text = error
    return " ".join(text.split())[:300]


# -- one run's report -------------------------------------------------------------------------


@dataclass
class RunReport:
    """What one run measured (the JSON fields of ``runs.<id>``)."""

    task: str
    title: str
    ledgered: bool
    accepted: int = 0
    completed: int = 0
    #: Never completed and not parked (failed and blocked are reported apart). For a ledgered
    #: run: claimed by the ledger and never settled nor parked (the ledger's promise).
    lost: int = 0
    #: Ledgered runs: sent, but never claimed by a worker: the broker dropped the message
    #: before any claim (``filesystem://`` forgets what a killed worker fetched). The ledger
    #: has no entry for it, or only its publish intent (``never_claimed_with_intent``).
    never_claimed: int = 0
    #: Of ``never_claimed``, those recorded by their publish intent: the sweep re-sends them
    #: once ``ledger_publish_intent_seconds`` pass, which a short run ends before.
    never_claimed_with_intent: int = 0
    #: Messages still in the run's queue when it stopped (not yet consumed by anyone).
    queued_at_end: int = 0
    failed: int = 0
    blocked: int = 0
    charged_twice: int = 0
    #: Effect rows beyond the first, per order and effect.
    duplicate_effects: int = 0
    #: duplicate_effects / effects that should have happened once.
    duplicate_rate: float = 0.0
    #: The ledger's own count of unauthorized step re-runs (ledgered runs only).
    ledger_duplicate_executions: int = 0
    #: Ledgered runs: completed orders whose child (sent through the outbox) completed, and
    #: those whose child never ran to an end (neither completed nor parked): lost children.
    children_completed: int = 0
    children_lost: int = 0
    steps_replayed: int = 0
    resumed: int = 0
    #: A few keys of resumed entries (for ``celery-ledger show``).
    resumed_keys: list[str] = field(default_factory=list)
    reconciler: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    crashes: list[str] = field(default_factory=list)
    lost_orders: list[str] = field(default_factory=list)
    never_claimed_orders: list[str] = field(default_factory=list)
    blocked_orders: list[dict[str, Any]] = field(default_factory=list)
    failed_orders: list[dict[str, Any]] = field(default_factory=list)


def tally(
    report: RunReport,
    db: EffectsDb,
    run: str,
    order_ids: list[str],
    ledger_engine: Engine | None,
    enqueued_at: float,
) -> RunReport:
    """Fill ``report`` from the effects table (and the ledger, for a ledgered run)."""
    snap = effect_counts(db, run)
    wanted = set(order_ids)
    completed = snap.with_effect("receipt") & wanted
    r = report
    r.accepted = len(order_ids)
    r.charged_twice = snap.charged_twice()
    r.duplicate_effects = snap.duplicate_effects()
    r.duplicate_rate = round(r.duplicate_effects / (len(order_ids) * len(EFFECTS)), 4)
    r.seconds = round(max(0.0, (snap.last_at or enqueued_at) - enqueued_at), 1)
    if not r.ledgered or ledger_engine is None:
        r.completed = len(completed)
        lost = [o for o in order_ids if o not in completed]
    else:
        outcomes = ledger_outcomes(ledger_engine, order_ids)
        status = {o: outcomes[o].status if o in outcomes else None for o in order_ids}
        r.completed = sum(1 for s in status.values() if s is EntryStatus.COMPLETED)
        blocked = [outcomes[o] for o, s in status.items() if s is EntryStatus.BLOCKED]
        failed = [outcomes[o] for o, s in status.items() if s is EntryStatus.FAILED]
        r.blocked, r.failed = len(blocked), len(failed)
        r.blocked_orders = [
            {
                "order_id": o.order_id,
                "key": o.key,
                "reason": o.reason,
                "ambiguous_steps": list(o.ambiguous_steps),
            }
            for o in blocked
        ]
        r.failed_orders = [
            {"order_id": o.order_id, "key": o.key, "error": o.error} for o in failed[:20]
        ]
        r.steps_replayed = sum(o.replayed for o in outcomes.values())
        resumed = [o for o in outcomes.values() if o.executions > 1]
        r.resumed = len(resumed)
        r.resumed_keys = [o.key for o in resumed[:5]]
        r.ledger_duplicate_executions = sum(o.unauthorized_reruns for o in outcomes.values())
        r.reconciler = reconciler_answers(db)
        settled = (EntryStatus.COMPLETED, EntryStatus.BLOCKED, EntryStatus.FAILED)
        done = [o for o, s in status.items() if s is EntryStatus.COMPLETED and sends_child(o)]
        children = child_statuses(ledger_engine, done)
        r.children_completed = sum(1 for s in children.values() if s is EntryStatus.COMPLETED)
        r.children_lost = sum(1 for o in done if children.get(o) not in settled)
        # An entry no attempt ever executed is a publish intent whose message the broker
        # dropped: never claimed, like an order with no entry at all.
        intent_only = {o for o, out in outcomes.items() if out.executions == 0}
        lost = [
            o
            for o, s in status.items()
            if s is not None and s not in settled and o not in intent_only
        ]
        never = [o for o, s in status.items() if s is None or o in intent_only]
        r.never_claimed = len(never)
        r.never_claimed_with_intent = len(intent_only)
        r.never_claimed_orders = never[:20]
    r.lost = len(lost)
    r.lost_orders = lost[:20]
    return r


def drop_namespace(ledger_engine: Engine | None, order_ids: Iterable[str], db: EffectsDb) -> None:
    """Remove what a run left: its ledger entries (with steps and events), its children's
    entries and outbox rows, and its tables."""
    if ledger_engine is not None:
        ids = list(order_ids)
        keys = [ledger_key(o) for o in ids] + [child_key(o) for o in ids if sends_child(o)]
        with ledger_engine.begin() as conn:
            for i in range(0, len(keys), 500):
                chunk = keys[i : i + 500]
                conn.execute(delete(steps).where(steps.c.key.in_(chunk)))
                conn.execute(delete(events).where(events.c.key.in_(chunk)))
                conn.execute(delete(entries).where(entries.c.key.in_(chunk)))
                conn.execute(delete(outbox).where(outbox.c.parent_key.in_(chunk)))
    db.drop()


def purge_redis(broker_url: str, namespace: str) -> int:
    """Delete every Redis key of ``namespace`` (queues, unacked, bindings). Returns how many."""
    import redis

    client = redis.Redis.from_url(broker_url, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=redis_keyprefix(namespace) + "*", count=500))
        if keys:
            client.delete(*keys)
        return len(keys)
    finally:
        client.close()


def purge_amqp(broker_url: str, queues: Iterable[str]) -> int:
    """Delete ``queues`` and the direct exchange Celery declared for each (named after it).
    Returns how many queues existed."""
    from amqp.exceptions import NotFound
    from kombu import Connection

    deleted = 0
    with Connection(broker_url, connect_timeout=5) as conn:
        for name in queues:
            for delete in ("queue_delete", "exchange_delete"):
                channel = conn.channel()
                try:
                    getattr(channel, delete)(name)
                    deleted += delete == "queue_delete"
                except NotFound:
                    pass  # never declared: its channel is closed, the next one is fresh
                finally:
                    with contextlib.suppress(Exception):
                        channel.close()
    return deleted

"""The Celery app the throughput and memory benchmarks run: ``celery -A bench_app worker``.

One task name, ``bench_app.noop``, built two ways from the environment:

- ``BENCH_MODE=plain``: plain Celery. This module then imports nothing of celery-ledger (not
  even SQLAlchemy), so the memory comparison is against a project that does not use the ledger;
- ``BENCH_MODE=ledger``: the same body on ``LedgerTask`` with a PostgreSQL (or SQLite) ledger;
- ``BENCH_MODE=floor``: plain Celery whose body makes the two writes any durable claim-then-settle
  design needs, and nothing else: one autocommit ``INSERT`` of the task id before the work and
  one ``UPDATE`` of that row after it, on a psycopg connection each pool process keeps (no
  SQLAlchemy, no ledger, no fencing, no events). It is not a ledger; it measures what two
  PostgreSQL commits per task cost on this machine, the least a ledgered task can cost.

``BENCH_FREEZE=1`` gives the plain mode the same ``gc.freeze()`` before each fork that a ledger
app does by default (``ledger_freeze_gc_before_fork``), written out here so that the plain app
still imports nothing of celery-ledger: the memory benchmark reports the ledger against plain
Celery as shipped and against plain Celery with that idiom, to separate what the ledger's modules
cost from what the freeze saves.

The durability variants, from the environment too: ``BENCH_BODY_MS`` (the body sleeps that long,
every mode), ``BENCH_SIDE_EFFECT`` (the ledgered task's class; default ``non_idempotent``, no
steps) and ``BENCH_FLOOR_SETTLE_ASYNC=1`` (the floor's settle ``UPDATE`` commits on a second
connection with ``synchronous_commit = off``: the floor of a task whose claim is its intent and
whose settle need not wait, one synchronous and one asynchronous commit). The floor with every
commit asynchronous is the floor run with ``PGOPTIONS='-c synchronous_commit=off'``; the
ledger's mode is ``CELERY_LEDGER_DURABILITY``. ``BENCH_FLOOR_AUDIT=1`` makes each of the floor's
two writes also append one row to an audit table (``bench_floor_events``: id, task id, event,
time; one index on task id and id), in the same statement: the floor of a design that keeps the
contract's audit trail ("every transition is also appended to an events table").
``BENCH_FLOOR_SQL=ledger`` makes the floor's two writes the ledger's own claim and settle
statements (compiled by ``celery_ledger.ledger`` once, in the parent), with the row the ledger
writes (key, task id, a 64-character arguments hash, the arguments' snapshot, owner, lease) and
their audit events, sent on the same bare psycopg connection: what the ledger's schema costs
with none of its Python around it. The ledger's gap to this floor is its own code; this
floor's gap to the two-write floor is the schema (the wide row, its indexes, the events).
``BENCH_FLOOR_SQL=ledger-no-events`` sends the same two statements without the audit event
each appends: what the schema would cost with the hot path's events out of its statements, a
change the contract does not allow today.

Two floors fewer waits or fewer round trips would reach (2026-12-02): ``BENCH_FLOOR_PIPELINE=1``
sends each settle in pipeline mode and reads its answer with the next claim (the pool process
never waits for a settle); ``BENCH_FLOOR_COMBINED=1`` folds each settle into the same pool
process's next claim, one statement (``WITH s AS (UPDATE ...) INSERT ...``): one round trip and
one commit per task, the least a design that claims each task before its body can send (the
last task's settle is never written; it is a floor, not a ledger).

Both get the same broker, result backend, serializer, ``acks_late``, prefetch and
``result_extended`` settings, so a ratio of the two isolates what the ledger costs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celery import Celery, Task

#: Settings shared by both modes. acks_late and prefetch 1 are what LedgerTask/create_app use;
#: the plain baseline takes them too, or it would be measuring a weaker delivery guarantee.
COMMON_CONF: dict[str, Any] = {
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "worker_prefetch_multiplier": 1,
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "result_extended": True,
    "broker_connection_retry_on_startup": True,
    "worker_hijack_root_logger": False,
}


def make_app(
    mode: str,
    *,
    broker: str,
    queue: str,
    ledger_url: str | None = None,
    backend: str | None = None,
) -> Celery:
    """The benchmark app in ``mode`` (``plain`` or ``ledger``); results in ``backend`` (a
    Redis URL; default: the broker, which must then be Redis)."""
    conf = {**COMMON_CONF, "task_default_queue": queue}
    backend = backend or broker
    base: type[Task]
    if mode == "ledger":
        from celery_ledger import LedgerTask, create_app

        if not ledger_url:
            raise ValueError("BENCH_MODE=ledger needs BENCH_LEDGER_URL")
        app = create_app(
            "bench_app", broker_url=broker, result_backend=backend, ledger_url=ledger_url, **conf
        )
        base = LedgerTask
    elif mode in ("plain", "floor"):
        app = Celery("bench_app", broker=broker, backend=backend)
        app.conf.update(conf)
        base = Task
    else:
        raise ValueError(f"BENCH_MODE must be plain, floor or ledger, not {mode!r}")
    if mode == "floor":
        if not ledger_url:
            raise ValueError("BENCH_MODE=floor needs BENCH_LEDGER_URL (a PostgreSQL database)")
        floor = FloorWrites(ledger_url)
        settle = FloorWrites(ledger_url, lazy=True) if os.environ.get(ENV_FLOOR_ASYNC) else floor
        floor_sql = os.environ.get(ENV_FLOOR_SQL)
        if floor_sql in ("ledger", "ledger-no-events"):
            claim_row, settle_row, folded_row = ledger_statements(
                ledger_url, events=floor_sql == "ledger"
            )
        else:
            claim_row, settle_row, folded_row = floor_statements(
                audit=os.environ.get(ENV_FLOOR_AUDIT) == "1"
            )
        settle_write = settle.send if os.environ.get(ENV_FLOOR_PIPELINE) else settle.write
        if os.environ.get(ENV_FLOOR_COMBINED):
            unsettled: list[tuple[str, Any]] = []

            @app.task(
                name="bench_app.noop", shared=False, acks_late=True, reject_on_worker_lost=True
            )
            def noop_folded(i: int) -> int:
                req = noop_folded.request
                claimed = claim_row(req.id, req.hostname, [i])
                floor.write(*(folded_row(unsettled.pop(), claimed) if unsettled else claimed))
                result = body(i)
                unsettled.append(settle_row(req.id, str(result), req.hostname))
                return result

            return app

        @app.task(name="bench_app.noop", shared=False, acks_late=True, reject_on_worker_lost=True)
        def noop_floor(i: int) -> int:
            req = noop_floor.request
            floor.write(*claim_row(req.id, req.hostname, [i]))
            result = body(i)
            settle_write(*settle_row(req.id, str(result), req.hostname))
            return result

        return app

    # shared=False: a second app built in the same process (the benchmark's one-process
    # measurement) must not inherit this app's task under the same name.
    options: dict[str, Any] = {}
    if mode == "ledger":
        options["side_effect"] = os.environ.get(ENV_SIDE_EFFECT, "non_idempotent")
        keys = int(os.environ.get(ENV_CONCURRENCY_KEYS, "0") or 0)
        if keys:
            # docs/concurrency.md: task ``i`` takes a slot of key ``i mod keys`` under a limit
            # (``ENV_CONCURRENCY_LIMIT``) the benchmark never reaches (benchmarks/concurrency.py).
            options["concurrency_key"] = lambda i: f"bench:{i % keys}"
            options["concurrency_limit"] = int(os.environ.get(ENV_CONCURRENCY_LIMIT, "1000"))
        if os.environ.get(ENV_RATE_LIMIT):  # benchmarks/rate_limits.py
            options["ledger_rate_limit"] = os.environ[ENV_RATE_LIMIT]

    @app.task(
        base=base,
        name="bench_app.noop",
        shared=False,
        acks_late=True,
        reject_on_worker_lost=True,
        **options,
    )
    def noop(i: int) -> int:
        return body(i)

    return app


ENV_BODY_MS = "BENCH_BODY_MS"
ENV_SIDE_EFFECT = "BENCH_SIDE_EFFECT"
ENV_RATE_LIMIT = "BENCH_RATE_LIMIT"
ENV_FLOOR_ASYNC = "BENCH_FLOOR_SETTLE_ASYNC"
ENV_FLOOR_AUDIT = "BENCH_FLOOR_AUDIT"
ENV_FLOOR_SQL = "BENCH_FLOOR_SQL"
ENV_FLOOR_PIPELINE = "BENCH_FLOOR_PIPELINE"
ENV_FLOOR_COMBINED = "BENCH_FLOOR_COMBINED"
ENV_CONCURRENCY_KEYS = "BENCH_CONCURRENCY_KEYS"
ENV_CONCURRENCY_LIMIT = "BENCH_CONCURRENCY_LIMIT"
_BODY_SECONDS = float(os.environ.get(ENV_BODY_MS, "0") or 0) / 1000


def body(i: int) -> int:
    """The task's work: nothing, or a sleep of ``BENCH_BODY_MS``."""
    if _BODY_SECONDS:
        import time

        time.sleep(_BODY_SECONDS)
    return i


FLOOR_TABLE = "bench_floor"
FLOOR_DDL = (
    f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (task_id text PRIMARY KEY, done boolean NOT NULL)"
)
FLOOR_CLAIM = f"INSERT INTO {FLOOR_TABLE} (task_id, done) VALUES (%s, false)"
FLOOR_SETTLE = f"UPDATE {FLOOR_TABLE} SET done = true WHERE task_id = %s"
FLOOR_EVENTS = "bench_floor_events"
FLOOR_EVENTS_DDL = (
    f"CREATE TABLE IF NOT EXISTS {FLOOR_EVENTS} (id bigserial PRIMARY KEY, task_id text NOT NULL,"
    " event text NOT NULL, at double precision NOT NULL);"
    f" CREATE INDEX IF NOT EXISTS ix_{FLOOR_EVENTS}_task ON {FLOOR_EVENTS} (task_id, id)"
)
_AUDIT = (
    f" INSERT INTO {FLOOR_EVENTS} (task_id, event, at)"
    " SELECT task_id, '{event}', extract(epoch FROM statement_timestamp()) FROM w"
)
FLOOR_CLAIM_AUDIT = f"WITH w AS ({FLOOR_CLAIM} RETURNING task_id)" + _AUDIT.format(event="claimed")
FLOOR_SETTLE_AUDIT = f"WITH w AS ({FLOOR_SETTLE} RETURNING task_id)" + _AUDIT.format(
    event="settled"
)


def create_floor_table(url: str) -> None:
    """Create the floor mode's table in ``url`` (the benchmark's scratch database)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FLOOR_DDL)
        conn.execute(FLOOR_EVENTS_DDL)


class FloorWrites:
    """One autocommit psycopg connection per process (opened after fork), statements prepared
    on first use: the cheapest way for Python to make one durable PostgreSQL write."""

    def __init__(self, url: str, *, lazy: bool = False) -> None:
        self.url = url.replace("postgresql+psycopg://", "postgresql://")
        self.lazy = lazy
        self._conn: Any = None
        self._pid = -1
        self._pipe: Any = None

    def _connection(self) -> Any:
        if self._pid != os.getpid():
            import psycopg

            self._conn = psycopg.connect(self.url, autocommit=True, prepare_threshold=0)
            if self.lazy:
                self._conn.execute("SET synchronous_commit = off")
            self._pid = os.getpid()
            self._pipe = None
        return self._conn

    def write(self, statement: str, params: Any) -> None:
        self._connection().execute(statement, params)
        if self._pipe is not None:
            self._pipe.sync()  # this write's answer, and those of the settles sent before it

    def send(self, statement: str, params: Any) -> None:
        """The write sent and committed, its result read by the next ``write`` (pipeline
        mode, ``BENCH_FLOOR_PIPELINE``): no wait for the server's answer.

        psycopg's public ``Pipeline.sync()`` waits for every answer; sending the Sync without
        waiting takes its two private steps (psycopg 3.3).
        """
        conn = self._connection()
        if self._pipe is None:
            self._pipe_cm = conn.pipeline()
            self._pipe = self._pipe_cm.__enter__()
        conn.execute(statement, params)
        self._pipe._enqueue_sync()
        conn.wait(self._pipe._communicate_gen())


def floor_statements(
    *, audit: bool
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The two-write floor's builders of (SQL, parameters), with the signatures of
    ``ledger_statements``': its claim, its settle, and the two folded into one statement
    (``BENCH_FLOOR_COMBINED``; not for the audit floors)."""
    claim_sql = FLOOR_CLAIM_AUDIT if audit else FLOOR_CLAIM
    settle_sql = FLOOR_SETTLE_AUDIT if audit else FLOOR_SETTLE
    folded_sql = f"WITH s AS ({FLOOR_SETTLE}) {FLOOR_CLAIM}"

    def claim_row(task_id: str, _hostname: str, _args: list[Any]) -> tuple[str, tuple[str]]:
        return claim_sql, (task_id,)

    def settle_row(task_id: str, _result: str, _hostname: str) -> tuple[str, tuple[str]]:
        return settle_sql, (task_id,)

    def folded_row(
        settled: tuple[str, tuple[str]], claimed: tuple[str, tuple[str]]
    ) -> tuple[str, tuple[str, ...]]:
        if audit:
            raise ValueError(f"{ENV_FLOOR_COMBINED} does not fold the audit floors")
        return folded_sql, settled[1] + claimed[1]

    return claim_row, settle_row, folded_row


def without_event(sql: str) -> str:
    """The entries statement of one of the ledger's ``WITH written AS (...), logged AS (...)
    SELECT`` writes, without its ``RETURNING`` and the audit event it appends."""
    inner = sql.split("RETURNING", 1)[0]
    return inner.replace("WITH written AS \n(", "", 1)


def ledger_statements(
    url: str, *, events: bool = True
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``BENCH_FLOOR_SQL=ledger``: builders of (SQL, parameters) for the ledger's claim of a
    new key and its settle ``completed``, as ``celery_ledger.ledger`` compiles them, with every
    constant bound once here so that a call costs a dict of the row's values and no more; and
    of the two folded into one statement (``fold``, ``BENCH_FLOOR_COMBINED``).

    ``events=False`` (``BENCH_FLOOR_SQL=ledger-no-events``): the same two writes without the
    audit event each appends (``without_event``), what the schema would cost if the contract
    let the hot path's events out of its statements; those are not folded."""
    import json

    from celery_ledger.ledger import LedgerStore

    store = LedgerStore(url)
    claim = store._hot("claim")
    settle = store._hot(("settle", True))
    claim_const = claim.params({})
    settle_const = settle.params({})
    claim_sql, settle_sql = claim.sql, settle.sql
    if not events:
        claim_sql, settle_sql = without_event(claim_sql), without_event(settle_sql)
    store.dispose()
    args_hash = "0" * 64  # the size of the ledger's sha256 hex digest
    boot = "0" * 32
    pid = os.getpid()

    def claim_row(task_id: str, hostname: str, args: list[Any]) -> tuple[str, dict[str, Any]]:
        return claim_sql, {
            **claim_const,
            "key": task_id,
            "task_name": "bench_app.noop",
            "task_id": task_id,
            "side_effect": "idempotent",
            "args_hash": args_hash,
            "snapshot": json.dumps({"args": args, "kwargs": {}, "queue": "bench"}),
            "owner": hostname,
            "owner_boot": boot,
            "owner_pid": pid,
            "lease": 300.0,
            "executions": 1,
            "ev_event": "claimed",
            "ev_actor": hostname,
        }

    def settle_row(task_id: str, result: str, hostname: str) -> tuple[str, dict[str, Any]]:
        return settle_sql, {
            **settle_const,
            "k": task_id,
            "f": 1,
            "to_status": "completed",
            "new_result": result,
            "ev_event": "settled",
            "ev_actor": hostname,
        }

    folded_sql = fold(settle.sql, claim.sql)

    def folded_row(
        settled: tuple[str, dict[str, Any]], claimed: tuple[str, dict[str, Any]]
    ) -> tuple[str, dict[str, Any]]:
        if not events:
            raise ValueError(f"{ENV_FLOOR_COMBINED} does not fold the statements without events")
        return folded_sql, {**claimed[1], **{f"s_{k}": v for k, v in settled[1].items()}}

    return claim_row, settle_row, folded_row


def fold(settle_sql: str, claim_sql: str) -> str:
    """One statement that settles one task and claims the next: the settle's CTEs (renamed,
    their parameters prefixed ``s_``) before the claim's, the claim's rows returned. The data
    modifying CTEs of a statement all run, referenced or not."""
    import re

    head = "WITH "
    assert settle_sql.startswith(head) and claim_sql.startswith(head), (settle_sql, claim_sql)
    ctes = settle_sql[len(head) : settle_sql.rindex("\n SELECT ")]
    ctes = re.sub(r"\b(written|logged)\b", r"s_\1", ctes)
    ctes = re.sub(r"%\((\w+)\)s", r"%(s_\1)s", ctes)
    return f"{head}{ctes}, \n{claim_sql[len(head) :]}"


def freeze_before_fork() -> None:
    """The plain-mode copy of ``celery_ledger.app._on_before_fork`` (collect, freeze, fork,
    unfreeze)."""
    import gc

    from celery import signals
    from kombu.asynchronous import get_event_loop

    @signals.worker_before_create_process.connect(weak=False)
    def _freeze(**_: Any) -> None:
        hub = get_event_loop()
        if hub is not None:
            gc.collect()
            gc.freeze()
            hub.call_soon(gc.unfreeze)


if (
    os.environ.get("BENCH_MODE", "plain") in ("plain", "floor")
    and os.environ.get("BENCH_FREEZE") == "1"
):
    freeze_before_fork()

app = make_app(
    os.environ.get("BENCH_MODE", "plain"),
    broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"),
    queue=os.environ.get("BENCH_QUEUE", "bench"),
    ledger_url=os.environ.get("BENCH_LEDGER_URL"),
    backend=os.environ.get("BENCH_BACKEND_URL"),
)


# -- a wall-clock trace of each task (``benchmarks/trace.py``) -----------------------------------

ENV_TRACE = "BENCH_TRACE"


def install_trace(directory: str) -> None:
    """Write, per process, one JSON line per task with wall-clock stamps around each phase.

    Pool processes: ``prerun`` and ``postrun`` (Celery's signals), and the time spent in each
    ledger or floor write and in the result backend's store within them. The worker's parent:
    when each message was received (``Request.__init__``), handed to the pool, accepted by a
    pool process, reported successful, and acknowledged. Timestamps are ``time.time()`` so the
    two kinds of process can be joined by task id.
    """
    import json
    import threading
    import time
    from pathlib import Path

    from celery import signals
    from celery.worker import request as request_module

    now = time.time
    state = threading.local()
    files: dict[int, Any] = {}

    def out() -> Any:
        pid = os.getpid()
        f = files.get(pid)
        if f is None:
            f = files[pid] = open(Path(directory) / f"trace-{pid}.jsonl", "a", buffering=1)  # noqa: SIM115
        return f

    def timed(phase: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            phases = getattr(state, "phases", None)
            if phases is None:
                return fn(*args, **kwargs)
            started = now()
            try:
                return fn(*args, **kwargs)
            finally:
                phases.append((phase, started, now()))

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    @signals.task_prerun.connect(weak=False)
    def _prerun(task_id: str = "", **_: Any) -> None:
        state.phases = []
        state.prerun = now()

    @signals.task_postrun.connect(weak=False)
    def _postrun(task_id: str = "", **_: Any) -> None:
        phases = getattr(state, "phases", None) or []
        state.phases = None
        line = {"pid": os.getpid(), "id": task_id, "prerun": state.prerun, "postrun": now()}
        line["phases"] = phases
        out().write(json.dumps(line) + "\n")

    # Pool process phases.
    try:
        from celery_ledger.ledger import LedgerStore

        for name in ("claim", "settle", "renew_lease", "write_step"):
            setattr(LedgerStore, name, timed(name, getattr(LedgerStore, name)))
        from celery_ledger import heartbeat as hb

        for name in ("register", "unregister"):
            setattr(hb.Heartbeat, name, timed(f"heartbeat.{name}", getattr(hb.Heartbeat, name)))
    except ImportError:
        pass
    FloorWrites.write = timed("floor write", FloorWrites.write)  # type: ignore[method-assign]
    from celery.backends.base import Backend

    Backend.mark_as_done = timed("result backend", Backend.mark_as_done)  # type: ignore[method-assign]

    # The parent's stamps, per task id.
    Request = request_module.Request  # noqa: N806 - the class, named as Celery names it

    def parent_stamp(what: str, fn: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = now()
            try:
                return fn(self, *args, **kwargs)
            finally:
                line = {"parent": os.getpid(), "id": self.id, "what": what, "t0": started}
                line["t1"] = now()
                out().write(json.dumps(line) + "\n")

        return wrapper

    for name, what in (
        ("__init__", "received"),
        ("on_accepted", "accepted"),
        ("acknowledge", "acked"),
    ):
        setattr(Request, name, parent_stamp(what, getattr(Request, name)))
    try:
        from celery_ledger.request import LedgerRequest

        LedgerRequest._hold = parent_stamp("receipt hold", LedgerRequest._hold)  # type: ignore[method-assign]
    except ImportError:
        pass
    # The strategy builds a Request subclass per task that overrides these two.
    from celery.worker import strategy

    create = strategy.create_request_cls

    def create_request_cls(*args: Any, **kwargs: Any) -> Any:
        cls = create(*args, **kwargs)
        cls.execute_using_pool = parent_stamp("dispatched", cls.execute_using_pool)
        cls.on_success = parent_stamp("succeeded", cls.on_success)
        return cls

    strategy.create_request_cls = create_request_cls


if os.environ.get(ENV_TRACE):
    install_trace(os.environ[ENV_TRACE])

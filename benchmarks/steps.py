"""Per-step overhead and writes per step, and the cost of resuming a 100-step task.

    python benchmarks/steps.py                 # PostgreSQL (scratch db) and SQLite (temp file)
    python benchmarks/steps.py --tasks 10 --backend sqlite

Drives ``celery_ledger.attempt.Attempt`` and the store directly in this one process (no worker, no
broker): the store calls are exactly the ones a worker's pool process makes, without Celery's
delivery around them, so the figures are the ledger's own cost per step.

- A task of 10 steps with trivial bodies (``lambda x: x``): plain function calls vs ledgered
  steps, for an ``idempotent`` task (one ``completed`` write per step) and a
  ``non_idempotent`` one (``started`` intent, then ``completed``: two writes). The overhead
  per step is ``(ledgered - plain) / 10``, median over ``--tasks`` tasks. Writes per step are
  counted with SQLAlchemy's ``before_cursor_execute``.
- Transaction step (design.md § "Transaction steps and the transactional outbox"): one INSERT into
  an application table committed with the step's
  ``completed`` row (``self.transaction_step``), against the same INSERT committed by the user
  on the same engine without the ledger (``engine.begin()``), alternated in one run: the ratio
  of medians (target <= 1.3x) and the commits per step (target 1). Each entry's first
  transaction step also writes its marker row (two statements, once per entry): measured
  apart, as the steps after it are the steady state.
- Resume: a ``non_idempotent`` task ran 100 steps and its process died (the entry is marked
  interrupted); a new delivery claims it (gate TAKEOVER, which loads the replay rows) and
  replays the 100 steps. Reported: that time, and how many queries read ``ledger_steps``.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from common import Report, StatementCounter, databases, exit_on_sigterm, format_rows, median
from sqlalchemy import Column, Integer, MetaData, String, Table

from celery_ledger.attempt import Attempt
from celery_ledger.codec import arguments_hash
from celery_ledger.ledger import ClaimRequest, EntryStatus, Gate, LedgerStore, Owner
from celery_ledger.settings import LedgerSettings

BENCH = "steps"
STEPS = 10
RESUME_STEPS = 100


class _Task:
    """The attributes ``Attempt`` reads from its task (``app`` only to publish children, which
    these steps never send)."""

    def __init__(self, side_effect: str) -> None:
        self.side_effect = side_effect
        self.name = "bench.steps"
        self.app = None


def _trivial(x: int) -> int:
    return x


def _claim(store: LedgerStore, key: str, owner: Owner) -> Any:
    return store.claim(
        ClaimRequest(
            key=key,
            task_name="bench.steps",
            task_id=key,
            args_hash="task-id",
            snapshot='{"args": [], "kwargs": {}}',
            side_effect="non_idempotent",
            owner=owner,
            lease_seconds=60.0,
        )
    )


def _attempt(
    store: LedgerStore, settings: LedgerSettings, side_effect: str, claim: Any, key: str
) -> Attempt:
    return Attempt(
        _Task(side_effect),
        store,
        settings,
        key=key,
        fence=claim.fence,  # type: ignore[arg-type]
        task_id=key,
        lease_seconds=60.0,
        replay=claim.steps,
    )


def step_overhead(
    store: LedgerStore, settings: LedgerSettings, side_effect: str, tasks: int
) -> tuple[float, float, float]:
    """Return (median overhead per step in ms, writes per step, statements per step)."""
    owner = Owner("bench@steps", "boot", 1)
    overheads, writes, statements = [], [], []
    with StatementCounter(store.engine, store.fast) as counter:
        for _ in range(tasks):
            started = time.perf_counter()
            for i in range(STEPS):
                _trivial(i)
            plain = time.perf_counter() - started

            key = uuid.uuid4().hex
            claim = _claim(store, key, owner)
            attempt = _attempt(store, settings, side_effect, claim, key)
            counter.reset()
            started = time.perf_counter()
            for i in range(STEPS):
                attempt.step(f"s{i}", _trivial, (i,), {})
            ledgered = time.perf_counter() - started
            writes.append(counter.writes() / STEPS)
            statements.append(counter.count / STEPS)
            store.settle(key, claim.fence, EntryStatus.COMPLETED, result="null")
            overheads.append((ledgered - plain) / STEPS * 1000)
    return median(overheads), median(writes), median(statements)


_meta = MetaData()
_app_rows = Table(
    "bench_app_rows",
    _meta,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("v", String(64), nullable=False),
)


def _insert(conn: Any, v: str) -> str:
    conn.execute(_app_rows.insert().values(v=v))
    return v


def transaction_steps(
    store: LedgerStore, settings: LedgerSettings, tasks: int
) -> tuple[float, float, float, float]:
    """Return (median ms of a bare write, median ms of a transaction step, median ms of an
    entry's first transaction step, commits per step)."""
    _meta.create_all(store.engine)
    owner = Owner("bench@txn", "boot", 1)
    bare, stepped, first, commits = [], [], [], []
    no_input = arguments_hash([[], {}])
    with StatementCounter(store.engine, store.fast) as counter:
        for _ in range(tasks):
            key = uuid.uuid4().hex
            claim = _claim(store, key, owner)
            attempt = _attempt(store, settings, "non_idempotent", claim, key)
            for i in range(STEPS):
                # The same write, alternated: the user's own transaction, then the step's.
                started = time.perf_counter()
                with store.engine.begin() as conn:
                    _insert(conn, f"bare-{i}")
                took = time.perf_counter() - started
                if i:
                    bare.append(took * 1000)
                counter.reset()
                started = time.perf_counter()
                attempt.transaction(f"t{i}", no_input).run(_insert, (f"step-{i}",), {})
                took = time.perf_counter() - started
                (stepped if i else first).append(took * 1000)
                if i:
                    commits.append(counter.commits)
            store.settle(key, claim.fence, EntryStatus.COMPLETED, result="null")
    return median(bare), median(stepped), median(first), median(commits)


def resume(store: LedgerStore, settings: LedgerSettings, repeat: int) -> tuple[float, int, int]:
    """Return (median ms to claim + replay a 100-step task, steps queries, statements)."""
    dead = Owner("bench@dead", "boot-1", 111)
    times, step_queries, statements = [], [], []
    for _ in range(repeat):
        key = uuid.uuid4().hex
        claim = _claim(store, key, dead)
        attempt = _attempt(store, settings, "non_idempotent", claim, key)
        for i in range(RESUME_STEPS):
            attempt.step(f"s{i}", _trivial, (i,), {})
        # The pool process died: the worker's parent marks the entry interrupted.
        store.interrupt_owner(
            key,
            node=dead.node,
            boot=dead.boot,
            pid=dead.pid,
            actor="bench",
            why="pool process lost",
        )
        with StatementCounter(store.engine, store.fast) as counter:
            started = time.perf_counter()
            again = _claim(store, key, Owner("bench@new", "boot-2", 222))
            resumed = _attempt(store, settings, "non_idempotent", again, key)
            outputs = [resumed.step(f"s{i}", _trivial, (i,), {}) for i in range(RESUME_STEPS)]
            times.append((time.perf_counter() - started) * 1000)
        if (
            again.gate is not Gate.TAKEOVER
            or resumed.replayed != RESUME_STEPS
            or outputs != list(range(RESUME_STEPS))
        ):
            raise RuntimeError(
                f"resume did not replay: gate={again.gate} replayed={resumed.replayed}"
            )
        step_queries.append(
            sum(
                1
                for s in counter.statements
                if s.lstrip().upper().startswith("SELECT") and "ledger_steps" in s
            )
        )
        statements.append(counter.count)
        store.settle(key, again.fence, EntryStatus.COMPLETED, result="null")
    return median(times), max(step_queries), max(statements)


def run(
    backends: tuple[str, ...] = ("postgres", "sqlite"), tasks: int = 50, resumes: int = 5
) -> Report:
    report = Report()
    with databases(list(backends)) as urls:
        for backend, url in urls.items():
            store = LedgerStore(url)
            store.ensure_ready()
            settings = LedgerSettings(url=url)
            step_overhead(store, settings, "idempotent", 2)  # warm caches and the pool
            name = "PostgreSQL" if backend == "postgres" else "SQLite"
            for side_effect, label in (
                ("idempotent", "idempotent step"),
                ("non_idempotent", "effect step"),
            ):
                ms, writes, stmts = step_overhead(store, settings, side_effect, tasks)
                target = "1" if side_effect == "idempotent" else "2"
                report.add(
                    BENCH,
                    f"{label} overhead ({name})",
                    ms,
                    "ms",
                    note=f"median of {tasks} tasks of {STEPS} steps",
                )
                report.add(BENCH, f"{label} writes ({name})", writes, "writes/step", target=target)
                report.add(
                    BENCH, f"{label} statements ({name})", stmts, "stmts/step", target=target
                )
            transaction_steps(store, settings, 2)  # warm
            bare, stepped, first, commits = transaction_steps(store, settings, tasks)
            note = f"median of {tasks} tasks x {STEPS - 1} steps, alternated in one run"
            report.add(BENCH, f"bare write, user's own transaction ({name})", bare, "ms", note=note)
            report.add(BENCH, f"transaction step, same write ({name})", stepped, "ms", note=note)
            report.add(
                BENCH,
                f"transaction step / bare write ({name})",
                stepped / bare,
                "x",
                target="<= 1.3",
            )
            report.add(
                BENCH,
                f"first transaction step of an entry ({name})",
                first,
                "ms",
                note="+ its marker row (once per entry)",
            )
            report.add(
                BENCH, f"transaction step commits ({name})", commits, "commits/step", target="1"
            )
            ms, queries, stmts = resume(store, settings, resumes)
            report.add(
                BENCH,
                f"resume 100 steps ({name})",
                ms,
                "ms",
                note=f"claim (TAKEOVER) + replay, median of {resumes}",
            )
            report.add(BENCH, f"resume replay-row queries ({name})", queries, "queries", target="1")
            report.add(BENCH, f"resume statements ({name})", stmts, "stmts")
            store.dispose()
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--tasks", type=int, default=50)
    parser.add_argument("--resumes", type=int, default=5)
    args = parser.parse_args()
    backends = ("postgres", "sqlite") if args.backend == "both" else (args.backend,)
    print(format_rows(run(backends, args.tasks, args.resumes).rows))


if __name__ == "__main__":
    main()

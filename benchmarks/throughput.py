"""Throughput of a trivial task: plain Celery vs ``LedgerTask``, side by side in one invocation.

    python benchmarks/throughput.py                    # 5,000 tasks, median of 3 rounds
    python benchmarks/throughput.py --tasks 200 --rounds 1
    python benchmarks/throughput.py --amqp amqp://guest:guest@127.0.0.1:5672//   # + RabbitMQ
    python benchmarks/throughput.py --matrix --tasks 1000 --rounds 1 -c 2 --body-ms 10  # durability

Setup (identical for both, see ``bench_app``): Redis broker and result backend, one worker
``-P prefork -c 2``, ``acks_late``, prefetch 1, ``result_extended``, log level warning. The
ledgered run uses a PostgreSQL ledger in a scratch database created and dropped here.

Each round pre-fills a fresh queue with N tasks, then starts a worker and lets it drain the
queue. Throughput is ``(N - 1) / (last date_done - first date_done)`` from the result
backend, so worker start-up is not counted. Rounds alternate the order of the modes.

A third mode, ``floor``, is plain Celery plus the two PostgreSQL writes any durable
claim-then-settle design must make per task (an ``INSERT`` before the body, an ``UPDATE`` after,
on a bare psycopg connection; see ``bench_app``). ``floor/plain`` is the most a ledgered task can
reach on this machine whatever the ledger's own code does; ``ledger/floor`` is what that code costs.

``--matrix`` (docs/benchmarks.md § "The hidden millisecond") drains, side by side in one invocation,
with a body of ``--body-ms``:
plain; the floor with synchronous commits, with asynchronous ones (``PGOPTIONS``), and with one
of each (``floor-intent``: a synchronous claim, an asynchronous settle, what a task whose claim
is its intent needs); the ledger with ``ledger_durability`` ``every-write`` and ``effects``
(default class ``non_idempotent``, no steps) and ``effects`` for an ``idempotent`` task; and
the asynchronous and intent floors with the contract's audit row on each write
(``floor-audit-async``, ``floor-audit-intent``); the asynchronous floor with each settle sent
without waiting for its answer (``floor-async-pipelined``) or folded into the next claim
(``floor-async-combined``: one round trip per task); the schema floor (the ledger's own
statements on the floor's bare connection, ``floor-ledger-sql-*``), also without the audit
event each appends (``floor-ledger-sql-async-no-events``). ``--variants a,b,...`` drains only
those.
Each round prints the CPU per task of the worker's parent, its pool processes, PostgreSQL and
Redis.

Then, in this process (no worker), ``task.apply()`` of the ledgered task with SQLAlchemy
``before_cursor_execute`` counting: statements and round trips per task on the hot path. The
worker run also reports PostgreSQL's own counters (pg_stat_database) per task.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from datetime import datetime
from pathlib import Path
from typing import Any

from common import (
    REDIS_URL,
    CpuTally,
    Report,
    StatementCounter,
    bench_worker,
    exit_on_sigterm,
    format_rows,
    median,
    pg_database,
    pg_stat,
)

from celery_ledger.harness.processes import Process, wait_for

BENCH = "throughput"
TASK = "bench_app.noop"
#: bench_app modes drained each round, in this order on even rounds and reversed on odd ones.
MODES = ("plain", "floor", "ledger")


def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def enqueue(broker: str, queue: str, n: int) -> list[str]:
    """Send ``n`` noop tasks to ``queue``; return their ids."""
    from celery import Celery

    sender = Celery("bench_sender", broker=broker)
    sender.conf.update(task_serializer="json", accept_content=["json"])
    ids = [str(uuid.uuid4()) for _ in range(n)]
    with sender.producer_or_acquire() as producer:
        for i, task_id in enumerate(ids):
            sender.send_task(TASK, args=[i], task_id=task_id, queue=queue, producer=producer)
    sender.close()
    return ids


def _delete_amqp_queue(broker: str, queue: str) -> None:
    from kombu import Connection

    with Connection(broker) as conn:
        channel = conn.channel()
        try:
            channel.queue_delete(queue)
            channel.exchange_delete(queue)
        finally:
            channel.close()


def _meta_keys(ids: list[str]) -> list[str]:
    return [f"celery-task-meta-{i}" for i in ids]


def drain(
    mode: str,
    n: int,
    *,
    broker: str,
    ledger_url: str | None,
    tmp: Path,
    on_drained: Callable[[Process], Any] | None = None,
    extra_env: dict[str, str] | None = None,
    concurrency: int = 2,
    backend: str | None = None,
) -> dict[str, Any]:
    """Pre-fill a queue with ``n`` tasks, start a worker, wait until every result is stored
    (in ``backend``, a Redis URL; default: the broker).

    Returns tasks/s and, through ``on_drained``, whatever the caller measures on the live
    worker. The worker is stopped (its whole session) whatever happens.
    """
    queue = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    backend = backend or broker
    client = _redis(backend)
    ids = enqueue(broker, queue, n)
    keys = _meta_keys(ids)
    env = {
        "BENCH_MODE": mode,
        "BENCH_BROKER_URL": broker,
        "BENCH_BACKEND_URL": backend,
        "BENCH_QUEUE": queue,
    }
    if ledger_url:
        env["BENCH_LEDGER_URL"] = ledger_url
    env.update(extra_env or {})
    before = pg_stat(ledger_url) if ledger_url and ledger_url.startswith("postgres") else None
    extra: Any = None
    try:
        with bench_worker(env, tmp, f"worker-{queue}", concurrency=concurrency) as worker:

            def stored() -> int:
                return sum(client.exists(*keys[i : i + 1000]) for i in range(0, n, 1000))

            def done() -> bool:
                return stored() >= n

            def check() -> None:
                if not worker.alive:
                    raise RuntimeError(f"{mode} worker exited:\n{worker.log_tail()}")

            # CPU is counted from the first stored result (worker start-up excluded) to the
            # last, for the tasks in between.
            wait_for(
                lambda: stored() > 0,
                timeout=60,
                interval=0.05,
                what=f"the first {mode} result",
                check=check,
            )
            tally = CpuTally(worker.pid)
            tally.start()
            counted_from = stored()
            wait_for(
                done, timeout=60 + n / 20, interval=0.25, what=f"{n} {mode} results", check=check
            )
            cpu = tally.stop()
            if on_drained is not None:
                extra = on_drained(worker)
        metas = [json.loads(v) for i in range(0, n, 1000) for v in client.mget(keys[i : i + 1000])]
    finally:
        if broker.startswith("amqp"):
            _delete_amqp_queue(broker, queue)
        else:
            client.delete(queue, f"_kombu.binding.{queue}")
        for i in range(0, n, 1000):
            client.delete(*keys[i : i + 1000])
        client.close()
    failed = [m for m in metas if m["status"] != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{len(failed)} {mode} tasks did not succeed, e.g. {failed[0]}")
    stamps = sorted(datetime.fromisoformat(m["date_done"]).timestamp() for m in metas)
    span = stamps[-1] - stamps[0]
    counted = max(1, n - counted_from)
    out: dict[str, Any] = {
        "rate": (n - 1) / span if span > 0 else float("nan"),
        "span": span,
        "extra": extra,
        "cpu_ms": {k: v / counted * 1000 for k, v in cpu.items()},
    }
    if before is not None:
        assert ledger_url is not None
        time.sleep(1.0)  # backends flush their statistics when they exit
        after = pg_stat(ledger_url)
        out["pg"] = {k: (after[k] - before[k]) / n for k in after}
    return out


def add_cpu_rows(
    report: Report,
    cpu: dict[str, list[dict[str, float]]],
    skip: Collection[tuple[str, str]] = (),
) -> None:
    """One row per drained label and process group: the median over the rounds of the CPU
    per task (``drain``'s ``cpu_ms``), except the (label, group) pairs in ``skip``."""
    for label, rounds in cpu.items():
        for group in CpuTally.GROUPS:
            if (label, group) not in skip:
                report.add(
                    BENCH,
                    f"CPU per task, {label}: {group}",
                    median([c[group] for c in rounds]),
                    "ms",
                    note="/proc/<pid>/stat over the drain, median of rounds",
                )


def count_hot_path(ledger_url: str, broker: str, n: int = 200) -> dict[str, float]:
    """Statements per ledgered task, counted in this process through ``task.apply()``."""
    from bench_app import make_app

    from celery_ledger import runtime

    app = make_app("ledger", broker=broker, queue="unused", ledger_url=ledger_url)
    task = app.tasks[TASK]
    store = runtime.store_for(app)
    store.ensure_ready()
    task.apply(args=(0,))  # warm the pool
    with StatementCounter(store.engine, store.fast) as counter:
        for i in range(n):
            task.apply(args=(i,))
    store.dispose()
    return {
        "statements": counter.count / n,
        "writes": counter.writes() / n,
        "round_trips": (counter.count + counter.begins + counter.commits) / n,
    }


def profile_hot_path(ledger_url: str, broker: str, n: int = 500) -> str:
    """cProfile of ``n`` eager ledgered tasks: where the in-process time goes."""
    from bench_app import make_app

    from celery_ledger import runtime

    app = make_app("ledger", broker=broker, queue="unused", ledger_url=ledger_url)
    task = app.tasks[TASK]
    store = runtime.store_for(app)
    task.apply(args=(0,))
    prof = cProfile.Profile()
    started = time.perf_counter()
    prof.enable()
    for i in range(n):
        task.apply(args=(i,))
    prof.disable()
    took = time.perf_counter() - started
    plain = make_app("plain", broker=broker, queue="unused").tasks[TASK]
    plain_took = time_apply(plain, n)
    store.dispose()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    return (
        f"{n} eager applies: ledgered {took / n * 1000:.2f} ms/task (under cProfile), "
        f"plain {plain_took / n * 1000:.3f} ms/task\n" + buf.getvalue()
    )


def time_apply(task: Any, n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        task.apply(args=(i,))
    return time.perf_counter() - started


#: ``--matrix``: label -> (bench_app mode, environment of its worker).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "plain": ("plain", {}),
    "floor-sync": ("floor", {}),
    "floor-async": ("floor", {"PGOPTIONS": "-c synchronous_commit=off"}),
    "floor-intent": ("floor", {"BENCH_FLOOR_SETTLE_ASYNC": "1"}),
    # The floors with the contract's audit row on each write (bench_app, BENCH_FLOOR_AUDIT).
    "floor-audit-async": (
        "floor",
        {"PGOPTIONS": "-c synchronous_commit=off", "BENCH_FLOOR_AUDIT": "1"},
    ),
    "floor-audit-intent": ("floor", {"BENCH_FLOOR_SETTLE_ASYNC": "1", "BENCH_FLOOR_AUDIT": "1"}),
    # The ledger's own two statements on the floor's bare connection (BENCH_FLOOR_SQL): the
    # schema's cost without the ledger's Python.
    "floor-ledger-sql-async": (
        "floor",
        {"PGOPTIONS": "-c synchronous_commit=off", "BENCH_FLOOR_SQL": "ledger"},
    ),
    # The same without the audit event each appends: what the schema would cost with the hot
    # path's events out of its statements (a change the contract does not allow today).
    "floor-ledger-sql-async-no-events": (
        "floor",
        {"PGOPTIONS": "-c synchronous_commit=off", "BENCH_FLOOR_SQL": "ledger-no-events"},
    ),
    # The asynchronous floors with each settle sent in pipeline mode, its answer read with the
    # next claim (no wait for it); and with each settle folded into the next claim (one round
    # trip per task). See bench_app.
    "floor-async-pipelined": (
        "floor",
        {"PGOPTIONS": "-c synchronous_commit=off", "BENCH_FLOOR_PIPELINE": "1"},
    ),
    "floor-async-combined": (
        "floor",
        {"PGOPTIONS": "-c synchronous_commit=off", "BENCH_FLOOR_COMBINED": "1"},
    ),
    "floor-ledger-sql-async-combined": (
        "floor",
        {
            "PGOPTIONS": "-c synchronous_commit=off",
            "BENCH_FLOOR_SQL": "ledger",
            "BENCH_FLOOR_COMBINED": "1",
        },
    ),
    "floor-ledger-sql-async-pipelined": (
        "floor",
        {
            "PGOPTIONS": "-c synchronous_commit=off",
            "BENCH_FLOOR_SQL": "ledger",
            "BENCH_FLOOR_PIPELINE": "1",
        },
    ),
    "floor-ledger-sql-intent": (
        "floor",
        {"BENCH_FLOOR_SETTLE_ASYNC": "1", "BENCH_FLOOR_SQL": "ledger"},
    ),
    "ledger-every-write": ("ledger", {"CELERY_LEDGER_DURABILITY": "every-write"}),
    "ledger-effects": ("ledger", {"CELERY_LEDGER_DURABILITY": "effects"}),
    "ledger-effects-idempotent": (
        "ledger",
        {"CELERY_LEDGER_DURABILITY": "effects", "BENCH_SIDE_EFFECT": "idempotent"},
    ),
}
#: (numerator, denominator, target) of the ratios ``--matrix`` reports.
MATRIX_RATIOS = (
    ("floor-sync", "plain", ""),
    ("floor-async", "plain", ""),
    ("floor-intent", "plain", ""),
    ("ledger-every-write", "plain", ""),
    ("ledger-effects", "plain", ""),
    ("ledger-effects-idempotent", "plain", ">= 0.75 (-c 2), >= 0.80 (-c 8); 10 ms: >= 0.95"),
    ("ledger-every-write", "floor-sync", ">= 0.95"),
    ("ledger-effects", "floor-intent", ">= 0.95"),
    ("ledger-effects-idempotent", "floor-async", ">= 0.95"),
    ("floor-audit-async", "floor-async", ""),
    ("ledger-effects", "floor-audit-intent", ""),
    ("ledger-effects-idempotent", "floor-audit-async", ""),
    ("floor-async-pipelined", "floor-async", "(a settle not waited for)"),
    ("floor-async-combined", "floor-async", "(one round trip per task)"),
    ("floor-async-combined", "plain", ""),
    ("floor-ledger-sql-async", "floor-async", "(the schema's cost)"),
    ("floor-ledger-sql-async-no-events", "floor-ledger-sql-async", "(the hot path's events)"),
    ("floor-ledger-sql-async-no-events", "plain", ""),
    ("floor-ledger-sql-async-combined", "floor-ledger-sql-async", "(one round trip per task)"),
    ("floor-ledger-sql-intent", "floor-intent", "(the schema's cost)"),
    ("ledger-effects-idempotent", "floor-ledger-sql-async", "(the ledger's Python)"),
    ("ledger-effects", "floor-ledger-sql-intent", "(the ledger's Python)"),
)


def run_matrix(
    tasks: int,
    rounds: int,
    broker: str,
    concurrency: int,
    body_ms: float,
    variants: list[str] | None = None,
) -> Report:
    """The durability table: every variant (or ``variants``) drained in one invocation, rounds
    alternating order."""
    report = Report()
    names = variants or list(VARIANTS)
    rates: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, list[dict[str, float]]] = {v: [] for v in names}
    with pg_database() as ledger_url, tempfile.TemporaryDirectory(prefix="cl_tp_") as tmp:
        from bench_app import create_floor_table

        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(ledger_url)
        store.ensure_ready()
        store.dispose()
        create_floor_table(ledger_url)
        for r in range(rounds):
            for variant in names if r % 2 == 0 else names[::-1]:
                mode, env = VARIANTS[variant]
                out = drain(
                    mode,
                    tasks,
                    broker=broker,
                    tmp=Path(tmp),
                    concurrency=concurrency,
                    ledger_url=ledger_url if mode != "plain" else None,
                    extra_env={**env, "BENCH_BODY_MS": str(body_ms)},
                )
                rates[variant].append(out["rate"])
                cpu[variant].append(out["cpu_ms"])
                per_group = ", ".join(f"{k} {v:.2f}" for k, v in out["cpu_ms"].items())
                print(
                    f"  round {r + 1} {variant}: {out['rate']:.0f} tasks/s "
                    f"({tasks} in {out['span']:.2f}s; CPU ms per task: {per_group})",
                    file=sys.stderr,
                )
    note = f"-c {concurrency}, body {body_ms:g} ms, {tasks} tasks, median of {rounds}"
    got = {v: median(xs) for v, xs in rates.items()}
    for variant, rate in got.items():
        report.add(BENCH, variant, rate, "tasks/s", note=note)
    for top, bottom, target in MATRIX_RATIOS:
        if top not in got or bottom not in got:
            continue
        report.add(BENCH, f"{top} / {bottom}", got[top] / got[bottom], "x", target=target)
    add_cpu_rows(report, cpu)
    return report


def run(
    tasks: int = 5000,
    rounds: int = 3,
    broker: str = REDIS_URL,
    profile: bool = False,
    concurrency: int = 2,
    amqp: str | None = None,
) -> Report:
    report = Report()
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    amqp_rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    pg_per_task: list[dict[str, float]] = []
    with pg_database() as ledger_url, tempfile.TemporaryDirectory(prefix="cl_tp_") as tmp:
        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(ledger_url)
        store.ensure_ready()  # migrate once here, not in the first claim of the worker
        store.dispose()
        from bench_app import create_floor_table

        create_floor_table(ledger_url)
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                out = drain(
                    mode,
                    tasks,
                    broker=broker,
                    tmp=Path(tmp),
                    concurrency=concurrency,
                    ledger_url=ledger_url if mode != "plain" else None,
                )
                rates[mode].append(out["rate"])
                cpu[mode].append(out["cpu_ms"])
                if "pg" in out and mode == "ledger":
                    pg_per_task.append(out["pg"])
                print(
                    f"  round {r + 1} {mode}: {out['rate']:.0f} tasks/s "
                    f"({tasks} in {out['span']:.2f}s)",
                    file=sys.stderr,
                )
                if amqp:
                    # The same mode on RabbitMQ right after, results still in Redis.
                    out = drain(
                        mode,
                        tasks,
                        broker=amqp,
                        backend=broker,
                        tmp=Path(tmp),
                        concurrency=concurrency,
                        ledger_url=ledger_url if mode != "plain" else None,
                    )
                    amqp_rates[mode].append(out["rate"])
                    print(
                        f"  round {r + 1} {mode} on RabbitMQ: {out['rate']:.0f} tasks/s "
                        f"({tasks} in {out['span']:.2f}s)",
                        file=sys.stderr,
                    )
        hot = count_hot_path(ledger_url, broker)
        if profile:
            report.text["throughput profile"] = profile_hot_path(ledger_url, broker)
    plain, floor, ledger = (median(rates[mode]) for mode in MODES)
    note = f"median of {rounds}, {tasks} tasks, -c {concurrency}"
    report.add(BENCH, "plain celery (acks_late)", plain, "tasks/s", note=note)
    report.add(BENCH, "LedgerTask (PostgreSQL)", ledger, "tasks/s", note=note)
    report.add(BENCH, "ratio ledger/plain", ledger / plain, "x", target=">= 0.80")
    report.add(
        BENCH,
        "two-commit floor (bare psycopg)",
        floor,
        "tasks/s",
        note="plain celery + 1 INSERT before, 1 UPDATE after; no ledger",
    )
    report.add(
        BENCH,
        "ratio floor/plain",
        floor / plain,
        "x",
        note="the most any claim-then-settle on PostgreSQL reaches here",
    )
    report.add(BENCH, "ratio ledger/floor", ledger / floor, "x", note="what the ledger adds")
    if amqp:
        a_plain, a_floor, a_ledger = (median(amqp_rates[mode]) for mode in MODES)
        amqp_note = f"{note}; RabbitMQ broker (classic queue), results in Redis"
        report.add(BENCH, "RabbitMQ: plain celery (acks_late)", a_plain, "tasks/s", note=amqp_note)
        report.add(BENCH, "RabbitMQ: two-commit floor", a_floor, "tasks/s", note=amqp_note)
        report.add(BENCH, "RabbitMQ: LedgerTask (PostgreSQL)", a_ledger, "tasks/s", note=amqp_note)
        report.add(BENCH, "RabbitMQ: ratio ledger/plain", a_ledger / a_plain, "x")
        report.add(BENCH, "RabbitMQ: ratio floor/plain", a_floor / a_plain, "x")
        report.add(BENCH, "RabbitMQ: ratio ledger/floor", a_ledger / a_floor, "x")
    add_cpu_rows(report, cpu, skip={("plain", "postgres")})
    report.add(
        BENCH,
        "statements per task",
        hot["statements"],
        "stmts",
        note="claim + settle, counted in one process",
    )
    report.add(BENCH, "writes per task", hot["writes"], "stmts")
    report.add(
        BENCH,
        "round trips per task",
        hot["round_trips"],
        "trips",
        note="statements + BEGIN/COMMIT of explicit transactions",
    )
    if pg_per_task:
        report.add(
            BENCH,
            "pg transactions per task",
            median([p["commit"] for p in pg_per_task]),
            "xacts",
            note="pg_stat_database during the worker run",
        )
        report.add(
            BENCH,
            "pg rows written per task",
            median([p["inserted"] + p["updated"] for p in pg_per_task]),
            "rows",
        )
    report.text["throughput rounds"] = "\n".join(
        f"{mode}: " + ", ".join(f"{x:.0f}" for x in xs) + " tasks/s" for mode, xs in rates.items()
    )
    if amqp:
        report.text["throughput rounds"] += "\n" + "\n".join(
            f"{mode} on RabbitMQ: " + ", ".join(f"{x:.0f}" for x in xs) + " tasks/s"
            for mode, xs in amqp_rates.items()
        )
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default=REDIS_URL)
    parser.add_argument(
        "-c",
        "--concurrency",
        type=int,
        default=2,
        help="pool processes of both workers (default 2: Celery's default here)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile the ledgered task in this process"
    )
    parser.add_argument(
        "--amqp",
        metavar="URL",
        help="also run each mode on this RabbitMQ broker (amqp://...), side by side in each round",
    )
    parser.add_argument(
        "--matrix", action="store_true", help="the durability variants side by side (see above)"
    )
    parser.add_argument("--body-ms", type=float, default=0.0, help="--matrix: the body's sleep")
    parser.add_argument(
        "--variants", help=f"--matrix: only these, comma-separated ({', '.join(VARIANTS)})"
    )
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",")] if args.variants else None
    unknown = sorted(set(variants or ()) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    if args.matrix:
        report = run_matrix(
            args.tasks, args.rounds, args.broker, args.concurrency, args.body_ms, variants
        )
    else:
        report = run(
            args.tasks, args.rounds, args.broker, args.profile, args.concurrency, amqp=args.amqp
        )
    print(format_rows(report.rows))
    for title, text in report.text.items():
        print(f"\n{title}:\n{text}")


if __name__ == "__main__":
    main()

"""A fleet on one database: N workers and two beats against one PostgreSQL ledger, under chaos.

    python benchmarks/fleet.py                                   # 6 workers x -c 4, 20,000 orders
    python benchmarks/fleet.py --tasks 2000 --workers 3 --concurrency 2

The run is ``verify``'s (``celery_ledger.harness.verify``), fleet-sized: the ledgered order
task (four steps: quote, reserve, charge, receipt; some send a child through the outbox) on
Redis, the ledger a PostgreSQL server of the run's own (``celery_ledger.harness.pgserver``,
``max_connections`` 200: a fleet would take a shared server's connections from everyone else
on it), every worker on the short lease and sweep ``verify`` uses, and ``verify``'s chaos
(SIGKILL a pool process or a whole worker, SIGSTOP a worker past its lease, cut the ledger
through a proxy, restart the broker through a proxy). Two ``celery beat`` processes send the
sweep, so two sweeps run at once as a deployment with a beat per host would have them.

What it reports, besides the orders' outcomes:

- throughput: orders completed per second, from the first publish to the last effect;
- lock waits on the ledger: ``pg_locks`` rows not granted (joined to ``pg_stat_activity`` for
  the database), sampled every ``--sample`` seconds; each wait (pid, waitstart) counted once,
  with the longest seen. A wait shorter than the sampling interval can be missed;
- deadlocks: ``pg_stat_database.deadlocks`` of the scratch database, before and after;
- the sweep's p50 and p99: every ``celery_ledger.sweep`` task's run time, from the workers'
  own "succeeded in" lines;
- connections: ``pg_stat_activity`` by ``application_name``; each worker's ledger URL names
  its connections (``?application_name=celery-ledger/w3``), so the most each worker held and
  the most the fleet held at once are read apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from common import PG_ADMIN, REDIS_URL, exit_on_sigterm, pg_database

from celery_ledger.harness import demo_app
from celery_ledger.harness.orchestrate import Phases, Stage, Workload, staged
from celery_ledger.harness.pgserver import OwnPostgres
from celery_ledger.harness.processes import wait_ready
from celery_ledger.harness.verify import (
    KINDS,
    SETTLE_SECONDS,
    STALL_SECONDS,
    TIME_SETTINGS,
    BrokerRestart,
    Chaos,
    ChaosLog,
    _drained,
    outage_for,
)

#: Seconds of work between an order's effects: mostly none (throughput is the point), a few
#: long enough for a crash to land inside.
GAPS = (0.0, 0.0, 0.0, 0.0, 0.02, 0.1)
#: Seconds between counts of the orders done during the chaos.
CHECK_EVERY = 5.0
#: The ``application_name`` prefix of each worker's ledger connections.
APP_PREFIX = "celery-ledger/"
SWEEP_LINE = re.compile(r"Task celery_ledger\.sweep\[[^\]]+\] succeeded in ([0-9.]+)s")

WAITS_SQL = (
    "SELECT l.pid, l.waitstart, now() - l.waitstart FROM pg_locks l "
    "JOIN pg_stat_activity a ON a.pid = l.pid WHERE NOT l.granted AND a.datname = %s"
)
CONNECTIONS_SQL = (
    "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s GROUP BY 1"
)


@dataclass
class Samples:
    """What the sampler saw: lock waits (each once) and connections (the most at once)."""

    waits: dict[tuple[int, Any], float] = field(default_factory=dict)
    most_by_name: dict[str, int] = field(default_factory=dict)
    most_total: int = 0
    most_fleet: int = 0
    samples: int = 0


class Sampler(threading.Thread):
    """Reads ``pg_locks`` and ``pg_stat_activity`` for one database every ``interval`` s,
    on a connection of its own (not counted: its name is not a worker's)."""

    def __init__(self, admin_url: str, database: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.admin_url = admin_url
        self.database = database
        self.interval = interval
        self.stopped = threading.Event()
        self.seen = Samples()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(
            self.admin_url, autocommit=True, application_name="fleet-sampler"
        ) as conn:
            while not self.stopped.wait(self.interval):
                self.sample(conn)

    def sample(self, conn: Any) -> None:
        seen = self.seen
        seen.samples += 1
        for pid, start, waited in conn.execute(WAITS_SQL, (self.database,)).fetchall():
            if start is not None:
                seconds = waited.total_seconds()
                seen.waits[(pid, start)] = max(seen.waits.get((pid, start), 0.0), seconds)
        rows = conn.execute(CONNECTIONS_SQL, (self.database,)).fetchall()
        fleet = 0
        for name, count in rows:
            if name.startswith(APP_PREFIX):
                fleet += count
                seen.most_by_name[name] = max(seen.most_by_name.get(name, 0), count)
        seen.most_fleet = max(seen.most_fleet, fleet)
        seen.most_total = max(seen.most_total, sum(c for _, c in rows))


def deadlocks(admin_url: str, database: str) -> int:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
    return int(row[0]) if row else 0


def named(url: str, name: str) -> str:
    """``url`` with ``application_name=name`` in its query."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}application_name={urllib.parse.quote(name)}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sweep_times(stage: Stage) -> list[float]:
    """Every sweep task's run time, in seconds, from every worker log of the run."""
    found: list[float] = []
    for proc in stage.orch.started:
        found += [float(m) for m in SWEEP_LINE.findall(proc.log_text())]
    return found


def start_fleet(stage: Stage, args: argparse.Namespace, url: str, broker: BrokerRestart) -> Any:
    """The ledgered workload, its workers (each naming its connections) and the beats."""
    box = stage.box
    outage = outage_for(box)
    stage.cleanups.append(outage.close)
    worker_url = outage.worker_url(url)
    env = {"CELERY_LEDGER_URL": worker_url, **TIME_SETTINGS}
    if not broker.unavailable:
        env["CELERY_BROKER_URL"] = broker.url
    work = stage.workload(KINDS[0], orders=args.tasks, concurrency=args.concurrency, env=env)
    procs = []
    for i in range(1, args.workers + 1):
        name = f"w{i}"
        procs.append(
            work.start_worker(name, env={"CELERY_LEDGER_URL": named(worker_url, APP_PREFIX + name)})
        )
    for i in range(1, args.beats + 1):
        beat_env = {**work.env, "CELERY_LEDGER_URL": named(worker_url, f"{APP_PREFIX}beat{i}")}
        procs.append(stage.orch.beat(f"beat-{i}", env=beat_env))
    wait_ready(procs)
    return work, outage


def chaos_run(work: Workload, stage: Stage, chaos: Chaos, duration: float) -> None:
    """Chaos until every order is accounted for (checked every few seconds: counting 20,000
    orders is not free), then ``verify``'s settle phase."""
    deadline = time.monotonic() + duration
    checked = time.monotonic()
    try:
        while time.monotonic() < deadline:
            chaos.tick()
            time.sleep(0.2)
            if time.monotonic() - checked > CHECK_EVERY:
                if _drained([work], stage.ledger_engine):
                    break
                checked = time.monotonic()
    finally:
        chaos.finish()
    work.finished = False
    work.mark_progress()
    stage.settle(SETTLE_SECONDS, interval=0.5, update=lambda: None, restart_stalled=STALL_SECONDS)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    phases = Phases(0, quiet=True)
    with contextlib.ExitStack() as stack:
        admin = PG_ADMIN.replace("+psycopg", "") if args.server == "shared" else ""
        if not admin:
            server = OwnPostgres()
            stack.callback(server.close)
            server.start()
            admin = server.url
        url = stack.enter_context(pg_database(admin))
        database = url.rsplit("/", 1)[1]
        with staged("celery-ledger-fleet", broker=args.broker, ledger=url, keep=False,
                    phases=phases) as stage:  # fmt: skip
            broker = BrokerRestart(stage.box.broker_url)
            stage.cleanups.append(broker.close)
            work, outage = start_fleet(stage, args, url, broker)
            sampler = Sampler(admin, database, args.sample)
            before = deadlocks(admin, database)
            sampler.start()
            started = time.monotonic()
            work.enqueue([rng.choice(GAPS) for _ in range(args.tasks)])
            log = ChaosLog()
            chaos = Chaos([work], rng, outage, log, broker)
            chaos_run(work, stage, chaos, args.duration)
            wall = time.monotonic() - started
            sampler.stopped.set()
            sampler.join(10)
            after = deadlocks(admin, database)
            sweeps = sweep_times(stage)
            stage.orch.stop_all()
            report = work.tally(stage.ledger_engine)
    return summary(args, report, sampler.seen, log, sweeps, after - before, wall)


def summary(
    args: argparse.Namespace,
    r: demo_app.RunReport,
    seen: Samples,
    log: ChaosLog,
    sweeps: list[float],
    new_deadlocks: int,
    wall: float,
) -> dict[str, Any]:
    waits = list(seen.waits.values())
    workers = {n: c for n, c in seen.most_by_name.items() if "/w" in n}
    return {
        "command": " ".join(["python", "benchmarks/fleet.py", *sys.argv[1:]]),
        "tasks": args.tasks,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "beats": args.beats,
        "completed": r.completed,
        "lost": r.lost,
        "failed": r.failed,
        "blocked": r.blocked,
        "duplicate_effects": r.duplicate_effects,
        "ledger_re_runs": r.ledger_duplicate_executions,
        "resumed": r.resumed,
        "seconds_to_last_effect": r.seconds,
        "throughput_per_s": round(r.completed / r.seconds, 1) if r.seconds else None,
        "wall_seconds": round(wall, 1),
        "chaos": log.counts(),
        "chaos_skipped": log.skipped,
        "lock_waits_seen": len(waits),
        "lock_wait_longest_ms": round(1000 * max(waits), 1) if waits else 0.0,
        "deadlocks": new_deadlocks,
        "sweeps": len(sweeps),
        "sweep_p50_ms": round(1000 * percentile(sweeps, 0.5), 1),
        "sweep_p99_ms": round(1000 * percentile(sweeps, 0.99), 1),
        "sweep_mean_ms": round(1000 * statistics.fmean(sweeps), 1) if sweeps else None,
        "connections_most_per_worker": workers,
        "connections_most_per_beat": {n: c for n, c in seen.most_by_name.items() if "/beat" in n},
        "connections_most_fleet": seen.most_fleet,
        "connections_most_database": seen.most_total,
        "samples": seen.samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--beats", type=int, default=2)
    parser.add_argument("--broker", default=REDIS_URL)
    parser.add_argument(
        "--server",
        choices=("own", "shared"),
        default="own",
        help="own: a PostgreSQL server of the run's own (max_connections 200); shared: "
        "CELERY_LEDGER_BENCH_PG's",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=1800.0, help="chaos for at most this")
    parser.add_argument("--sample", type=float, default=0.2, help="seconds between samples")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    result = run(args)
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["lost"] == 0 and result["deadlocks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

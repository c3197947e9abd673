"""A soak: many ledgered tasks with steps through a real worker and beat, retention and prune on.

    python benchmarks/soak.py                                   # 200,000 tasks (a quiet machine)
    python benchmarks/soak.py --tasks 30000 --sample-every 1500 # a reduced soak

A ``celery -A soak_app worker`` (prefork, ``--concurrency`` pool processes, Redis broker and
results, a scratch PostgreSQL ledger) and a ``celery -A soak_app beat`` on the same app drain
``--tasks`` tasks of ``--steps`` steps each. The sweep runs every ``--sweep-interval`` seconds
(beat sends it, a pool process runs it) and prunes settled entries older than ``--retention``
seconds, and their tombstones as long again: the ledger should reach a steady size. Beat also
sends one ledgered task every ``--beat-every`` seconds, a periodic task with its result on Redis.

A feeder keeps the queue between one and two samples deep (a soak measures the steady state, not
a backlog). Every ``--sample-every`` tasks taken from the queue, one sample:

- RSS, PSS and USS of each pool process and RSS of the worker's parent and of beat
  (``/proc/<pid>/smaps_rollup``; ``common.memory_of``);
- the ledger's tables: heap and index bytes (``pg_relation_size``, ``pg_indexes_size``), live
  and dead tuples, and the HOT-update ratio of ``ledger_entries`` (``n_tup_hot_upd /
  n_tup_upd`` of ``pg_stat_user_tables``, over the whole run);
- beat's Redis connections from Redis's side (``CLIENT LIST``, matched to beat's sockets through
  ``/proc``): the channels they are subscribed to (``sub``) and their output buffers (``omem``),
  and how many ``celery-task-meta-*`` channels the server has (``PUBSUB CHANNELS``);
- the p99 of claim latency over the claims since the previous sample: the wall time of
  ``LedgerStore.claim`` in the pool process (``soak_app``'s ``SOAK_CLAIM_LOG``).

Growth is the last sample over the first one after ``--warmup`` of the tasks. Prints the
samples and the summary; ``--json`` writes both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import redis
from common import (
    BENCH,
    PG_ADMIN,
    REDIS_URL,
    Report,
    exit_on_sigterm,
    format_rows,
    memory_of,
    pg_database,
)

from celery_ledger.harness.pgserver import OwnPostgres
from celery_ledger.harness.processes import Process, ProcessGroup, wait_for
from celery_ledger.harness.redisclients import clients_of

NAME = "soak"
TABLES = ("ledger_entries", "ledger_steps", "ledger_events", "ledger_outbox")
KINDS = ("rss", "pss", "uss")


def _stats(url: str) -> dict[str, Any]:
    """Sizes of the ledger's tables and the entries table's tuple counters."""
    out: dict[str, Any] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for table in TABLES:
            row = conn.execute(
                "SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid), "
                " s.n_live_tup, s.n_dead_tup, s.n_tup_upd, s.n_tup_hot_upd, s.autovacuum_count"
                " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid"
                " WHERE c.relname = %s",
                (table,),
            ).fetchone()
            if row is None:
                continue
            heap, index, live, dead, upd, hot, vacuums = row
            out[table] = {"heap": heap, "index": index, "live": live, "dead": dead}
            if table == "ledger_entries":
                out[table].update(upd=upd, hot=hot, autovacuums=vacuums)
    return out


def _redis_side(client: redis.Redis, pid: int) -> dict[str, int]:
    """What Redis holds for ``pid``'s connections, and its task-result channels."""
    return {
        **clients_of(client, pid),
        "channels": len(client.pubsub_channels("celery-task-meta-*")),
    }


def _claims(log_dir: Path) -> list[tuple[float, float]]:
    """Every (wall time, seconds) claim logged so far, by time."""
    out = []
    for path in log_dir.glob("claims-*.txt"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                out.append((float(parts[0]), float(parts[1])))
    return sorted(out)


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _sample(
    taken: int, worker: Process, beat: Process, url: str, client: redis.Redis, since: float
) -> dict[str, Any]:
    claims = [s for t, s in _claims(Path(worker.log_path).parent) if t > since]
    return {
        "taken": taken,
        "at": time.time(),
        "pool": {pid: memory_of(pid) for pid in worker.children()},
        "parent_rss": memory_of(worker.pid)["rss"],
        "beat_rss": memory_of(beat.pid)["rss"],
        "beat_redis": _redis_side(client, beat.pid),
        "db": _stats(url),
        "claim_p99_ms": p99(claims) * 1e3,
        "claims": len(claims),
    }


class Feeder:
    """Keeps ``queue`` between ``low`` and ``2 * low`` messages until ``total`` are sent."""

    def __init__(self, broker: str, queue: str, total: int, low: int) -> None:
        from celery import Celery

        self.sender = Celery("soak_sender", broker=broker)
        self.sender.conf.update(task_serializer="json", accept_content=["json"])
        self.client = redis.Redis.from_url(broker)
        self.queue, self.total, self.low = queue, total, low
        self.prefix = f"soak-{uuid.uuid4().hex[:8]}-"
        self.sent = 0

    def depth(self) -> int:
        return int(self.client.llen(self.queue))

    def top_up(self) -> None:
        depth = self.depth()
        if depth >= self.low or self.sent >= self.total:
            return
        n = min(self.total - self.sent, 2 * self.low - depth)
        with self.sender.producer_or_acquire() as producer:
            for i in range(self.sent, self.sent + n):
                self.sender.send_task(
                    "soak_app.stepped",
                    args=[i],
                    task_id=f"{self.prefix}{i}",
                    queue=self.queue,
                    producer=producer,
                )
        self.sent += n

    def taken(self) -> int:
        return self.sent - self.depth()

    def close(self) -> None:
        for queue in (self.queue, f"{self.queue}-sweep"):
            self.client.delete(queue, f"_kombu.binding.{queue}")
        self.sender.close()
        self.client.close()


def soak(args: argparse.Namespace, url: str, log_dir: Path) -> list[dict[str, Any]]:
    """Run the soak; return its samples."""
    queue = f"soak-{uuid.uuid4().hex[:8]}"
    days = args.retention / 86400.0
    env = {
        "SOAK_QUEUE": queue,
        "SOAK_BROKER_URL": args.broker,
        "SOAK_LEDGER_URL": url,
        "SOAK_CLAIM_LOG": str(log_dir),
        "SOAK_STEPS": str(args.steps),
        "SOAK_BEAT_EVERY": str(args.beat_every),
        "CELERY_LEDGER_RETENTION_DAYS": repr(days),
        "CELERY_LEDGER_TOMBSTONE_DAYS": repr(days),
        "CELERY_LEDGER_SWEEP_INTERVAL": str(args.sweep_interval),
    }
    feeder = Feeder(args.broker, queue, args.tasks, max(200, args.sample_every // 2))
    client = redis.Redis.from_url(args.broker)
    group = ProcessGroup(
        log_dir, app="soak_app", env=env, cwd=BENCH, pythonpath=[BENCH], stop_timeout=30.0
    )
    samples: list[dict[str, Any]] = []
    try:
        with group:
            worker = group.worker(
                "worker",
                queue=queue,
                node=f"soak-{uuid.uuid4().hex[:6]}@%h",
                concurrency=args.concurrency,
                loglevel="warning",
                extra=["-Q", f"{queue},{queue}-sweep"],
            )
            beat = group.beat("beat")
            # The worker logs at ``warning`` (an ``info`` line per task would be measured
            # too), so it never logs its ready line: the first sample waits for tasks.
            beat.wait_ready()
            since = time.time()
            next_at = args.sample_every
            while True:
                feeder.top_up()
                taken = feeder.taken()
                if not (worker.alive and beat.alive):
                    raise RuntimeError(f"worker or beat exited:\n{worker.log_tail()}")
                if taken >= next_at or (feeder.sent >= args.tasks and taken >= args.tasks):
                    samples.append(_sample(taken, worker, beat, url, client, since))
                    since = samples[-1]["at"]
                    print(_line(samples[-1]), flush=True)
                    next_at += args.sample_every
                    if taken >= args.tasks:
                        break
                time.sleep(0.2)
            wait_for(
                lambda: feeder.depth() == 0, timeout=60, interval=0.5, what="the queue drained"
            )
    finally:
        feeder.close()
        client.close()
    return samples


def _line(s: dict[str, Any]) -> str:
    pool = " ".join(
        f"{pid}:{m['rss'] // 1024}/{m['pss'] // 1024}/{m['uss'] // 1024}"
        for pid, m in sorted(s["pool"].items())
    )
    entries = s["db"].get("ledger_entries", {})
    rb = s["beat_redis"]
    return (
        f"{s['taken']:>7} pool(rss/pss/uss MiB) {pool} | beat {s['beat_rss'] // 1024} MiB"
        f" sub={rb['subscribed']} omem={rb['omem']} channels={rb['channels']} | entries"
        f" live={entries.get('live')} dead={entries.get('dead')}"
        f" heap={entries.get('heap', 0) // 1024}k idx={entries.get('index', 0) // 1024}k"
        f" | claim p99 {s['claim_p99_ms']:.1f} ms (n={s['claims']})"
    )


def summarize(samples: list[dict[str, Any]], warmup: float, tasks: int) -> Report:
    """Growth (last sample over the first after warm-up) and the other figures."""
    report = Report()
    after = [s for s in samples if s["taken"] >= warmup * tasks] or samples
    first, last = after[0], samples[-1]
    note = f"sample at {first['taken']:,} vs {last['taken']:,} tasks"
    for pid in sorted(set(first["pool"]) & set(last["pool"])):
        for kind in KINDS:
            a, b = first["pool"][pid][kind], last["pool"][pid][kind]
            report.add(NAME, f"{kind.upper()} pool process {pid}", b / 1024, "MiB", note=note)
            report.add(NAME, f"{kind.upper()} growth {pid}", (b / a - 1) * 100, "%", "<= 5", note)
    for label, key in (("worker parent RSS", "parent_rss"), ("beat RSS", "beat_rss")):
        a, b = first[key], last[key]
        report.add(NAME, label, b / 1024, "MiB", note=note)
        report.add(NAME, f"{label} growth", (b / a - 1) * 100, "%", note=note)
    for key in ("subscribed", "omem", "channels"):
        report.add(NAME, f"beat Redis {key}, max", max(s["beat_redis"][key] for s in samples), "")
    for table in TABLES:
        sizes = [s["db"].get(table) for s in after if s["db"].get(table)]
        if not sizes:
            continue
        for what in ("heap", "index"):
            values = [d[what] / 2**20 for d in sizes]
            report.add(
                NAME,
                f"{table} {what} first/max/last",
                values[-1],
                "MiB",
                note=(f"{values[0]:.2f} / {max(values):.2f} / {values[-1]:.2f}"),
            )
        report.add(NAME, f"{table} live tuples, last", sizes[-1]["live"], "rows")
        report.add(NAME, f"{table} dead tuples, max", max(d["dead"] for d in sizes), "rows")
    entries = last["db"]["ledger_entries"]
    report.add(
        NAME,
        "entries HOT updates",
        entries["hot"] / max(1, entries["upd"]) * 100,
        "%",
        note=f"{entries['hot']:,} of {entries['upd']:,} updates",
    )
    report.add(NAME, "entries autovacuums", entries["autovacuums"], "runs")
    report.add(NAME, "claim p99, first sample after warm-up", first["claim_p99_ms"], "ms")
    report.add(NAME, "claim p99, last sample", last["claim_p99_ms"], "ms")
    rate = (last["taken"] - samples[0]["taken"]) / max(1e-9, last["at"] - samples[0]["at"])
    report.add(NAME, "throughput", rate, "tasks/s")
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200_000)
    parser.add_argument("--sample-every", type=int, default=5000)
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of the tasks")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--retention", type=float, default=60.0, help="seconds")
    parser.add_argument("--sweep-interval", type=float, default=30.0, help="the default's")
    parser.add_argument("--beat-every", type=float, default=1.0)
    parser.add_argument("--broker", default=REDIS_URL)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--own-pg",
        action="store_true",
        help="a PostgreSQL server of the soak's own (initdb defaults: autovacuum on)",
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        admin = PG_ADMIN
        if args.own_pg:
            server = OwnPostgres()
            stack.callback(server.close)
            server.start()
            admin = server.url
        url = stack.enter_context(pg_database(admin))
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cl_soak_"))
        with psycopg.connect(url) as conn:
            autovacuum = conn.execute("SHOW autovacuum").fetchone()
        print(f"ledger {url}: autovacuum {autovacuum[0] if autovacuum else '?'}", flush=True)
        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(url)
        store.ensure_ready()
        store.dispose()
        samples = soak(args, url, Path(tmp))
    report = summarize(samples, args.warmup, args.tasks)
    print(format_rows(report.rows))
    for row in report.rows:
        if row.note and "/" in row.note and "first" in row.metric:
            print(f"{row.metric}: {row.note}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "samples": samples,
                    "rows": [r.as_dict() for r in report.rows],
                },
                default=str,
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

"""What a fleet-wide rate limit costs (design.md § "Fleet-wide rate limits"), side by side in
one invocation.

    python benchmarks/rate_limits.py                        # 2,000 claims, 2,000 tasks, 3 rounds
    python benchmarks/rate_limits.py --claims 500 --tasks 500 --rounds 1

- **Claim latency** (in this process, no worker; PostgreSQL and SQLite): ``store.claim`` of a
  new key, median and p99 over ``--claims`` claims, for a task without a limit, with a limit
  never reached (``1000000/s``: every claim takes its token, the bucket's one statement more),
  and with a limit always reached (``1/h``: every claim after the first is held, the bucket's
  statement plus the hold's transaction).
- **Throughput at -c 8** (one worker, ``-P prefork -c 8``, Redis broker, PostgreSQL ledger,
  ``benchmarks/throughput.py``'s drain): ``--tasks`` trivial ledgered tasks without a limit and
  with a limit never reached, alternating in each round; the ratio is the median's (target
  within 5 %, >= 0.95).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from common import REDIS_URL, Report, databases, exit_on_sigterm, format_rows, median
from throughput import drain

from celery_ledger.ledger import ClaimRequest, LedgerStore, Owner, TokenAsk

BENCH = "rate_limits"
NEVER_REACHED = "1000000/s"
#: The claim variants: (label, the bucket a claim asks of, or None).
CLAIMS = (
    ("no limit", None),
    ("limit never reached", TokenAsk("bench.never", 1e-6, NEVER_REACHED)),
    ("limit reached (held)", TokenAsk("bench.reached", 3600.0, "1/h")),
)


def claim_latency(url: str, ask: TokenAsk | None, n: int) -> tuple[float, float]:
    """(median, p99) milliseconds of ``store.claim`` of ``n`` new keys, after a warm-up."""
    store = LedgerStore(url)
    owner = Owner("bench@host", uuid.uuid4().hex, 1)
    run = uuid.uuid4().hex[:8]

    def claim(i: int) -> float:
        req = ClaimRequest(
            key=f"{run}{i:056d}",
            task_name="bench.claim",
            task_id=f"{run}-{i}",
            args_hash="task-id",
            snapshot='{"args":[1],"kwargs":{}}',
            side_effect="idempotent",
            owner=owner,
            lease_seconds=300.0,
        )
        if ask is not None:
            req = dataclasses.replace(req, rate=ask)
        started = time.perf_counter()
        store.claim(req)
        return (time.perf_counter() - started) * 1e3

    try:
        for i in range(min(100, n)):
            claim(n + i)  # warm-up: prepared statements, the bucket's row
        times = sorted(claim(i) for i in range(n))
    finally:
        store.dispose()
    return statistics.median(times), times[int(len(times) * 0.99) - 1]


def run(claims: int, tasks: int, rounds: int, broker: str, concurrency: int) -> Report:
    report = Report()
    with databases(["postgres", "sqlite"]) as urls:
        for backend, db in (("postgres", "PostgreSQL"), ("sqlite", "SQLite")):
            base = None
            for label, ask in CLAIMS:
                med, p99 = claim_latency(urls[backend], ask, claims)
                report.add(BENCH, f"claim, {label} ({db}) median", med, "ms")
                report.add(BENCH, f"claim, {label} ({db}) p99", p99, "ms")
                if base is None:
                    base = med
                else:
                    report.add(BENCH, f"claim ratio {label}/no limit ({db})", med / base, "x")
        rates: dict[str, list[float]] = {"no limit": [], "limit never reached": []}
        with tempfile.TemporaryDirectory(prefix="cl_bench_rate_") as tmp:
            for r in range(rounds):
                order = list(rates) if r % 2 == 0 else list(reversed(rates))
                for label in order:
                    extra = {"BENCH_SIDE_EFFECT": "idempotent"}
                    if label != "no limit":
                        extra["BENCH_RATE_LIMIT"] = NEVER_REACHED
                    out = drain(
                        "ledger",
                        tasks,
                        broker=broker,
                        ledger_url=urls["postgres"],
                        tmp=Path(tmp),
                        extra_env=extra,
                        concurrency=concurrency,
                    )
                    rates[label].append(out["rate"])
                    print(f"round {r + 1}: {label}: {out['rate']:.0f} tasks/s", flush=True)
    for label, values in rates.items():
        report.add(BENCH, f"throughput -c {concurrency}, {label}", median(values), "tasks/s")
    ratio = median(rates["limit never reached"]) / median(rates["no limit"])
    report.add(BENCH, "throughput ratio limit never reached/no limit", ratio, "x", ">= 0.95")
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default=REDIS_URL)
    parser.add_argument("-c", "--concurrency", type=int, default=8)
    args = parser.parse_args()
    report = run(args.claims, args.tasks, args.rounds, args.broker, args.concurrency)
    print(format_rows(report.rows))


if __name__ == "__main__":
    main()

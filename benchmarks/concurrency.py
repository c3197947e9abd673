"""What a concurrency key costs (docs/concurrency.md), with and without one, side by side.

    python benchmarks/concurrency.py                       # 2,000 claims, 3,000 tasks, -c 8
    python benchmarks/concurrency.py --claims 500 --tasks 1000 --rounds 1

Two measurements on one scratch PostgreSQL database, each taken without and with a key in the
same invocation, the variants alternating order round after round:

- **claim latency** (``LedgerStore`` in this process): the wall time of one ``claim`` of a new
  key, then of the run's end (``settle``; with a key ``settle_in_slot``, the settle and its
  handover in one transaction under the key's lock). With a key the claim is a transaction
  under the key's row lock instead of one statement; the limit is never reached (no waiter),
  so what is measured is the slot's bookkeeping, not a wait;
- **throughput** (a real ``celery worker -c 8`` draining a pre-filled Redis queue, as
  ``throughput.py``): the same ``LedgerTask`` without a key and with ``concurrency_key`` (task
  ``i`` on key ``i mod --keys``) and a limit (``--limit``) the run never reaches. The issue's
  target: within 5 % of no key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REDIS_URL, Report, format_rows, median, pg_database
from throughput import drain

BENCH = "concurrency"


def claim_and_end(
    url: str, keyed: bool, keys: int, limit: int
) -> Callable[[int], tuple[float, float]]:
    """One task's store calls: (claim ms, end ms) of a new key, with a concurrency key or not."""
    from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner, SlotAsk

    store = LedgerStore(url, durability="effects")
    owner = Owner(node="concurrency@bench", boot=uuid.uuid4().hex, pid=os.getpid())

    def run(i: int) -> tuple[float, float]:
        task_id = str(uuid.uuid4())
        slot = SlotAsk(f"bench:{i % keys}", limit) if keyed else None
        req = ClaimRequest(
            key=task_id,
            task_name="bench_app.noop",
            task_id=task_id,
            args_hash="0" * 64,
            snapshot=json.dumps({"args": [i], "kwargs": {}, "queue": "concurrency"}),
            side_effect="idempotent",
            owner=owner,
            lease_seconds=300.0,
            slot=slot,
        )
        t0 = time.perf_counter()
        claim = store.claim(req)
        t1 = time.perf_counter()
        if slot is None:
            store.settle(claim.key, claim.fence, EntryStatus.COMPLETED, result=str(i))
        else:  # the settle and its handover in one transaction under the key's lock
            store.settle_in_slot(slot, claim.key, claim.fence, EntryStatus.COMPLETED, result=str(i))
        t2 = time.perf_counter()
        return (t1 - t0) * 1000, (t2 - t1) * 1000

    return run


def latency(url: str, claims: int, rounds: int, keys: int, limit: int) -> Report:
    report = Report()
    runs = {v: claim_and_end(url, v == "key", keys, limit) for v in ("no key", "key")}
    got: dict[str, dict[str, list[float]]] = {v: {"claim": [], "end": []} for v in runs}
    for r in range(rounds):
        for variant in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            run = runs[variant]
            for i in range(50):  # warm up: connections, prepared statements
                run(i)
            timed = [run(i) for i in range(claims)]
            got[variant]["claim"].append(median([c for c, _ in timed]))
            got[variant]["end"].append(median([e for _, e in timed]))
            print(
                f"  round {r + 1} {variant}: claim {got[variant]['claim'][-1]:.3f} ms, "
                f"settle{' in the key lock' if variant == 'key' else ''} "
                f"{got[variant]['end'][-1]:.3f} ms (medians of {claims})",
                file=sys.stderr,
            )
    note = f"median per call of {claims}, median of {rounds} rounds; {keys} key(s), limit {limit}"
    for what, label in (("claim", "claim"), ("end", "settle (in the key's lock with a key)")):
        plain, keyed = median(got["no key"][what]), median(got["key"][what])
        report.add(BENCH, f"{label}, no key", plain, "ms", note=note)
        report.add(BENCH, f"{label}, concurrency key", keyed, "ms", note=note)
        report.add(BENCH, f"{label}: key / no key", keyed / plain, "x")
    return report


def throughput(
    url: str, tasks: int, rounds: int, concurrency: int, keys: int, limit: int, broker: str
) -> Report:
    report = Report()
    variants = {
        "no key": {},
        "concurrency key": {
            "BENCH_CONCURRENCY_KEYS": str(keys),
            "BENCH_CONCURRENCY_LIMIT": str(limit),
        },
    }
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="cl_conc_") as tmp:
        for r in range(rounds):
            for variant in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                out = drain(
                    "ledger",
                    tasks,
                    broker=broker,
                    tmp=Path(tmp),
                    concurrency=concurrency,
                    ledger_url=url,
                    extra_env={**variants[variant], "BENCH_SIDE_EFFECT": "idempotent"},
                )
                rates[variant].append(out["rate"])
                print(
                    f"  round {r + 1} {variant}: {out['rate']:.0f} tasks/s "
                    f"({tasks} in {out['span']:.2f}s)",
                    file=sys.stderr,
                )
    note = f"-c {concurrency}, {tasks} tasks, median of {rounds}; {keys} key(s), limit {limit}"
    plain, keyed = median(rates["no key"]), median(rates["concurrency key"])
    report.add(BENCH, "throughput, no key", plain, "tasks/s", note=note)
    report.add(BENCH, "throughput, concurrency key", keyed, "tasks/s", note=note)
    report.add(BENCH, "throughput: key / no key", keyed / plain, "x", target=">= 0.95")
    report.text["concurrency rounds"] = "\n".join(
        f"{v}: " + ", ".join(f"{x:.0f}" for x in xs) + " tasks/s" for v, xs in rates.items()
    )
    return report


def measure(opts: Any) -> Report:
    report = Report()
    with pg_database() as url:
        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(url)
        store.ensure_ready()
        store.dispose()
        report.extend(latency(url, opts.claims, opts.rounds, opts.keys, opts.limit))
        report.extend(
            throughput(
                url, opts.tasks, opts.rounds, opts.concurrency, opts.keys, opts.limit, opts.broker
            )
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=2_000)
    parser.add_argument("--tasks", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--keys", type=int, default=1, help="concurrency keys the tasks spread over"
    )
    parser.add_argument("--limit", type=int, default=1000, help="a limit no run reaches")
    parser.add_argument("--broker", default=REDIS_URL)
    opts = parser.parse_args()
    report = measure(opts)
    print(format_rows(report.rows))
    for title, text in report.text.items():
        print(f"\n{title}:\n{text}")


if __name__ == "__main__":
    main()

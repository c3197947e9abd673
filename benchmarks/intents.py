"""What a publish intent costs the producer: ``apply_async`` of a ledgered task with
``ledger_publish_intent`` on and off, side by side, on PostgreSQL and SQLite.

    python benchmarks/intents.py --tasks 2000 --rounds 3
    python benchmarks/intents.py --broker amqp://guest:guest@127.0.0.1:5672//

One process publishes N tasks to a queue of its own (no worker consumes it; the queue is
deleted afterwards). Time per ``apply_async`` = wall time / N, median of the rounds, which
alternate the order of the modes. The intent is one ``INSERT`` (plus its audit event) per
publish on the ledger; everything else is the same publish.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

from common import REDIS_URL, databases, median


def publish(broker: str, ledger: str, intents: bool, n: int) -> float:
    from celery_ledger import LedgerTask, create_app

    queue = f"bench-intents-{uuid.uuid4().hex[:8]}"
    app = create_app(
        "bench_intents",
        broker_url=broker,
        ledger_url=ledger,
        result_backend="cache+memory://",
        task_default_queue=queue,
        ledger_publish_intent=intents,
        task_ignore_result=True,
    )

    @app.task(base=LedgerTask, name="bench.intent", shared=False)
    def noop(i: int) -> int:
        return i

    noop.apply_async((0,))  # connect, declare, compile: not timed
    start = time.perf_counter()
    for i in range(n):
        noop.apply_async((i,))
    took = time.perf_counter() - start
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.queue_delete(queue)
    app.close()
    return took / n * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", default=REDIS_URL)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: dict[str, Any] = {}
    with databases(["postgres", "sqlite"]) as urls:
        for backend, url in urls.items():
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.rounds):
                for mode in (False, True) if r % 2 == 0 else (True, False):
                    times[mode].append(publish(args.broker, url, mode, args.tasks))
            off, on = median(times[False]), median(times[True])
            rows[backend] = {
                "without_ms": round(off, 3),
                "with_ms": round(on, 3),
                "intent_ms": round(on - off, 3),
                "ratio": round(on / off, 2),
            }
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return
    print(
        f"apply_async per task, broker {args.broker.split('@')[-1]}, {args.tasks} tasks, "
        f"median of {args.rounds}"
    )
    for backend, r in rows.items():
        print(
            f"  {backend:9} without intent {r['without_ms']:.3f} ms   with {r['with_ms']:.3f} ms"
            f"   intent {r['intent_ms']:+.3f} ms ({r['ratio']}x)"
        )


if __name__ == "__main__":
    main()

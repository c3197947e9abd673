"""What identity costs per delivery: ``LedgerTask.ledger_key`` (entry key and arguments hash).

    python benchmarks/identity.py                # 20,000 calls per case, median of 7 rounds
    python benchmarks/identity.py --calls 2000 --rounds 3

Every claim calls ``ledger_key`` once, in the pool process, before the claim's round trip (and a
publish with intents calls it once more). For an entry keyed by its task id, the key is the task
id's hash; the arguments hash (canonical JSON of ``[args, kwargs]``, then SHA-256) is what lets
a claim tell a fresh publish with other arguments from the first one (guarantees.md § "The hardening
faults", fault 13). The
cases are a typical task (an order id and an amount), a task with a 1 KiB string, one with a
list of 100 small dicts, and the same typical task keyed by ``key_from``. Pure CPU in this one
process: no database, no broker.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from celery import Celery

from celery_ledger import LedgerTask

CASES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "task id, (order_id, amount)": (("order-1234", 4200), {}),
    "task id, 1 KiB string": (("order-1234", "x" * 1024), {}),
    "task id, 100 small dicts": (([{"sku": f"s{i}", "qty": i} for i in range(100)],), {}),
}


def build() -> tuple[LedgerTask, LedgerTask]:
    app = Celery("bench_identity", broker="memory://", set_as_current=False)

    @app.task(base=LedgerTask, bind=True, name="bench.by_task_id")
    def by_task_id(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @app.task(base=LedgerTask, bind=True, name="bench.by_key", key_from=("order_id",))
    def by_key(self: Any, order_id: str, amount: int) -> None:
        return None

    return by_task_id, by_key  # type: ignore[return-value]


def per_call_us(fn: Any, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean time of one call, in microseconds."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    by_task_id, by_key = build()
    rows = []
    for name, (args, kwargs) in CASES.items():
        rows.append(
            (
                name,
                per_call_us(
                    lambda a=args, k=kwargs: by_task_id.ledger_key(a, k, "tid-1"),
                    opts.calls,
                    opts.rounds,
                ),
            )
        )
    rows.append(
        (
            "key_from=('order_id',), (order_id, amount)",
            per_call_us(
                lambda: by_key.ledger_key(("order-1234", 4200), {}, "tid-1"),
                opts.calls,
                opts.rounds,
            ),
        )
    )
    width = max(len(name) for name, _ in rows)
    print(f"{'case':<{width}}  us per ledger_key()")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.2f}")


if __name__ == "__main__":
    main()

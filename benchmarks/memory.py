"""Memory per worker pool process: plain Celery vs ``LedgerTask``, side by side.

    python benchmarks/memory.py                 # 2,000 tasks per mode
    python benchmarks/memory.py --tasks 200

Runs the ``bench_app`` worker (``-P prefork -c 2``, Redis broker and results, PostgreSQL ledger
for the ledgered mode) through ``--tasks`` tasks, then reads ``/proc/<pid>/smaps_rollup`` of
each pool process while the worker is still up: RSS (what ``ps`` shows) and PSS (RSS with
pages shared after fork divided among their sharers, the fairer per-process figure). The plain
mode imports nothing of celery-ledger, so the difference includes SQLAlchemy, psycopg and the
ledger's modules, its engine and connection pool.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from common import REDIS_URL, Report, Worker, format_rows, memory_of, pg_database
from throughput import drain

BENCH = "memory"


def _children_memory(worker: Worker) -> dict[str, Any]:
    children = worker.children()
    if not children:
        raise RuntimeError(f"worker {worker.pid} has no pool processes")
    per_child = [memory_of(pid) for pid in children]
    return {
        "children": len(children),
        "rss": sum(m["rss"] for m in per_child) / len(per_child),
        "pss": sum(m["pss"] for m in per_child) / len(per_child),
        "uss": sum(m["uss"] for m in per_child) / len(per_child),
        "parent_rss": memory_of(worker.pid)["rss"],
    }


def run(tasks: int = 2000, broker: str = REDIS_URL) -> Report:
    report = Report()
    measured: dict[str, dict[str, Any]] = {}
    with pg_database() as ledger_url, tempfile.TemporaryDirectory(prefix="cl_mem_") as tmp:
        from ledger import LedgerStore

        store = LedgerStore(ledger_url)
        store.ensure_ready()
        store.dispose()
        for mode in ("plain", "ledger"):
            out = drain(mode, tasks, broker=broker, tmp=Path(tmp),
                        ledger_url=ledger_url if mode == "ledger" else None,
                        on_drained=_children_memory)
            measured[mode] = out["extra"]
    plain, ledger = measured["plain"], measured["ledger"]
    note = f"mean of {plain['children']} pool processes after {tasks} tasks"
    for kind in ("rss", "pss", "uss"):
        label = kind.upper()
        report.add(BENCH, f"{label} per pool process, plain", plain[kind] / 1024, "MiB",
                   note=note)
        report.add(BENCH, f"{label} per pool process, ledger", ledger[kind] / 1024, "MiB",
                   note=note)
        report.add(BENCH, f"{label} ratio ledger/plain", ledger[kind] / plain[kind], "x",
                   target="<= 1.10")
    report.add(BENCH, "RSS worker parent, plain", plain["parent_rss"] / 1024, "MiB")
    report.add(BENCH, "RSS worker parent, ledger", ledger["parent_rss"] / 1024, "MiB")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--broker", default=REDIS_URL)
    args = parser.parse_args()
    print(format_rows(run(args.tasks, args.broker).rows))


if __name__ == "__main__":
    main()

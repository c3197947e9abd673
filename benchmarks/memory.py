"""Memory per worker pool process: plain Celery vs ``LedgerTask``, side by side.

    python benchmarks/memory.py                 # 2,000 tasks per variant
    python benchmarks/memory.py --tasks 200

Runs the ``bench_app`` worker (``-P prefork -c 2``, Redis broker and results, PostgreSQL ledger
for the ledgered mode) through ``--tasks`` tasks, then reads ``/proc/<pid>/smaps_rollup`` of
each pool process while the worker is still up:

- RSS: every page the process maps, shared or not (what ``ps`` shows);
- PSS: RSS with each shared page divided among the processes that share it;
- USS: the pages only this process has, i.e. what one more pool process costs.

Six variants, because a ledger app by default freezes the garbage collector before each fork
(``ledger_freeze_gc_before_fork``), which also saves memory of Celery's own:

- ``plain``: plain Celery as shipped. It imports nothing of celery-ledger
  (``celery_ledger.cli.plugin`` keeps the ``celery ledger`` sub-command from loading the ledger into
  every ``celery`` command);
- ``plain+freeze``: the same, with the same ``gc.freeze()`` idiom (``bench_app``);
- ``ledger``: ``LedgerTask`` with its defaults;
- ``ledger-nofreeze``: ``LedgerTask`` with ``ledger_freeze_gc_before_fork`` off;
- ``floor``: plain Celery whose task writes to PostgreSQL through bare psycopg (``bench_app``'s
  ``floor`` mode): what a pool process pays for a PostgreSQL driver alone, with no SQLAlchemy
  and no ledger;
- ``floor+freeze``: the same, with the same ``gc.freeze()`` idiom: the floor the ledger's
  defaults are measured against (any design may freeze before it forks).

``ledger / plain`` is what a Celery user sees when adopting the ledger; ``ledger /
plain+freeze`` is what the ledger's own modules (SQLAlchemy, psycopg, the ledger) cost.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from common import REDIS_URL, Report, exit_on_sigterm, format_rows, memory_of, pg_database
from throughput import drain

from celery_ledger.harness.processes import Process

BENCH = "memory"

#: variant -> (bench_app mode, extra worker environment)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "plain": ("plain", {}),
    "plain+freeze": ("plain", {"BENCH_FREEZE": "1"}),
    "ledger": ("ledger", {}),
    "ledger-nofreeze": ("ledger", {"CELERY_LEDGER_FREEZE_GC_BEFORE_FORK": "0"}),
    "floor": ("floor", {}),
    "floor+freeze": ("floor", {"BENCH_FREEZE": "1"}),
}
KINDS = ("rss", "pss", "uss")
#: (variant, over variant, target, what the ratio says), reported for each of ``KINDS``.
RATIOS = (
    ("ledger", "plain", "<= 1.10", "ledger defaults vs plain Celery as shipped"),
    ("ledger", "plain+freeze", "", "what the ledger's own modules cost"),
    ("floor", "plain", "", "a bare psycopg connection, no SQLAlchemy, no ledger"),
    ("floor+freeze", "plain", "", "the floor with the ledger's gc.freeze() before fork"),
    ("ledger", "floor+freeze", "", "what the ledger costs over its floor"),
)


def _children_memory(worker: Process) -> dict[str, Any]:
    children = worker.children()
    if not children:
        raise RuntimeError(f"worker {worker.pid} has no pool processes")
    per_child = [memory_of(pid) for pid in children]
    out: dict[str, Any] = {kind: sum(m[kind] for m in per_child) / len(per_child) for kind in KINDS}
    out["children"] = len(children)
    out["parent_rss"] = memory_of(worker.pid)["rss"]
    return out


def run(tasks: int = 2000, broker: str = REDIS_URL) -> Report:
    report = Report()
    measured: dict[str, dict[str, Any]] = {}
    with pg_database() as ledger_url, tempfile.TemporaryDirectory(prefix="cl_mem_") as tmp:
        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(ledger_url)
        store.ensure_ready()
        store.dispose()
        from bench_app import create_floor_table

        create_floor_table(ledger_url)
        for variant, (mode, env) in VARIANTS.items():
            out = drain(
                mode,
                tasks,
                broker=broker,
                tmp=Path(tmp),
                extra_env=env,
                ledger_url=ledger_url if mode != "plain" else None,
                on_drained=_children_memory,
            )
            measured[variant] = out["extra"]
    note = f"mean of {measured['plain']['children']} pool processes after {tasks} tasks"
    for kind in KINDS:
        label = kind.upper()
        for variant in VARIANTS:
            report.add(
                BENCH,
                f"{label} per pool process, {variant}",
                measured[variant][kind] / 1024,
                "MiB",
                note=note,
            )
        for top, bottom, target, why in RATIOS:
            report.add(
                BENCH,
                f"{label} ratio {top}/{bottom}",
                measured[top][kind] / measured[bottom][kind],
                "x",
                target=target,
                note=why,
            )
    for variant in ("plain", "ledger"):
        report.add(
            BENCH, f"RSS worker parent, {variant}", measured[variant]["parent_rss"] / 1024, "MiB"
        )
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--broker", default=REDIS_URL)
    args = parser.parse_args()
    print(format_rows(run(args.tasks, args.broker).rows))


if __name__ == "__main__":
    main()

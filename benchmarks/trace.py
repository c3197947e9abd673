"""Where a ledgered task waits that a floor task does not: a wall-clock trace
(docs/benchmarks.md § "The hidden millisecond", part 1).

    python benchmarks/trace.py --tasks 1000 -c 2
    python benchmarks/trace.py --tasks 1000 -c 2 --variants floor-intent,ledger-effects

Each variant of ``throughput.py --matrix`` is drained by a real worker with ``BENCH_TRACE`` set
(``bench_app.install_trace``): every pool process writes, per task, ``time.time()`` stamps at
Celery's ``task_prerun`` and ``task_postrun`` and around each ledger write (claim, settle,
renew, step), floor write, result-backend store and heartbeat call inside; the worker's parent
writes when it received each message, ran the ledger's receipt hold, handed it to the pool,
saw it accepted, saw it succeed and acknowledged it. Joined by task id, the per-task means
(the first tenth of the drain left out) are printed as one breakdown per variant:

- ``cycle per pool process``: wall time per task of one pool process over the drain;
- ``in the pool process``: prerun to postrun, split into its writes and the rest (the body,
  Celery's own trace work, and whatever waits there: the GIL, a lock);
- ``between tasks``: a pool process's postrun to its next prerun (the result back to the
  parent, the parent's ack and fetch of the next message, and the dispatch to the child);
- the parent's stamps, which share one thread for every pool process.

The tracing itself costs each variant alike (a JSON line per task and process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import REDIS_URL, exit_on_sigterm, pg_database
from throughput import VARIANTS, drain

DEFAULT_VARIANTS = (
    "plain",
    "floor-async",
    "floor-intent",
    "ledger-effects-idempotent",
    "ledger-effects",
)


def load(directory: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The pool processes' task lines, and the parent's stamps by task id."""
    children: list[dict[str, Any]] = []
    parent: dict[str, dict[str, Any]] = defaultdict(dict)
    for path in directory.glob("trace-*.jsonl"):
        for raw in path.read_text().splitlines():
            line = json.loads(raw)
            if "parent" in line:
                stamps = parent[line["id"]]
                stamps.setdefault(line["what"], (line["t0"], line["t1"]))
            else:
                children.append(line)
    return children, parent


def breakdown(
    children: list[dict[str, Any]], parent: dict[str, dict[str, Any]]
) -> dict[str, float]:
    """Mean milliseconds per task of each phase (the first tenth of the drain left out)."""
    children.sort(key=lambda c: c["prerun"])
    skip = len(children) // 10
    kept = children[skip:]
    ms: dict[str, list[float]] = defaultdict(list)
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for c in children:
        by_pid[c["pid"]].append(c)
    for tasks in by_pid.values():
        tasks.sort(key=lambda c: c["prerun"])
        part = tasks[len(tasks) // 10 :]
        if len(part) > 1:
            ms["cycle per pool process"].append(
                (part[-1]["postrun"] - part[0]["prerun"]) / (len(part) - 1) * 1000
            )
        for a, b in zip(part, part[1:], strict=False):
            ms["between tasks (postrun -> next prerun)"].append((b["prerun"] - a["postrun"]) * 1000)
    for c in kept:
        busy = (c["postrun"] - c["prerun"]) * 1000
        ms["in the pool process (prerun -> postrun)"].append(busy)
        spent: dict[str, float] = defaultdict(float)
        for phase, t0, t1 in c["phases"]:
            spent[phase] += (t1 - t0) * 1000
        for phase in (
            "claim",
            "floor write",
            "settle",
            "result backend",
            "renew_lease",
            "write_step",
            "heartbeat.register",
            "heartbeat.unregister",
        ):
            ms[f"  {phase}"].append(spent.get(phase, 0.0))
        ms["  the rest (body, Celery's trace)"].append(busy - sum(spent.values()))
        p = parent.get(c["id"], {})
        if "dispatched" in p:
            ms["parent: dispatched -> prerun"].append((c["prerun"] - p["dispatched"][1]) * 1000)
        if "succeeded" in p:
            ms["parent: postrun -> success seen"].append((p["succeeded"][0] - c["postrun"]) * 1000)
        for what in ("received", "receipt hold", "dispatched", "accepted", "succeeded", "acked"):
            if what in p:
                ms[f"parent: {what} (own time)"].append((p[what][1] - p[what][0]) * 1000)
        if "received" in p and "dispatched" in p:
            ms["parent: received -> dispatched"].append(
                (p["dispatched"][0] - p["received"][1]) * 1000
            )
    return {k: statistics.fmean(v) for k, v in ms.items() if v}


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("-c", "--concurrency", type=int, default=2)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--broker", default=REDIS_URL)
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    results: dict[str, dict[str, float]] = {}
    rates: dict[str, float] = {}
    with pg_database() as ledger_url, tempfile.TemporaryDirectory(prefix="cl_trace_") as tmp:
        from bench_app import create_floor_table

        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(ledger_url)
        store.ensure_ready()
        store.dispose()
        create_floor_table(ledger_url)
        for variant in variants:
            mode, env = VARIANTS[variant]
            directory = Path(tmp) / variant
            directory.mkdir()
            out = drain(
                mode,
                args.tasks,
                broker=args.broker,
                tmp=Path(tmp),
                concurrency=args.concurrency,
                ledger_url=ledger_url if mode != "plain" else None,
                extra_env={**env, "BENCH_TRACE": str(directory)},
            )
            rates[variant] = out["rate"]
            results[variant] = breakdown(*load(directory))
            print(f"  {variant}: {out['rate']:.0f} tasks/s", file=sys.stderr)
    rows = sorted({k for r in results.values() for k in r}, key=_order)
    width = max(len(r) for r in rows)
    print(f"{'ms per task (mean)':<{width}} | " + " | ".join(f"{v:>12}" for v in variants))
    print(f"{'tasks/s (traced)':<{width}} | " + " | ".join(f"{rates[v]:>12.0f}" for v in variants))
    for row in rows:
        cells = [results[v].get(row) for v in variants]
        print(
            f"{row:<{width}} | "
            + " | ".join(f"{c:>12.3f}" if c is not None else f"{'-':>12}" for c in cells)
        )


_ORDER = (
    "cycle",
    "in the pool",
    "  ",
    "between",
    "parent: dispatched",
    "parent: postrun",
    "parent: received ->",
    "parent:",
)


def _order(row: str) -> tuple[int, str]:
    for i, prefix in enumerate(_ORDER):
        if row.startswith(prefix):
            return (i, "" if prefix == "  " else row)
    return (len(_ORDER), row)


if __name__ == "__main__":
    main()

"""The ledger's CPU per task, layer by layer, in one process (docs/benchmarks.md § "The hidden
millisecond"): where the gap to the
floor is the schema's and where it is the ledger's Python.

    python benchmarks/layers.py                  # 5,000 tasks per layer, median of 3 rounds
    python benchmarks/layers.py --tasks 500 --rounds 1

Every layer runs the same 0 ms task in this process, on one scratch PostgreSQL database, with
every commit asynchronous (``synchronous_commit = off`` for every connection, as the
``-async`` variants of ``throughput.py --matrix``), so that the figures are CPU, not the
flush. A task through Celery's tracer (``celery.app.trace.build_tracer``, what a pool process
runs for each message; the result backend's store is left out of every layer alike):

- ``plain``: plain Celery;
- ``floor``: the two-write floor (``bench_app``'s ``floor`` mode: an ``INSERT`` and an
  ``UPDATE`` of a one-column row on a bare psycopg connection);
- ``schema floor``: the ledger's own claim and settle statements, with the row the ledger
  writes and their audit events, on that bare connection (``BENCH_FLOOR_SQL=ledger``): what the
  contract's schema costs with none of the ledger's Python;
- ``LedgerTask``: the task on ``LedgerTask`` (``side_effect="idempotent"``, no steps), the
  whole ledger; ``LedgerTask, default class``: the same task as ``non_idempotent`` (the
  default: its claim is its intent and goes on the durable connection, here asynchronous too);

and, without the tracer, ``store: claim + settle`` (and ``store, default class``):
``LedgerStore.claim`` and ``LedgerStore.settle`` called directly, the store layer alone. The
``LedgerTask`` minus the store is the task layer (key, arguments hash, snapshot, attempt,
heartbeat, result encoding); the store minus the schema floor's statements is the store's own
Python.

A worker spends more than this per task (the parent's receive, ack and result; the pool's
result pipe): ``throughput.py --matrix`` measures the whole, this splits the ledger's part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Report, format_rows, median, per_task_ms, pg_database

#: Every connection of this run commits without waiting for the flush (``measure`` sets it
#: before any connection opens; libpq reads it at connect).
ASYNC_COMMITS = "-c synchronous_commit=off"

BROKER = "memory://"
BACKEND = "cache+memory://"
WARMUP = 200


def traced(mode: str, url: str, env: dict[str, str]) -> Callable[[int], Any]:
    """One task of ``bench_app`` in ``mode``, run through Celery's tracer as a pool process
    runs it; the result backend's store is a no-op in every mode alike."""
    import bench_app
    from celery.app.trace import build_tracer

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        app = bench_app.make_app(
            mode, broker=BROKER, queue="layers", ledger_url=url, backend=BACKEND
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if mode == "ledger":
        from celery_ledger import runtime

        runtime.fix_events(app)  # as a worker does when it starts (worker_init)
    task = app.tasks["bench_app.noop"]
    task.backend.store_result = lambda *a, **k: None  # type: ignore[method-assign]
    task.backend.mark_as_done = lambda *a, **k: None  # type: ignore[method-assign]
    tracer = build_tracer(task.name, task, app=app, eager=False, hostname="layers@bench")

    def run(i: int) -> Any:
        task_id = str(uuid.uuid4())
        request = {
            "id": task_id,
            "task": task.name,
            "hostname": "layers@bench",
            "delivery_info": {"routing_key": "layers", "exchange": ""},
            "is_eager": False,
            "retries": 0,
        }
        result = tracer(task_id, (i,), {}, request)
        if result.info is not None:  # a failed trace would measure the failure path
            raise RuntimeError(f"{mode} task failed: {result.retval!r}")
        return result

    return run


def store_only(url: str, side_effect: str = "idempotent") -> Callable[[int], Any]:
    """``LedgerStore.claim`` + ``settle`` of a new key, as a ``LedgerTask`` makes them."""
    from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner

    store = LedgerStore(url, durability="effects")
    owner = Owner(node="layers@bench", boot=uuid.uuid4().hex, pid=os.getpid())

    def run(i: int) -> Any:
        task_id = str(uuid.uuid4())
        claim = store.claim(
            ClaimRequest(
                key=task_id,
                task_name="bench_app.noop",
                task_id=task_id,
                args_hash="0" * 64,
                snapshot=json.dumps({"args": [i], "kwargs": {}, "queue": "layers"}),
                side_effect=side_effect,
                owner=owner,
                lease_seconds=300.0,
            )
        )
        store.settle(claim.key, claim.fence, EntryStatus.COMPLETED, result=str(i))
        return claim

    return run


def measure(tasks: int, rounds: int) -> Report:
    os.environ["PGOPTIONS"] = ASYNC_COMMITS
    report = Report()
    with pg_database() as url:
        import bench_app

        from celery_ledger.ledger import LedgerStore

        store = LedgerStore(url)
        store.ensure_ready()
        store.dispose()
        bench_app.create_floor_table(url)
        sa_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
        layers: dict[str, Callable[[int], Any]] = {
            "plain": traced("plain", sa_url, {}),
            "floor": traced("floor", url, {}),
            "schema floor": traced("floor", url, {"BENCH_FLOOR_SQL": "ledger"}),
            "store: claim + settle": store_only(sa_url),
            "LedgerTask": traced("ledger", sa_url, {"BENCH_SIDE_EFFECT": "idempotent"}),
            "store, default class": store_only(sa_url, "non_idempotent"),
            "LedgerTask, default class": traced(
                "ledger", sa_url, {"BENCH_SIDE_EFFECT": "non_idempotent"}
            ),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in layers}
        for _ in range(rounds):
            for name, run in layers.items():
                samples[name].append(per_task_ms(run, tasks, warmup=WARMUP))
    cpu = {name: median([s[0] for s in found]) for name, found in samples.items()}
    wall = {name: median([s[1] for s in found]) for name, found in samples.items()}
    for name in layers:
        report.add("layers", f"{name}: CPU per task", cpu[name], "ms")
        report.add("layers", f"{name}: wall per task", wall[name], "ms")
    report.add(
        "layers",
        "the schema's statements over the floor's",
        cpu["schema floor"] - cpu["floor"],
        "ms CPU",
    )
    report.add(
        "layers",
        "the store's Python over the schema floor",
        cpu["store: claim + settle"] - (cpu["schema floor"] - cpu["plain"]),
        "ms CPU",
    )
    report.add(
        "layers",
        "the task layer over the store",
        cpu["LedgerTask"] - cpu["plain"] - cpu["store: claim + settle"],
        "ms CPU",
    )
    report.add(
        "layers",
        "the task layer over the store, default class",
        cpu["LedgerTask, default class"] - cpu["plain"] - cpu["store, default class"],
        "ms CPU",
    )
    report.add(
        "layers",
        "the default class over idempotent (whole task)",
        cpu["LedgerTask, default class"] - cpu["LedgerTask"],
        "ms CPU",
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    report = measure(opts.tasks, opts.rounds)
    print(format_rows(report.rows))


if __name__ == "__main__":
    main()

"""What recording a chain's next link with the settle costs (design.md § "Canvas: chains,
groups, chords, callbacks").

    python benchmarks/canvas.py                 # PostgreSQL (scratch db) and SQLite (temp file)
    python benchmarks/canvas.py --tasks 200 --backend sqlite

Drives the store directly in this one process (no worker, no broker): a ``completed`` settle
of an entry without links (``settle``: one statement) against the same settle recording one
next link as an outbox child (``settle_with_links``: one transaction, the settle and one
insert), alternated entry by entry in one run; medians, their ratio, and the statements each
makes. The link's publish after the commit is the outbox's (a broker round trip plus one
mark, the same as any ``self.send`` child: benchmarks/steps.py and docs/benchmarks.md
§ "Transaction steps").
"""

from __future__ import annotations

import argparse
import time
import uuid

from common import Report, StatementCounter, databases, exit_on_sigterm, format_rows, median

from celery_ledger.codec import encode
from celery_ledger.ledger import Child, ClaimRequest, EntryStatus, LedgerStore, Owner

BENCH = "canvas"


def _claim(store: LedgerStore, owner: Owner) -> tuple[str, int]:
    key = uuid.uuid4().hex
    claim = store.claim(
        ClaimRequest(
            key=key,
            task_name="bench.link",
            task_id=key,
            args_hash="task-id",
            snapshot='{"args": [], "kwargs": {}}',
            side_effect="non_idempotent",
            owner=owner,
            lease_seconds=60.0,
            group_id="bench-group",
            parent_id="bench-parent",
        )
    )
    return key, int(claim.fence)


def settles(store: LedgerStore, tasks: int) -> tuple[float, float, float, float]:
    """Return (median ms of a settle, median ms of a settle with one link, statements of
    each)."""
    owner = Owner("bench@canvas", "boot", 1)
    result = encode([1, 2], limit=1 << 20, what="result")
    payload = encode(
        {"args": [[1, 2], 3], "kwargs": {}, "options": {"parent_id": "p", "chain": None}},
        limit=1 << 20,
        what="link",
    )
    plain, linked, plain_stmts, linked_stmts = [], [], [], []
    with StatementCounter(store.engine, store.fast) as counter:
        for _ in range(tasks):
            key, fence = _claim(store, owner)
            counter.reset()
            started = time.perf_counter()
            store.settle(key, fence, EntryStatus.COMPLETED, result=result)
            plain.append((time.perf_counter() - started) * 1000)
            plain_stmts.append(counter.count)

            key, fence = _claim(store, owner)
            link = Child(uuid.uuid4().hex, "bench.link", payload, 0)
            counter.reset()
            started = time.perf_counter()
            store.settle_with_links(key, fence, result=result, links=[link])
            linked.append((time.perf_counter() - started) * 1000)
            linked_stmts.append(counter.count)
    return median(plain), median(linked), median(plain_stmts), median(linked_stmts)


def run(backends: tuple[str, ...], tasks: int) -> Report:
    report = Report()
    with databases(list(backends)) as urls:
        for name, url in urls.items():
            store = LedgerStore(url)
            store.ensure_ready()
            settles(store, 10)  # warm the compiled statements and the connection
            plain, linked, plain_stmts, linked_stmts = settles(store, tasks)
            note = f"median of {tasks}, alternated in one run"
            report.add(BENCH, f"settle completed ({name})", plain, "ms", note=note)
            report.add(BENCH, f"settle completed + next link ({name})", linked, "ms", note=note)
            report.add(BENCH, f"settle with link / settle ({name})", linked / plain, "x")
            report.add(BENCH, f"settle statements ({name})", plain_stmts, "stmts")
            report.add(BENCH, f"settle with link statements ({name})", linked_stmts, "stmts")
            store.dispose()
    return report


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args()
    backends = ("postgres", "sqlite") if args.backend == "both" else (args.backend,)
    print(format_rows(run(backends, args.tasks).rows))


if __name__ == "__main__":
    main()

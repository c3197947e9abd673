"""Concurrency keys (docs/concurrency.md) with real ``celery worker`` and ``celery beat``
processes over Redis and PostgreSQL: a limit of one per customer holds across workers and
through whole-worker SIGKILLs, and every task completes.

Every wait is bounded, every process is stopped, pass or fail.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from slots_app import RATE_PER_CUSTOMER, SLOT_TASKS

from celery_ledger.ledger import EntryStatus, LedgerStore
from helpers import business_key
from procs import WaitTimeout, processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

TASK = "slots_app.per_customer"


def runs(log: Path, killed: dict[str, float]) -> dict[str, list[tuple[float, float, str]]]:
    """Each run's (start, end, token) per customer. A run with no end was cut short by the
    SIGKILL of its worker: it ended when that worker was killed (which the test recorded)."""
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, float] = {}
    for line in log.read_text().splitlines():
        row = json.loads(line)
        if row["what"] == "start":
            starts[row["token"]] = row
        else:
            ends[row["token"]] = row["at"]
    by_customer: dict[str, list[tuple[float, float, str]]] = {}
    for token, row in starts.items():
        end = ends.get(token)
        if end is None:
            node = row["host"].split("-")[0]
            assert node in killed, f"run {row} has no end and its worker was not killed"
            end = killed[node]
        by_customer.setdefault(row["customer"], []).append((row["at"], end, token))
    return by_customer


def overlaps(by_customer: dict[str, list[tuple[float, float, str]]]) -> list[str]:
    """The runs of one customer that started before an earlier one of it ended."""
    found = []
    for customer, spans in by_customer.items():
        spans.sort()
        latest_end, latest = spans[0][1], spans[0][2]
        for start, end, token in spans[1:]:
            if start < latest_end:
                found.append(
                    f"{customer}: {token} started {latest_end - start:.3f}s before {latest} ended"
                )
            if end > latest_end:
                latest_end, latest = end, token
    return found


def test_one_per_customer_across_workers_and_sigkills(tmp_path, redis, pg_url):
    """200 tasks over 20 customers, a limit of one per customer, two workers of four pool
    processes each and beat's sweep. Each worker is SIGKILLed mid-run and replaced. Never
    two runs of one customer overlap (their start/end intervals, read from the log), and
    all 200 complete."""
    customers, per = 20, 10
    log = tmp_path / "slots.log"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_SWEEP_INTERVAL="1",
        CELERY_LEDGER_LEASE_SECONDS="6",
        TEST_VISIBILITY_TIMEOUT="5",
        TEST_SLOT_LOG=str(log),
    )
    client = client_app(env)
    store = LedgerStore(pg_url)
    killed: dict[str, float] = {}
    keys = [business_key(TASK, customer=f"c{c}", n=n) for n in range(per) for c in range(customers)]
    with processes(tmp_path, env) as procs:
        workers = {
            "w1": procs.worker("w1", concurrency=4, extra=SLOT_TASKS),
            "w2": procs.worker("w2", concurrency=4, extra=SLOT_TASKS),
        }
        procs.beat()
        for n in range(per):
            for c in range(customers):
                client.send_task(TASK, args=(f"c{c}", n, 0.3))

        def started() -> int:
            return log.read_text().count('"start"') if log.exists() else 0

        # SIGKILL each worker in the middle of the work, and start another in its place.
        for i, (name, proc) in enumerate(workers.items()):
            wait_for(lambda i=i: started() >= 40 + 50 * i, timeout=120, what="runs to start")
            proc.kill()
            killed[name] = time.time()
            procs.worker(f"{name}b", concurrency=4, extra=SLOT_TASKS)

        def done() -> int:
            return sum(store.stats().by_status.get(s, 0) for s in ("completed",))

        try:
            wait_for(lambda: done() == len(keys), timeout=300, what="all 200 to complete")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}; by status: {store.stats().by_status}") from None
    statuses = {store.get_entry(k).status for k in keys}
    assert statuses == {EntryStatus.COMPLETED}
    by_customer = runs(log, killed)
    assert sorted(by_customer) == sorted(f"c{c}" for c in range(customers))
    assert overlaps(by_customer) == []
    cut = sum(1 for spans in by_customer.values() for _ in spans) - len(keys)
    assert cut >= 1, "no SIGKILL cut a run short: the test proved nothing about dead holders"
    print(f"\n{len(keys)} tasks, {cut} run(s) cut short by the SIGKILLs and run again")
    store.dispose()


def over_the_rate(by_customer: dict[str, list[tuple[float, float, str]]], rate: float) -> list[str]:
    """The windows in which one customer started more runs than the limit admits: at most
    ``rate * W + 1`` claims in any W seconds (docs/rate-limits.md), plus one for the
    difference between a claim's database time and its run's start in the log."""
    found = []
    for customer, spans in by_customer.items():
        starts = sorted(s for s, _, _ in spans)
        for i, first in enumerate(starts):
            for j in range(i + 1, len(starts)):
                runs_in = j - i + 1
                if runs_in > rate * (starts[j] - first) + 2:
                    found.append(f"{customer}: {runs_in} runs in {starts[j] - first:.3f}s")
    return found


def test_a_concurrency_key_and_a_rate_limit_on_one_task(tmp_path, redis, pg_url):
    """30 tasks over 3 customers, one at a time and two a second per customer, on two
    workers of four pool processes: never two runs of one customer at once, never more
    starts than the rate admits, and all 30 complete."""
    task, customers, per = "slots_app.per_customer_rated", 3, 10
    log = tmp_path / "slots.log"
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_SWEEP_INTERVAL="1",
        TEST_SLOT_LOG=str(log),
    )
    client = client_app(env)
    store = LedgerStore(pg_url)
    keys = [business_key(task, customer=f"c{c}", n=n) for n in range(per) for c in range(customers)]
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=4, extra=SLOT_TASKS)
        procs.worker("w2", concurrency=4, extra=SLOT_TASKS)
        procs.beat()
        for n in range(per):
            for c in range(customers):
                client.send_task(task, args=(f"c{c}", n, 0.05))

        def done() -> int:
            return store.stats().by_status.get("completed", 0)

        try:
            wait_for(lambda: done() == len(keys), timeout=120, what="all 30 to complete")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}; by status: {store.stats().by_status}") from None
    assert {store.get_entry(k).status for k in keys} == {EntryStatus.COMPLETED}
    by_customer = runs(log, {})
    assert sorted(by_customer) == [f"c{c}" for c in range(customers)]
    assert overlaps(by_customer) == []
    assert over_the_rate(by_customer, RATE_PER_CUSTOMER) == []
    store.dispose()

"""The ledger's Prometheus collector: values, cache, failure, and the standalone endpoint."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_ledger.harness.processes import ProcessGroup
from celery_ledger.ledger import ClaimRequest, EntryStatus, Gate, LedgerStore, Owner, StepStatus
from celery_ledger.metrics import LedgerCollector

OWNER = Owner(node="celery@test", boot="b1", pid=1)
OTHER = Owner(node="celery@other", boot="b2", pid=2)


def claim(
    store: LedgerStore, key: str, task: str, *, lease: float = 60.0, owner: Owner = OWNER
) -> Any:
    return store.claim(
        ClaimRequest(
            key=key,
            task_name=task,
            task_id=f"id-{key}",
            args_hash="task-id",
            snapshot=None,
            side_effect="non_idempotent",
            owner=owner,
            lease_seconds=lease,
        )
    )


def populate(store: LedgerStore) -> None:
    """One entry in each interesting state, and one duplicate execution of a step."""
    step = ("charge", "h", 0)
    done = claim(store, "k-done", "shop.order")
    assert store.write_step("k-done", done.fence, step, seq=0, status=StepStatus.STARTED)
    assert store.write_step(
        "k-done", done.fence, step, seq=0, status=StepStatus.COMPLETED, output="1"
    )
    assert store.settle("k-done", done.fence, EntryStatus.COMPLETED, result="1")
    parked = claim(store, "k-blocked", "shop.order")
    assert store.settle("k-blocked", parked.fence, EntryStatus.BLOCKED, reason="ambiguous")
    claim(store, "k-expired", "shop.mail", lease=-1.0)  # running, lease already over
    claim(store, "k-live", "shop.mail")
    # A step started under fence 1, then (the lease expired) started again under fence 2
    # without any verdict: one unauthorized re-execution.
    first = claim(store, "k-dup", "shop.order", lease=-1.0)
    assert store.write_step("k-dup", first.fence, step, seq=0, status=StepStatus.STARTED)
    second = claim(store, "k-dup", "shop.order", owner=OTHER)
    assert second.gate is Gate.TAKEOVER
    assert store.write_step("k-dup", second.fence, step, seq=0, status=StepStatus.STARTED)


def samples(text: str, prefix: str = "celery_ledger_") -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the ``prefix`` samples in an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(collector: LedgerCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    return samples(generate_latest(registry).decode())


def value(found: dict[tuple[str, tuple], float], name: str, **labels: str) -> float | None:
    return found.get((f"celery_ledger_{name}", tuple(sorted(labels.items()))))


def test_collector_reports_the_ledger_aggregates(store: LedgerStore) -> None:
    populate(store)
    found = scrape(LedgerCollector(store))
    assert value(found, "up") == 1
    assert value(found, "entries", status="completed") == 1
    assert value(found, "entries", status="blocked") == 1
    assert value(found, "entries", status="running") == 3
    assert value(found, "entries", status="interrupted") == 0  # every status, zeros included
    assert value(found, "task_entries", task="shop.order", status="running") == 1
    assert value(found, "task_entries", task="shop.mail", status="running") == 2
    assert value(found, "task_entries", task="shop.order", status="completed") == 1
    assert value(found, "expired_leases") == 1
    assert value(found, "blocked_entries") == 1
    assert value(found, "unsettled_interruptions") == 1
    assert value(found, "duplicate_executions") == 1
    assert value(found, "duplicate_execution_ratio") == 0.2  # 1 duplicate over 5 entries
    oldest = value(found, "oldest_running_age_seconds")
    assert oldest is not None and 0 <= oldest < 60


def test_aggregates_are_cached_for_the_ttl(store: LedgerStore) -> None:
    now = [100.0]
    collector = LedgerCollector(store, ttl=5.0, clock=lambda: now[0])
    claim(store, "k1", "shop.order")
    assert value(scrape(collector), "entries", status="running") == 1
    claim(store, "k2", "shop.order")
    now[0] += 4.9
    found = scrape(collector)
    assert value(found, "entries", status="running") == 1, "served from the cache"
    assert value(found, "stats_age_seconds") == pytest.approx(4.9)
    assert collector.computations == 1
    now[0] += 0.2
    assert value(scrape(collector), "entries", status="running") == 2
    assert collector.computations == 2


def test_registering_does_not_touch_the_ledger() -> None:
    def factory() -> LedgerStore:
        raise AssertionError("the store was opened at registration")

    collector = LedgerCollector(factory)
    CollectorRegistry(auto_describe=True).register(collector)
    assert collector.computations == 0


def test_an_unreadable_ledger_reports_down_without_failing_the_page(tmp_path: Path) -> None:
    # An empty database that was never migrated: the read-only store refuses it.
    store = LedgerStore(f"sqlite:///{tmp_path / 'empty.sqlite3'}", migrate=False)
    now = [0.0]
    collector = LedgerCollector(store, ttl=5.0, clock=lambda: now[0])
    found = scrape(collector)
    assert value(found, "up") == 0
    assert value(found, "entries", status="completed") is None, "no stale or made-up numbers"
    scrape(collector)
    assert collector.computations == 1, "a failure is cached too: a down ledger is not hammered"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from celery_ledger.cli.main import main; main()", *args]


@pytest.mark.processes
def test_standalone_endpoint_serves_the_same_gauges(store: LedgerStore, tmp_path: Path) -> None:
    populate(store)
    expected = scrape(LedgerCollector(store))
    port = free_port()
    argv = cli("--url", store.url, "metrics", "--port", str(port), "--address", "127.0.0.1")
    with ProcessGroup(tmp_path) as group:
        proc = group.spawn("metrics", argv)
        proc.wait_log("celery-ledger metrics on", timeout=30)
        served = samples(http_get(f"http://127.0.0.1:{port}/metrics"))
    assert_same_gauges(served, expected)


def test_metrics_once_prints_the_gauges(store: LedgerStore) -> None:
    populate(store)
    out = subprocess.run(
        cli("--url", store.url, "metrics", "--once"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = samples(out)
    assert value(found, "blocked_entries") == 1
    assert value(found, "duplicate_executions") == 1


#: Samples that describe the scrape itself rather than the ledger.
VOLATILE = (
    "celery_ledger_stats_query_seconds",
    "celery_ledger_stats_age_seconds",
    "celery_ledger_oldest_running_age_seconds",
)


def assert_same_gauges(
    a: dict[tuple[str, tuple], float], b: dict[tuple[str, tuple], float]
) -> None:
    assert set(a) == set(b)
    stable_a = {k: v for k, v in a.items() if k[0] not in VOLATILE}
    stable_b = {k: v for k, v in b.items() if k[0] not in VOLATILE}
    assert stable_a == stable_b
    for k in a:
        if k[0] == "celery_ledger_oldest_running_age_seconds":
            assert a[k] == pytest.approx(b[k], abs=30)

"""A fleet's connection budget (docs/operations.md § "Deploying"; ``ledger/budget.py``).

Real prefork workers on a PostgreSQL ledger whose URL names their connections
(``?application_name=``), counted in ``pg_stat_activity``; each connection is attributed to the
worker process holding its socket (``/proc``), so the main process and each pool process are
counted apart. And ``doctor``'s ``connections`` check against the server's ``max_connections``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from celery_ledger.ledger import LedgerStore
from celery_ledger.ledger.budget import (
    MAIN_PROCESS,
    MAIN_PROCESS_PEAK,
    POOL_PROCESS_PEAK,
    Fleet,
)
from helpers import effect_counts
from procs import Process, processes, test_env, wait_for
from servers import PG_ADMIN_URL

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ORDERS = 24
PG_PORT_HEX = ":1538"  # 5432, as /proc/net/tcp writes a remote port


def sessions(database: str, name: str) -> dict[int, str]:
    """client port -> state of ``database``'s sessions named ``name``."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port, state FROM pg_stat_activity "
            "WHERE datname = %s AND application_name = %s",
            (database, name),
        ).fetchall()
    return {int(port): state for port, state in rows}


def local_ports(pid: int) -> set[int]:
    """Local ports of ``pid``'s TCP sockets to port 5432 (its own and inherited ones)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[2].endswith(PG_PORT_HEX):
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def held_by_process(worker: Process, ports: set[int]) -> tuple[int, dict[int, int]]:
    """(the main process's sessions, pool pid -> its sessions). A pool process inherits the
    main process's sockets through fork: those count for the main process only."""
    main = local_ports(worker.pid) & ports
    return len(main), {pid: len((local_ports(pid) & ports) - main) for pid in worker.children()}


def run_orders(env: dict[str, str], count: int) -> None:
    """Send ``count`` orders to the test's queue and wait until each has its receipt."""
    from celery import Celery

    tag = uuid.uuid4().hex[:6]
    ids = [f"{tag}-{i}" for i in range(count)]
    sender = Celery(broker=env["CELERY_BROKER_URL"])
    try:
        for order_id in ids:
            sender.send_task("tests_app.order", args=(order_id, 1), queue=env["TEST_QUEUE"])
    finally:
        sender.close()
    url = env["TEST_EFFECTS_URL"]

    def done() -> bool:
        counts = effect_counts(url)
        return all(counts.get((o, "receipt")) == 1 for o in ids)

    wait_for(done, timeout=60, what=f"{count} orders completed")


def test_a_prefork_node_holds_what_the_budget_says(tmp_path: Path, pg_url: str, redis: str) -> None:
    name = f"budget-{uuid.uuid4().hex[:6]}"
    database = pg_url.rsplit("/", 1)[1]
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=f"{pg_url}?application_name={name}",
        effects_url=f"sqlite:///{tmp_path / 'effects.sqlite3'}",
    )
    concurrency = 3
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=concurrency)
        run_orders(env, ORDERS)
        ports = set(sessions(database, name))
        main, pool = held_by_process(worker, ports)
        assert MAIN_PROCESS <= main <= MAIN_PROCESS_PEAK, (main, pool)
        assert len(pool) == concurrency
        # Every pool process ran a task (24 orders, 3 processes): its hot-path connection,
        # with the pooled one only if a claim found its entry (these orders are sent with no
        # publish intent) and one more if a lease renewal overlapped a write.
        assert all(1 <= n <= POOL_PROCESS_PEAK for n in pool.values()), pool
        fleet = Fleet(1, concurrency, beats=0)
        assert len(ports) == main + sum(pool.values()) <= fleet.peak
        assert len(ports) == main + sum(pool.values())


def test_max_connections_bounds_a_threads_pool(tmp_path: Path, pg_url: str, redis: str) -> None:
    """Under ``-P threads`` every task shares one process: ``ledger_max_connections=2`` keeps
    it to one hot-path connection and one pooled, where the defaults keep up to four."""
    name = f"budget-{uuid.uuid4().hex[:6]}"
    database = pg_url.rsplit("/", 1)[1]
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=f"{pg_url}?application_name={name}",
        effects_url=f"sqlite:///{tmp_path / 'effects.sqlite3'}",
        CELERY_LEDGER_MAX_CONNECTIONS="2",
    )
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=6, extra=["-P", "threads"])
        run_orders(env, ORDERS)
        held = sessions(database, name)
        assert 1 <= len(held) <= 2, held


def doctor(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CELERY_LEDGER_URL": url}
    env.pop("CELERY_BROKER_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "celery_ledger.cli.main", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def connections_check(url: str, *args: str) -> tuple[int, dict[str, str]]:
    done = doctor(url, "--json", *args)
    assert "Traceback" not in done.stderr, done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    return done.returncode, checks["connections"]


def test_doctor_fails_a_fleet_the_server_cannot_hold(pg_url: str) -> None:
    store = LedgerStore(pg_url)
    store.ensure_ready()
    store.dispose()
    with psycopg.connect(PG_ADMIN_URL) as conn:
        allowed = int(conn.execute("SHOW max_connections").fetchone()[0])  # type: ignore[index]
    workers = allowed // 2 + 1  # -c 1: 3 each, held by the main and one pool process
    code, check = connections_check(pg_url, "--fleet", f"{workers}x1+2")
    assert code == 1
    assert check["status"] == "FAIL", check
    assert f"max_connections {allowed}" in check["reason"]
    assert "\n" not in check["reason"]
    code, check = connections_check(pg_url, "--fleet", "1x1")
    assert check["status"] == "PASS", check


def test_doctor_refuses_a_fleet_it_cannot_read(pg_url: str) -> None:
    code, check = connections_check(pg_url, "--fleet", "six by four")
    assert code == 1
    assert check["status"] == "FAIL"
    assert "WORKERSxCONCURRENCY" in check["reason"]


def test_an_application_name_in_the_url_names_the_connections(pg_url: str) -> None:
    from sqlalchemy import text

    from celery_ledger.ledger.engine import make_engine

    for url, name in ((f"{pg_url}?application_name=node-7", "node-7"), (pg_url, "celery-ledger")):
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SHOW application_name")).scalar() == name
        finally:
            engine.dispose()

"""``celery-ledger demo``, run as a subprocess exactly as a newcomer runs it.

Each run starts real workers and beat, SIGKILLs them, and counts effects; the assertions are
on what the JSON reports: the ledgered run lost and duplicated nothing, and the plain runs'
numbers are there (whatever they are). The signal tests check that Ctrl-C and SIGTERM leave
no process and no data directory behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text

from celery_ledger.ledger.engine import make_engine
from procs import wait_for

pytestmark = pytest.mark.processes

BIN = Path(sys.executable).parent
COUNTS = ("accepted", "completed", "lost", "charged_twice", "duplicate_effects", "blocked")


def demo(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    return subprocess.run(
        [str(BIN / "celery-ledger"), "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def check_report(proc: subprocess.CompletedProcess[str], orders: int) -> dict[str, Any]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    runs = report["runs"]
    assert set(runs) == {"plain", "acks_late", "ledgered"}
    led = runs["ledgered"]
    assert led["accepted"] == orders
    assert led["lost"] == 0, led
    assert led["duplicate_effects"] == 0 and led["charged_twice"] == 0, led
    assert led["completed"] + led["blocked"] + led["failed"] == orders
    for blocked in led["blocked_orders"]:  # parked, with the step that may have run
        assert blocked["reason"] and blocked["ambiguous_steps"]
    # The crash schedule really ran against the ledgered worker, and recovery resumed work.
    assert any(c.startswith("SIGKILL whole worker") for c in led["crashes"]), led["crashes"]
    assert led["resumed"] >= 1
    for run in runs.values():  # the plain runs' numbers are reported, whatever they are
        for name in COUNTS:
            assert isinstance(run[name], int) and run[name] >= 0, (name, run)
        assert run["accepted"] == orders
        assert run["completed"] + run["lost"] + run["blocked"] + run["failed"] == orders
        assert run["seconds"] > 0
    return report


def demo_processes(data_dir: str) -> list[int]:
    """Pids of live processes started for the demo that uses ``data_dir``."""
    marker = f"CELERY_LEDGER_DATA_DIR={data_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_demo_on_the_embedded_default_loses_and_duplicates_nothing():
    started = time.monotonic()
    proc = demo("--json")
    report = check_report(proc, 24)
    assert report["broker"] == "filesystem://"
    assert report["ledger"].startswith("sqlite:///")
    assert not report["kept"] and not Path(report["data_dir"]).exists()
    # About a minute on an idle 2-core machine: printed, not asserted (a loaded machine is
    # slower; ``demo``'s own timeout, 150 s, bounds a run that hangs).
    print(f"demo: {report['seconds']}s in the report, {time.monotonic() - started:.0f}s in all")
    # Progress went to stderr, one line per phase, so stdout is only the JSON.
    for phase in ("enqueue", "crash", "recover", "verify"):
        assert phase in proc.stderr


def test_demo_on_redis_and_postgresql_cleans_up_after_itself(redis, pg_url):
    proc = demo("--json", "--orders", "16", "--broker", redis, "--ledger", pg_url)
    report = check_report(proc, 16)
    assert report["broker"].startswith("redis://")
    assert report["ledger"].startswith("postgresql")
    import redis as redis_client

    client = redis_client.Redis.from_url(redis)
    try:
        assert not list(client.scan_iter(match="celery-ledger-demo-*")), "Redis keys left"
    finally:
        client.close()
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM ledger_entries")).scalar_one() == 0
            assert conn.execute(text("SELECT COUNT(*) FROM ledger_steps")).scalar_one() == 0
            assert not [
                t for t in inspect(conn).get_table_names() if t.startswith("celery_ledger_demo_")
            ]
    finally:
        engine.dispose()


def test_demo_keep_prints_a_table_and_the_commands_to_open_the_ledger():
    proc = demo("--orders", "12", "--keep")
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    data_dir = re.search(r"^data: (\S+)", out, re.M)
    assert data_dir, out
    try:
        for line in ("orders completed", "lost", "charged twice", "time taken"):
            assert re.search(rf"^{line}\s", out, re.M), (line, out)
        assert re.search(r"^orders completed\s+\d+/12\s+\d+/12\s+12/12$", out, re.M), out
        assert "OK: the ledgered run lost nothing and duplicated nothing" in out
        commands = re.findall(r"^  (celery-ledger --url '\S+' list)$", out, re.M)
        assert commands, out
        url = re.search(r"--url '(\S+)'", commands[0]).group(1)
        listed = subprocess.run(
            [str(BIN / "celery-ledger"), "--url", url, "list", "--json", "--limit", "100"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)["entries"]
        orders = [e for e in rows if e["task"] == "celery_ledger.demo.ledgered_order"]
        children = [e for e in rows if e["task"] == "celery_ledger.demo.ledgered_notify"]
        assert sum(1 for e in orders if e["status"] == "completed") == 12
        # Orders 0, 5 and 10 each send one child through the outbox; each child completed.
        assert [e["status"] for e in children] == ["completed"] * 3, children
        assert len(orders) + len(children) == len(rows), rows
    finally:
        import shutil

        shutil.rmtree(data_dir.group(1), ignore_errors=True)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process_and_removes_the_data(signum):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    proc = subprocess.Popen(
        [str(BIN / "celery-ledger"), "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        first = proc.stdout.readline() + proc.stdout.readline()
        data_dir = re.search(r"^data: (\S+)", first, re.M)
        assert data_dir, first
        # Wait until the workers and beat are up (they are what must be cleaned up).
        wait_for(
            lambda: len(demo_processes(data_dir.group(1))) >= 4,
            timeout=90,
            what="the demo's worker and beat processes",
        )
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + signum, err
    assert "every process the demo started is stopped" in err
    assert demo_processes(data_dir.group(1)) == []
    assert not Path(data_dir.group(1)).exists()

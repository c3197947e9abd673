"""design.md § "Durability follows effects": the ledger's PostgreSQL crashes under verify's
workload.

``celery-ledger verify --crash-ledger`` starts a PostgreSQL server of its own (``initdb`` into
a temporary directory, a free port, the machine's binaries), runs the ledgered and the plain
workload against real workers, and crashes that server three times with ``pg_ctl stop -m
immediate``, restarting it each time. In both durability modes: no duplicate effect, nothing
lost. What the crashes cost (entries parked as ``blocked``) is printed per mode for the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from servers import CI

pytestmark = pytest.mark.processes

BIN = Path(sys.executable).parent
TASKS = 80


def have_postgres_binaries() -> bool:
    from celery_ledger.harness.pgserver import PostgresUnavailable, find_bindir

    try:
        find_bindir()
    except PostgresUnavailable:
        return False
    return True


@pytest.mark.parametrize("durability", ["effects", "every-write"])
def test_three_ledger_crashes_lose_nothing_and_duplicate_nothing(durability: str) -> None:
    if not have_postgres_binaries():
        why = "no PostgreSQL server binaries (initdb, pg_ctl) on this machine"
        if CI:
            pytest.fail(f"{why}, and CI=true requires them", pytrace=False)
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    proc = subprocess.run(
        [
            str(BIN / "celery-ledger"),
            "verify",
            "--crash-ledger",
            "--crashes",
            "3",
            "--durability",
            durability,
            "--tasks",
            str(TASKS),
            "--duration",
            "90",
            "--seed",
            "20",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(proc.stdout)
    led = report["runs"]["ledgered"]
    print(
        json.dumps(
            {
                "durability": durability,
                "crashes": report["ledger_crashes"],
                **{
                    f: led[f]
                    for f in ("completed", "lost", "blocked", "failed", "resumed", "seconds")
                },
                "blocked_orders": led["blocked_orders"],
            }
        )
    )
    assert report["ok"] is True and report["durability"] == durability
    assert report["ledger_crashes"] == 3
    assert report["chaos"]["counts"] == {"ledger-crash": 3}
    assert led["lost"] == 0, led
    assert led["duplicate_effects"] == 0 and led["charged_twice"] == 0, led
    assert led["ledger_duplicate_executions"] == 0, led
    # Every order is accounted for: completed, or parked for an operator (never running).
    assert led["completed"] + led["blocked"] + led["failed"] == TASKS, led


def test_crash_ledger_with_a_ledger_url_is_refused_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    proc = subprocess.run(
        [str(BIN / "celery-ledger"), "verify", "--crash-ledger", "--ledger", "sqlite:///x.db"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--crash-ledger runs a PostgreSQL server of its own: give no --ledger" in proc.stderr


def test_crash_ledger_without_postgres_binaries_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env["CELERY_LEDGER_PG_BINDIR"] = str(tmp_path)  # holds no initdb
    proc = subprocess.run(
        [str(BIN / "celery-ledger"), "verify", "--crash-ledger"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "Error: no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin; "
        "set CELERY_LEDGER_PG_BINDIR to their directory"
    ]

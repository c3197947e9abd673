"""What a ledger worker keeps in memory: no ledger modules in ``celery`` commands that do not
use them, and pool processes forked with the garbage collector frozen (design.md § "Memory")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from procs import processes, test_env
from test_delivery import client_app


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(out.stdout.split())


def test_celery_command_line_does_not_load_the_ledger() -> None:
    """Celery imports every ``celery.commands`` plugin into every command line, workers
    included; ours must not bring SQLAlchemy, psycopg or the ledger with it."""
    loaded = _modules_after("import celery.bin.celery")
    assert "celery_ledger.cli.plugin" in loaded, "the celery ledger plugin was not loaded at all"
    assert not loaded & {
        "sqlalchemy",
        "psycopg",
        "celery_ledger.ledger",
        "celery_ledger.recovery",
        "alembic",
    }, loaded


def test_celery_ledger_subcommand_still_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery", "ledger", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    for command in ("list", "show", "release", "resume", "sweep", "stats", "doctor", "verify"):
        assert f"  {command} " in out.stdout, out.stdout


def test_package_exports_load_on_first_use() -> None:
    loaded = _modules_after("import celery_ledger")
    assert "sqlalchemy" not in loaded
    loaded = _modules_after("from celery_ledger import LedgerTask, create_app, AmbiguousStep")
    assert {"sqlalchemy", "celery_ledger.ledger"} <= loaded


@pytest.mark.processes
@pytest.mark.parametrize("setting, frozen", [("1", True), ("0", False)])
def test_pool_processes_are_forked_with_the_gc_frozen(
    tmp_path: Path, redis: str, setting: str, frozen: bool
) -> None:
    """A real prefork worker on Redis (Celery signals before-fork from its event-loop pool
    only): its pool process reports the frozen generation it inherited, and none when
    ``ledger_freeze_gc_before_fork`` is off."""
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        CELERY_LEDGER_FREEZE_GC_BEFORE_FORK=setting,
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        count = app.send_task("tests_app.gc_frozen").get(timeout=60)
    assert (count > 1000) is frozen, count


@pytest.mark.processes
def test_pool_processes_do_not_load_the_orm(tmp_path: Path, redis: str) -> None:
    """A ledgered task and its steps run on SQLAlchemy Core: the ORM (6 MiB of modules, shared
    by every process forked from the worker) is loaded only by a transaction step that asks
    for a ``Session``. A real prefork worker on Redis, the ledger on SQLite."""
    env = test_env(tmp_path, broker=redis, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        loaded = app.send_task("tests_app.modules_loaded", args=["sqlalchemy"]).get(timeout=60)
    assert "sqlalchemy.engine" in loaded, loaded
    assert not [m for m in loaded if m.startswith("sqlalchemy.orm")], loaded

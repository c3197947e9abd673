"""One runtime object per app (docs/design.md § "Layout and the one import name"): everything
the ledger keeps for a Celery app is one ``LedgerRuntime``, under one attribute of the app, and
recovery sets nothing on the app it is given.

In one process (an app of the embedded default, a sweep with a stand-in app), and in a real
prefork worker's pool process after it ran ledgered tasks that published children.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from runtime_app import RUNTIME_TASKS
from test_recovery import RecordingApp, make_interrupted

from celery_ledger import create_app, runtime
from celery_ledger.app import sweep_now
from celery_ledger.ledger import LedgerStore
from celery_ledger.recovery import publish, run_sweep
from procs import processes, test_env
from test_delivery import client_app


def ledger_attributes(app: Any) -> list[str]:
    """The app's own attributes whose names mention the ledger."""
    return sorted(name for name in vars(app) if "ledger" in name.lower())


def test_an_app_carries_one_runtime_whatever_the_ledger_used(tmp_path: Path) -> None:
    app = create_app("one", data_dir=tmp_path / "data", ledger_url=f"sqlite:///{tmp_path}/l.db")
    ledger = runtime.runtime_of(app)
    assert ledger.parts()["installed"] is True and ledger.parts()["settings"] is False
    # Every part, through the functions task.py and the others call ...
    settings = runtime.settings_for(app)
    store = runtime.store_for(app)
    assert runtime.snapshot_cipher(app) is None
    assert runtime.publish_intent_enabled(app) is True
    runtime.fix_events(app)
    assert runtime.events_enabled(app) is False
    assert sweep_now(app).errors == 0
    with publish.confirmed(app) as connection:  # as every re-send of recovery's does
        assert connection is None  # the embedded broker needs no confirms
    # ... is one object's, made once.
    assert runtime.runtime_of(app) is ledger
    assert settings is ledger.settings and store is ledger.store
    assert ledger_attributes(app) == [runtime.ATTRIBUTE]
    parts = ledger.parts()
    assert parts["settings"] and parts["store"] and not parts["cipher"]
    assert parts["events_fixed"] is False
    assert parts["publisher"] == {"confirms": False, "connection": False}
    store.dispose()


def test_an_app_without_the_ledger_is_given_no_runtime_by_asking() -> None:
    app = Celery("plain")
    assert runtime.is_installed(app) is False
    runtime.reset(app)
    assert ledger_attributes(app) == []


def test_reset_reads_the_settings_again_and_keeps_the_app_installed(tmp_path: Path) -> None:
    app = create_app("again", data_dir=tmp_path / "data", ledger_url=f"sqlite:///{tmp_path}/a.db")
    first = runtime.settings_for(app)
    runtime.store_for(app)
    app.conf.ledger_url = f"sqlite:///{tmp_path}/b.db"
    assert runtime.settings_for(app) is first  # read once ...
    runtime.reset(app)
    assert runtime.settings_for(app).url.endswith("b.db")  # ... and again after a reset
    assert runtime.store_for(app).url.endswith("b.db")
    assert runtime.is_installed(app)
    runtime.store_for(app).dispose()


def test_recovery_sets_nothing_on_the_app_it_publishes_with(tmp_path: Path) -> None:
    """Recovery keeps its confirmed-publish state keyed by the app, not on it."""
    store = LedgerStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    make_interrupted(store, 3)
    app = RecordingApp()
    report = run_sweep(store, app, lease_seconds=60, max_resumes=5, retention_days=7)
    assert report.resumed == 3 and len(app.sent) == 3
    assert ledger_attributes(app) == []
    store.dispose()


@pytest.mark.processes
@pytest.mark.redis
def test_a_pool_process_app_carries_one_ledger_attribute_after_running_tasks(
    tmp_path: Path, redis: str
) -> None:
    """A real prefork worker (one pool process) runs a ledgered task whose step sends two
    ledgered children (a confirmed publish from the pool process), then the children; the
    same pool process then reports its app: one ledger attribute, and every part built."""
    fernet = pytest.importorskip("cryptography.fernet")
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        CELERY_LEDGER_SNAPSHOT_KEYS=fernet.Fernet.generate_key().decode(),
    )
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1, extra=RUNTIME_TASKS)
        children = app.send_task("runtime_app.parent", kwargs={"tag": "t1"}).get(timeout=60)
        assert [app.AsyncResult(c).get(timeout=60) for c in children] == [0, 1]
        state = app.send_task("runtime_app.ledger_state").get(timeout=60)
    assert state["attributes"] == [runtime.ATTRIBUTE], state
    parts = state["parts"]
    assert parts["installed"] and parts["settings"] and parts["store"] and parts["cipher"]
    assert parts["events_fixed"] is False  # fixed at the worker's start (no -E)
    assert parts["publisher"]["confirms"] is False  # asked once: Redis needs no confirms
    assert isinstance(parts["boot"], str) and len(parts["boot"]) == 32

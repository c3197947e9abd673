"""Celery canvas with ledgered members under SIGKILL (issue 17), with real workers.

Broker and results: Redis (the result backend's chord counter) unless a test says otherwise;
ledger and effects: the test's own PostgreSQL database. Each effect is a row in
``test_effects`` (no unique constraint), so a duplicate is a count of 2. Crash points fire
once (``CELERY_LEDGER_CRASH_ONCE``): ``before-settle`` (the body ran, the entry is not
settled), ``after-settle`` (settled, the next link / chord part not yet published) and
``after-publish`` (the next link published, the result not yet stored nor the message
acked). The pool process dies;
Redis redelivers (``acks_late`` + ``reject_on_worker_lost``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from celery import chain, chord, group

from helpers import effect_counts
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

CRASH_POINTS = ["before-settle", "after-settle", "after-publish"]


def received(log: str, task_id: str) -> int:
    """How many times a worker received the message of ``task_id``."""
    return len(re.findall(rf"Task [\w.]+\[{re.escape(task_id)}\] received", log))


def succeeded(log: str, task_id: str) -> int:
    return len(re.findall(rf"Task [\w.]+\[{re.escape(task_id)}\] succeeded", log))


def drain(app, worker, task_id: str) -> str:
    """Wait until the redelivered ``task_id`` succeeded, then until a barrier task sent after
    it ran (one pool process, one queue: anything that delivery published came first).
    Returns the worker's log."""
    wait_for(lambda: succeeded(worker.log_text(), task_id), timeout=60, what=f"{task_id} done")
    assert app.send_task("tests_app.plain_add", args=(1, 1)).get(timeout=60) == 2
    return worker.log_text()


def crashed(tmp_path: Path, crash_at: str) -> bool:
    return Path(f"{tmp_path / 'crash-once'}.{crash_at.replace(':', '_')}").exists()


def crash_env(tmp_path: Path, broker: str, ledger: str, crash_at: str, **extra: str):
    return test_env(
        tmp_path,
        broker=broker,
        ledger_url=ledger,
        CELERY_LEDGER_CRASH_AT=crash_at,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
        **extra,
    )


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_chain_of_three_effects_once_next_link_published_once(tmp_path, redis, pg_url, crash_at):
    env = crash_env(tmp_path, redis, pg_url, crash_at)
    app = client_app(env)
    tag = f"chain-{crash_at}"
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        sig = chain(
            app.signature("tests_app.link", args=([], 1, tag)),
            app.signature("tests_app.link", args=(2, tag)),
            app.signature("tests_app.link", args=(3, tag)),
        )
        result = sig.apply_async()
        assert result.get(timeout=90) == [1, 2, 3]
        first, second = result.parent.parent, result.parent
        log = drain(app, worker, first.id)
    assert crashed(tmp_path, crash_at), f"the crash point {crash_at} was never reached"
    assert effect_counts(pg_url, tag) == {(tag, "link1"): 1, (tag, "link2"): 1, (tag, "link3"): 1}
    assert received(log, first.id) == 2  # the crashed delivery and its redelivery
    assert received(log, second.id) == 1
    assert received(log, result.id) == 1

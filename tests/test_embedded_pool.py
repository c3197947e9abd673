"""The embedded default's pool survives its pool processes being SIGKILLed while idle
(design.md § "The embedded default's pool"), with a real worker on ``filesystem://``.

A broker without an event loop runs billiard's blocking pool: every pool process reads its
next job from one shared pipe, and an idle one waits inside that pipe's read lock. Killed
there, it took the lock with it, and every other pool process (and each one forked to replace
it) waited for it forever: the worker still received messages and never ran one again.
"""

from __future__ import annotations

import pytest

from helpers import effect_counts
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

ROUNDS = 3


def test_idle_pool_processes_sigkilled_embedded(tmp_path, sqlite_url):
    env = test_env(tmp_path, broker=None, ledger_url=sqlite_url)
    app = client_app(env)
    tag = "idle-kills"
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=2)
        assert app.send_task("tests_app.plain_add", args=(1, 1)).get(timeout=60) == 2
        for n in range(ROUNDS):
            # Both pool processes idle: one waits in the job pipe's read, holding its lock.
            killed = set(wait_for(worker.children, timeout=30, what="pool processes"))
            assert all(worker.kill_child(pid) for pid in killed)
            wait_for(
                lambda k=killed: len(set(worker.children()) - k) == 2,
                timeout=30,
                what="two pool processes forked in place of the killed ones",
            )
            plain = app.send_task("tests_app.plain_add", args=(n, 1))
            ledgered = app.send_task("tests_app.slow_effect", args=(f"{tag}-{n}", 0.0))
            assert plain.get(timeout=60) == n + 1, f"round {n}: the pool ran nothing"
            ledgered.get(timeout=60)
    # Each ledgered body ran once.
    for n in range(ROUNDS):
        assert effect_counts(sqlite_url, f"{tag}-{n}") == {(f"{tag}-{n}", "body"): 1}

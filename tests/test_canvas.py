"""Celery canvas with ledgered members under SIGKILL (design.md § "Canvas: chains, groups,
chords, callbacks"), with real workers.

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

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import celery
import pytest
from celery import chain, chord, group

from celery_ledger.ledger import LedgerStore
from helpers import effect_counts, key_of
from procs import TESTS, processes, redelivering, test_env, wait_for
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


def chain_with_crash(tmp_path, env, effects_url: str, ledger_url: str, crash_at: str) -> None:
    """A chain of 3 ledgered links, the first killed at ``crash_at``: exactly 3 effects, the
    right result, each next link published once and through its parent's outbox."""
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
    assert effect_counts(effects_url, tag) == {
        (tag, "link1"): 1,
        (tag, "link2"): 1,
        (tag, "link3"): 1,
    }
    assert received(log, first.id) == 2  # the crashed delivery and its redelivery
    assert received(log, second.id) == 1
    assert received(log, result.id) == 1
    # Each next link went through the outbox with its parent's settle, and was marked.
    store = LedgerStore(ledger_url)
    assert store.recorded_links(key_of("tests_app.link", first.id)) == {second.id: True}
    assert store.recorded_links(key_of("tests_app.link", second.id)) == {result.id: True}
    assert store.recorded_links(key_of("tests_app.link", result.id)) == {}


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_chain_of_three_effects_once_next_link_published_once(tmp_path, redis, pg_url, crash_at):
    env = crash_env(tmp_path, redis, pg_url, crash_at)
    chain_with_crash(tmp_path, env, pg_url, pg_url, crash_at)


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_chain_of_three_embedded(tmp_path, sqlite_url, crash_at):
    """filesystem:// broker, db+sqlite results, SQLite ledger."""
    env = crash_env(tmp_path, None, sqlite_url, crash_at)
    chain_with_crash(tmp_path, env, sqlite_url, sqlite_url, crash_at)


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_chord_member_killed_at_crash_point(tmp_path, redis, pg_url, crash_at):
    """A chord of 3 on the Redis result backend, the first member to get there killed at
    ``crash_at`` and redelivered: it counts once, the callback runs once with all 3."""
    env = crash_env(tmp_path, redis, pg_url, crash_at)
    app = client_app(env)
    tag = f"chord-{crash_at}"
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        result = chord_of(app, tag, 3, 0.0).apply_async()
        assert result.get(timeout=90) == [0, 1, 4]
        assert app.send_task("tests_app.plain_add", args=(1, 1)).get(timeout=60) == 2
        log = worker.log_text()
    assert crashed(tmp_path, crash_at), f"the crash point {crash_at} was never reached"
    expected = {(tag, f"member{n}"): 1 for n in range(3)}
    expected[(tag, "callback")] = 1
    assert effect_counts(pg_url, tag) == expected
    assert received(log, result.id) == 1


def members_done(effects_url: str, tag: str) -> int:
    return sum(n for (_, name), n in effect_counts(effects_url, tag).items() if name != "callback")


def chord_of(app, tag: str, size: int, pause: float):
    return chord(
        [app.signature("tests_app.member", args=(n, tag, pause)) for n in range(size)],
        app.signature("tests_app.collect", args=(tag,)),
    )


def chord_with_kills(tmp_path, env, effects_url: str, tag: str, *, size: int = 10) -> None:
    """A chord of ``size`` members on two pool processes; every pool process is SIGKILLed
    each time the members' effects pass 2, 5 and 8 (bounded: three rounds). Then: each member's
    effect once, the callback's once, with every result."""
    # Recovery as deployed: beat's sweep re-sends what a kill stranded (a message handed to a
    # pool process that died before it took it), after a short lease.
    env = {**env, "CELERY_LEDGER_LEASE_SECONDS": "5", "CELERY_LEDGER_SWEEP_INTERVAL": "1"}
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=2)
        procs.beat()
        result = chord_of(app, tag, size, 0.5).apply_async()
        kills = 0
        for passed in (2, 5, 8):
            wait_for(
                lambda p=passed: members_done(effects_url, tag) >= p,
                timeout=90,
                what=f"{passed} members' effects",
            )
            children = wait_for(worker.children, timeout=30, what="pool processes")
            kills += sum(worker.kill_child(child) for child in children)
        assert result.get(timeout=120) == sorted(n * n for n in range(size))
        # The callback's own message can come back after its result was stored: let any
        # redelivery run before counting (one queue; the barrier runs after it).
        assert app.send_task("tests_app.plain_add", args=(1, 1)).get(timeout=60) == 2
        log = worker.log_text()
    assert kills >= 3 and "SIGKILL" in log, "the chaos never killed a pool process"
    expected = {(tag, f"member{n}"): 1 for n in range(size)}
    expected[(tag, "callback")] = 1
    assert effect_counts(effects_url, tag) == expected
    assert received(log, result.id) == 1, "the chord callback was published more than once"


def test_chord_members_killed_redis_backend(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    chord_with_kills(tmp_path, env, pg_url, "chord-redis")


def test_chord_members_killed_database_backend(tmp_path, redis, pg_url):
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    env["CELERY_RESULT_BACKEND"] = f"db+postgresql://{pg_url.split('://', 1)[1]}"
    chord_with_kills(tmp_path, env, pg_url, "chord-db")


def test_chord_members_killed_embedded(tmp_path, sqlite_url):
    """filesystem:// broker, db+sqlite results, SQLite ledger: the embedded default."""
    env = test_env(tmp_path, broker=None, ledger_url=sqlite_url)
    chord_with_kills(tmp_path, env, sqlite_url, "chord-embedded")


def test_chord_member_duplicated_by_visibility_timeout(tmp_path, redis, pg_url):
    """Members outlive a 2 s visibility timeout: Redis hands each to the other worker while it
    runs (WAIT), and again after it settled (RETURN). The callback still runs once."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, TEST_VISIBILITY_TIMEOUT="2")
    app = client_app(env)
    tag = "chord-vt"
    with processes(tmp_path, env) as procs, redelivering(env):
        w1 = procs.worker("w1", concurrency=2)
        w2 = procs.worker("w2", concurrency=2)
        result = chord_of(app, tag, 4, 4.0).apply_async()
        assert result.get(timeout=120) == [0, 1, 4, 9]
        members = [r.id for r in result.parent.results]
        # Let the redeliveries run out: each member is seen again after it settled.
        wait_for(
            lambda: all(received(w1.log_text() + w2.log_text(), m) >= 2 for m in members),
            timeout=90,
            what="every member delivered twice",
        )
        logs = w1.log_text() + w2.log_text()
    expected = {(tag, f"member{n}"): 1 for n in range(4)}
    expected[(tag, "callback")] = 1
    assert effect_counts(pg_url, tag) == expected
    if celery.VERSION >= (5, 7):
        assert received(logs, result.id) == 1
    else:
        # Celery 5.4 to 5.6's Redis backend has no dispatch claim: every member delivery that
        # finds the count complete before the join's keys are deleted publishes the callback
        # (docs/pages/limits.md). The ledgered callback RETURNs; its effect is one, above.
        assert received(logs, result.id) >= 1


def ledger_cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from celery_ledger.cli.main import main

    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_group_members_have_their_own_entries_and_show_lists_them(tmp_path, redis, pg_url):
    """A group of 4 ledgered members and a chain: each member is its own entry, and
    ``celery-ledger show`` of the group id (or of a chain link) lists the members' states."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    tag = "group-show"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2)
        res = group(app.signature("tests_app.member", args=(n, tag)) for n in range(4))()
        assert res.get(timeout=90) == [0, 1, 4, 9]
        linked = chain(
            app.signature("tests_app.link", args=([], 1, tag)),
            app.signature("tests_app.link", args=(2, tag)),
        ).apply_async()
        assert linked.get(timeout=90) == [1, 2]
    store = LedgerStore(pg_url)
    members = store.members(res.id)
    assert sorted(m.task_id for m in members) == sorted(r.id for r in res.results)
    assert {m.status.value for m in members} == {"completed"}
    code, out = ledger_cli("--url", pg_url, "show", res.id)
    assert code == 0, out
    assert "4 member(s): 4 completed" in out
    assert all(r.id in out for r in res.results)
    code, out = ledger_cli("--url", pg_url, "show", "--json", res.id)
    assert code == 0 and json.loads(out)["counts"] == {"completed": 4}
    # A chain link lists the next one among the entries it published, and its outbox row.
    code, out = ledger_cli("--url", pg_url, "show", "--json", linked.parent.id)
    view = json.loads(out)
    assert [m["task_id"] for m in view["members"]] == [linked.id]
    assert [(c["child_id"], c["state"]) for c in view["children"]] == [(linked.id, "sent")]
    code, out = ledger_cli("--url", pg_url, "show", "no-such-group")
    assert code != 0 and "Traceback" not in out and "no ledger entry matches" in out


@pytest.mark.parametrize("crash_at", [None, "after-publish"])
def test_replace_under_redelivery(tmp_path, redis, pg_url, crash_at):
    """``self.replace(sig)``: the replacement runs once under the task's id (its result is the
    task's), the replaced entry is settled failed with a reason naming it, and a redelivery
    after the replacement was published (killed there) neither runs the body again nor
    overwrites the replacement's result."""
    extra = {} if crash_at is None else {"CELERY_LEDGER_CRASH_AT": crash_at}
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash-once"),
        **extra,
    )
    app = client_app(env)
    tag = f"replace-{crash_at}"
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        result = app.send_task("tests_app.replacer", args=(tag,))
        assert result.get(timeout=90) == 49
        if crash_at:
            wait_for(
                lambda: received(worker.log_text(), result.id) >= 4,
                timeout=60,
                what="the replaced task's redelivery",
            )
        assert app.send_task("tests_app.plain_add", args=(1, 1)).get(timeout=60) == 2
        log = worker.log_text()
        assert app.AsyncResult(result.id).get(timeout=10) == 49
    if crash_at:
        assert crashed(tmp_path, crash_at)
    assert effect_counts(pg_url, tag) == {(tag, "replacer"): 1, (tag, "member7"): 1}
    store = LedgerStore(pg_url)
    replaced = store.get_entry(key_of("tests_app.replacer", result.id))
    assert replaced.status.value == "failed"
    assert replaced.reason == f"replaced by tests_app.member[{result.id}]"
    # A replacement is keyed apart from the call it replaced (``LedgerTask.entry_key_of``).
    replacement = store.get_entry(key_of("tests_app.member", {"replacement": 1, "of": result.id}))
    assert replacement.status.value == "completed" and replacement.executions == 1
    # Killed after the replacement's publish and before the settle, the redelivery takes
    # over, replays the step and replaces again: the same task id is published a second
    # time, and the replacement's claim RETURNs it (docs/design.md, "Canvas").
    assert received(log, result.id) == (4 if crash_at else 2)


def test_link_error_under_redelivery_is_published_once(tmp_path, redis, pg_url):
    """A failing task outlives a 2 s visibility timeout: Redis hands it to the other worker,
    which WAITs and then RETURNs the stored failure. Its errback was recorded with the
    failure and published once; the RETURN publishes it again neither itself nor through
    Celery (which fires errbacks for every delivery that stores a failure)."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, TEST_VISIBILITY_TIMEOUT="2")
    app = client_app(env)
    tag = "link-error"
    with processes(tmp_path, env) as procs, redelivering(env):
        w1 = procs.worker("w1", concurrency=1)
        w2 = procs.worker("w2", concurrency=1)
        result = app.signature("tests_app.fail_slowly", args=(tag, 4.0)).apply_async(
            link_error=app.signature("tests_app.on_failure", args=(tag,))
        )
        with pytest.raises(Exception, match="link-error failed"):
            result.get(timeout=90)
        wait_for(
            lambda: received(w1.log_text() + w2.log_text(), result.id) >= 2,
            timeout=90,
            what="the failing task delivered twice",
        )
        wait_for(
            lambda: (w1.log_text() + w2.log_text()).count("ValueError('link-error failed')") >= 2,
            timeout=90,
            what="the RETURN of the stored failure",
        )
        # Anything that delivery published is ahead of these in the queue.
        barriers = [app.send_task("tests_app.plain_add", args=(1, n)) for n in range(2)]
        assert [b.get(timeout=60) for b in barriers] == [1, 2]
        logs = w1.log_text() + w2.log_text()
    assert effect_counts(pg_url, tag) == {(tag, "failing"): 1, (tag, "errback"): 1}
    errbacks = re.findall(r"Task tests_app\.on_failure\[[\w-]+\] received", logs)
    assert len(errbacks) == 1, errbacks
    store = LedgerStore(pg_url)
    assert list(store.recorded_links(key_of("tests_app.fail_slowly", result.id)).values()) == [True]


def operator(env: dict[str, str], *args: str) -> None:
    """``celery-ledger -A tests_app ARGS``, as an operator runs it (bounded in time)."""
    argv = [sys.executable, "-c", "from celery_ledger.cli.main import main; main()"]
    done = subprocess.run(
        [*argv, "-A", "tests_app", *args],
        env={**os.environ, **env, "PYTHONPATH": str(TESTS)},
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_callback_after_a_released_failure_survives_a_crash_after_the_settle(
    tmp_path, redis, pg_url
):
    """fail -> operator release -> complete, killed right after the completed settle. The
    errback went out with the failure; the callback recorded with the completed settle has an
    outbox row of its own, which the redelivery (or the sweep) publishes: it runs once."""
    broken = tmp_path / "still-broken"
    broken.touch()
    env = crash_env(tmp_path, redis, pg_url, "after-settle")
    # The crash point is disarmed (its once-marker exists) until the failure and its
    # ledgered errback settled: the errback's own settle must not be the one killed.
    armed = Path(f"{tmp_path / 'crash-once'}.after-settle")
    armed.touch()
    app = client_app(env)
    tag = "released"
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        result = app.signature("tests_app.fail_while", args=(tag, str(broken))).apply_async(
            link=app.signature("tests_app.on_success", args=(tag,)),
            link_error=app.signature("tests_app.on_failure", args=(tag,)),
        )
        with pytest.raises(Exception, match="released failed"):
            result.get(timeout=60)
        wait_for(
            lambda: effect_counts(pg_url, tag).get((tag, "errback")),
            timeout=60,
            what="the errback",
        )
        broken.unlink()  # the operator fixed the cause
        armed.unlink()  # the next settle's process dies once it committed
        # The release re-enqueues the entry with its canvas placement (link, link_error).
        key = key_of("tests_app.fail_while", result.id)
        operator(
            env, "release", key, "--verified", "not-executed", "--by", "alice", "--reason", "fixed"
        )
        wait_for(
            lambda: effect_counts(pg_url, tag).get((tag, "callback")),
            timeout=60,
            what="the callback of the completed re-run",
        )
        drain(app, worker, result.id)
    assert crashed(tmp_path, "after-settle"), "the completed settle was never killed"
    assert effect_counts(pg_url, tag) == {
        (tag, "errback"): 1,
        (tag, "succeeding"): 1,
        (tag, "callback"): 1,
    }
    store = LedgerStore(pg_url)
    assert store.get_entry(key).status.value == "completed"
    recorded = store.recorded_links(key)
    assert len(recorded) == 2 and all(recorded.values()), recorded


def test_chord_unlock_killed_still_calls_back_embedded(tmp_path, sqlite_url):
    """db+sqlite results: the callback is published by Celery's ``celery.chord_unlock``, which
    Celery acks before it runs. Its pool process is killed as it starts: a ledger worker
    delivers it acks_late + reject_on_worker_lost, so it comes back and calls back once."""
    env = crash_env(tmp_path, None, sqlite_url, "chord-unlock")
    app = client_app(env)
    tag = "chord-unlock"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        result = chord_of(app, tag, 3, 0.0).apply_async()
        assert result.get(timeout=90) == [0, 1, 4]
    assert crashed(tmp_path, "chord-unlock"), "chord_unlock never started"
    expected = {(tag, f"member{n}"): 1 for n in range(3)}
    expected[(tag, "callback")] = 1
    assert effect_counts(sqlite_url, tag) == expected


def test_chain_resumed_by_the_sweep_keeps_its_links(tmp_path, redis, pg_url):
    """The whole worker running the first link dies before the settle (parent too: Redis keeps
    the message unacked for its visibility timeout, an hour). Beat's sweep interrupts the
    entry when its lease ends and re-sends it from the argument snapshot: the snapshot keeps
    its place in the chain, so the chain completes, each effect once."""
    env = crash_env(
        tmp_path,
        redis,
        pg_url,
        "before-settle@worker",
        CELERY_LEDGER_LEASE_SECONDS="3",
        CELERY_LEDGER_SWEEP_INTERVAL="1",
    )
    app = client_app(env)
    tag = "chain-sweep"
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=1)
        procs.worker("w2", concurrency=1)
        procs.beat()
        result = chain(
            app.signature("tests_app.link", args=([], 1, tag)),
            app.signature("tests_app.link", args=(2, tag)),
            app.signature("tests_app.link", args=(3, tag)),
        ).apply_async()
        assert result.get(timeout=120) == [1, 2, 3]
    assert crashed(tmp_path, "before-settle")
    assert effect_counts(pg_url, tag) == {
        (tag, "link1"): 1,
        (tag, "link2"): 1,
        (tag, "link3"): 1,
    }
    store = LedgerStore(pg_url)
    first = store.get_entry(key_of("tests_app.link", result.parent.parent.id))
    assert first.executions == 2 and first.status.value == "completed"

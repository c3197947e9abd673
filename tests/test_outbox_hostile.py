"""The outbox under hostile input (guarantees.md § "Bad input", items 2, 7, 8): the failing-first
tests.

Through a real worker (Redis broker, PostgreSQL ledger), and beat's sweep where the outbox is
published later. ``outbox_app.send_bad`` charges in an effect step, then sends one child that
is wrong in one way:

- item 7: a misuse of ``self.send()`` is a programming error: the task fails with a reason
  naming the cause; it is never blocked as "may have executed";
- item 8: a child nested deeper than a worker can decode is refused at send, as ``apply_async``
  refuses it;
- item 2: an option the broker publish refuses every time (``countdown`` NaN, ``"soon"``,
  ``1e12``) is refused at send; a bad child already recorded never holds back the others, and
  it is counted and shown.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from celery import Celery
from outbox_app import OUTBOX_TASKS
from test_faults_hostile import ledger_cli
from test_ledger_page import USER, ActionCase, PageCase

from celery_ledger.ledger import (
    Child,
    ClaimRequest,
    EntryNotFound,
    EntryStatus,
    LedgerStore,
    Owner,
    child_task_id,
    entry_key,
)
from helpers import business_key, effect_counts, key_of
from procs import processes, test_env, wait_for
from test_delivery import client_app

pytestmark = pytest.mark.processes

#: kind -> a word the failure's reason must hold (the cause, in the ledger's words).
MISUSES = {
    "eta": "eta",
    "task_id": "task_id",
    "string": "signature",
    "not-json": "JSON",
    "huge": "ledger_max_snapshot_bytes",
    "nested": "levels deep",
    "countdown-nan": "countdown",
    "countdown-soon": "countdown",
    "countdown-huge": "countdown",
    "expires-nan": "expires",
    "priority-word": "priority",
}


def settled(store: LedgerStore, key: str) -> bool:
    try:
        return store.get_entry(key).status not in (EntryStatus.RUNNING, EntryStatus.INTERRUPTED)
    except EntryNotFound:
        return False


def test_a_misused_send_fails_the_task_with_its_cause_and_records_no_child(tmp_path, redis, pg_url):
    """Items 7 and 8, and item 2's "validated at send": each misuse fails its task (never
    blocked), the failure names the cause, the step's effect ran once, and the outbox holds
    nothing for it; a good send in the same worker still goes out."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    store = LedgerStore(pg_url)
    keys = {kind: business_key("outbox_app.send_bad", tag=f"m-{kind}") for kind in MISUSES}
    with processes(tmp_path, env) as procs:
        procs.worker("w1", concurrency=2, extra=OUTBOX_TASKS)
        for kind in MISUSES:
            app.send_task("outbox_app.send_bad", args=(f"m-{kind}", kind))
        good = app.send_task("outbox_app.send_bad", args=("m-good", "good"))
        child_id = good.get(timeout=90)
        wait_for(
            lambda: all(settled(store, k) for k in keys.values()),
            timeout=120,
            what="every misuse settled",
        )
        wait_for(
            lambda: settled(store, key_of("tests_app.child_effect", child_id)),
            timeout=60,
            what="the good child ran",
        )
    app.close()
    failures = []
    for kind, word in MISUSES.items():
        entry = store.get_entry(keys[kind])
        text = f"{entry.reason or ''} {entry.error or ''}"
        if entry.status is not EntryStatus.FAILED or word not in text:
            failures.append(f"{kind}: {entry.status.value} {text[:300]!r}")
        if store.children_of(keys[kind]):
            failures.append(f"{kind}: a child was recorded")
        if effect_counts(pg_url, f"m-{kind}").get((f"m-{kind}", "charge")) != 1:
            failures.append(f"{kind}: charged {effect_counts(pg_url, f'm-{kind}')}")
    assert not failures, "\n".join(failures)
    assert store.stats().duplicate_executions == 0


def test_send_of_a_task_no_app_registers_warns(tmp_path, redis, pg_url):
    """The doc item: a child whose task no app registers is accepted (a producer may send to
    another service's worker) but warned about at send, as a plain child is."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1, extra=OUTBOX_TASKS)
        app.send_task("outbox_app.send_unknown", args=("u1",)).get(timeout=60)
        worker.wait_log("outbox_app.nobody_has_this", timeout=30)
    app.close()
    assert "no app here registers" in worker.log_path.read_text()


# -- item 2: a bad child already recorded never holds back the others -------------------------


def _parent(store: LedgerStore, task: str) -> tuple[str, int]:
    task_id = str(uuid.uuid4())
    claim = store.claim(
        ClaimRequest(
            key=entry_key(task, task_id),
            task_name=task,
            task_id=task_id,
            args_hash="task-id",
            snapshot=None,
            side_effect="non_idempotent",
            owner=Owner("celery@old", "boot-1", 1),
            lease_seconds=3600.0,
        )
    )
    return claim.key, claim.fence


def _record(store: LedgerStore, task: str, children: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Record children of a fresh parent as a step would have, bypassing ``send()``'s checks
    (a row written before them, or by an older version)."""
    key, fence = _parent(store, task)
    recorded = [
        Child(
            child_task_id(key, "notify", 0, n),
            name,
            json.dumps({"args": payload.pop("args"), "kwargs": {}, "options": payload}),
            n,
        )
        for n, (name, payload) in enumerate(children)
    ]
    assert store.complete_step(
        key, fence, ("notify", "h", 0), seq=1, output="null", children=recorded
    )
    return [c.child_id for c in recorded]


def test_a_child_the_broker_refuses_never_holds_back_the_others(tmp_path, redis, pg_url):
    """Three bad children of one parent, recorded first (oldest), then a good child of another
    parent: the sweep publishes the good one, counts the bad ones as errors, and keeps them
    pending with their error shown by ``show``. An operator then repairs one (its countdown
    cleared: the sweep publishes it and it runs) and drops another (never published)."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, CELERY_LEDGER_SWEEP_INTERVAL="1")
    store = LedgerStore(pg_url)
    bad = _record(
        store,
        "shop.old_parent",
        [
            ("tests_app.child_effect", {"args": ["b", 0], "countdown": float("nan")}),
            ("tests_app.child_effect", {"args": ["b", 1], "countdown": "soon"}),
            ("tests_app.child_effect", {"args": ["b", 2], "countdown": 1e12}),
        ],
    )
    [good] = _record(store, "shop.new_parent", [("tests_app.child_effect", {"args": ["g", 0]})])
    parent = store.parent_of(bad[0]).parent_key
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=2)
        procs.beat()
        wait_for(
            lambda: settled(store, key_of("tests_app.child_effect", good)),
            timeout=90,
            what="the good child published by the sweep and run",
        )
        worker.wait_log("'outbox_failed': 3", timeout=60)
        pending = {m.child_id: m for m in store.unpublished(older_than=0.0)}
        assert set(pending) == set(bad)
        for child_id in bad:
            assert pending[child_id].publish_errors >= 1
            assert "countdown" in (pending[child_id].last_error or ""), pending[child_id]
        shown = ledger_cli(pg_url, "show", parent, "--json")
        assert shown.returncode == 0, shown.stderr
        states = {c["child_id"]: c for c in json.loads(shown.stdout)["children"]}
        assert {states[c]["state"] for c in bad} == {"failing"}
        assert "countdown" in states[bad[1]]["last_error"]
        stats = ledger_cli(pg_url, "stats", "--json")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["outbox_failing"] == 3
        text = ledger_cli(pg_url, "show", parent)
        assert "failing" in text.stdout and "outbox repair" in text.stdout, text.stdout
        # Refused: blank reason, an option a child does not keep, a repair still unpublishable.
        for args, words in (
            (["drop", parent, bad[0], "--by", "ops", "--reason", " "], "--reason"),
            (["repair", parent, bad[0], "--clear", "eta", "--by", "o", "--reason", "r"], "eta"),
            (["repair", parent, bad[0], "--clear", "queue", "--by", "o", "--reason", "r"], "still"),
            (["drop", parent, good, "--by", "ops", "--reason", "r"], "no child"),
        ):
            refused = ledger_cli(pg_url, "outbox", *args)
            assert refused.returncode == 1 and words in refused.stderr, refused.stderr
            assert "Traceback" not in refused.stderr
        repaired = ledger_cli(
            pg_url,
            "outbox",
            "repair",
            parent,
            bad[1],
            "--clear",
            "countdown",
            "--by",
            "ops",
            "--reason",
            "countdown was 'soon'",
        )
        assert repaired.returncode == 0, repaired.stderr
        dropped = ledger_cli(
            pg_url, "outbox", "drop", parent, bad[2], "--by", "ops", "--reason", "year 33658"
        )
        assert dropped.returncode == 0, dropped.stderr
        wait_for(
            lambda: settled(store, key_of("tests_app.child_effect", bad[1])),
            timeout=60,
            what="the repaired child published by the sweep and run",
        )
        again = ledger_cli(pg_url, "outbox", "drop", parent, bad[2], "--by", "o", "--reason", "r")
        assert again.returncode == 1 and "dropped already" in again.stderr, again.stderr
    assert effect_counts(pg_url, "g") == {("g", "child-0"): 1}
    assert effect_counts(pg_url, "b") == {("b", "child-1"): 1}
    assert [m.child_id for m in store.unpublished(older_than=0.0)] == [bad[0]]
    by_id = {m.child_id: m for m in store.children_of(parent)}
    assert by_id[bad[1]].state == "sent" and by_id[bad[2]].state == "dropped"
    assert {"child-repaired", "child-dropped"} <= {e.event for e in store.entry_events(parent)}


# -- item 2: the Ledger page shows a failing child, and drops or repairs it ---------------------


class TestOutboxOnTheLedgerPage(ActionCase):
    """Flower in-process (tornado's test client), over SQLite: the Ledger page lists an
    entry's children with their state and last error, and offers a failing child's drop or
    repair through the page's authenticated, XSRF-checked actions."""

    def failing(self) -> tuple[str, list[str]]:
        c = self.claim()
        children = [
            Child(child_task_id(c.key, "notify", 0, n), "shop.notice", payload, n)
            for n, payload in enumerate(
                json.dumps({"args": [], "kwargs": {}, "options": {"countdown": bad}})
                for bad in ("soon", "later")
            )
        ]
        assert self.store.complete_step(
            c.key, c.fence, ("notify", "h", 0), seq=1, output="null", children=children
        )
        ids = [child.child_id for child in children]
        self.store.note_publish_failures([(i, "Unpublishable: countdown='soon'") for i in ids])
        return str(c.key), ids

    def test_a_failing_child_is_shown_and_repaired_or_dropped(self) -> None:
        key, (first, second) = self.failing()
        html = self.page(f"/ledger/entry/{key}")
        assert f'data-child="{first}" data-state="failing"' in html
        assert "Unpublishable: countdown=&#x27;soon&#x27;" in html
        assert 'name="outbox_action"' in html and 'value="clear:countdown"' in html
        path = f"/ledger/entry/{key}/outbox"
        no_token = self.post(path, {"child_id": first, "outbox_action": "drop", "reason": "r"})
        assert no_token.code == 403
        blank = self.post(
            path, {"child_id": first, "outbox_action": "drop", "reason": " "}, xsrf_from="/ledger"
        )
        assert blank.code == 400
        still = self.post(
            path,
            {"child_id": first, "outbox_action": "clear:queue", "reason": "r"},
            xsrf_from="/ledger",
        )
        assert still.code == 409 and b"still not publishable" in still.body
        repaired = self.post(
            path,
            {"child_id": first, "outbox_action": "clear:countdown", "reason": "was soon"},
            xsrf_from="/ledger",
        )
        assert repaired.code == 302, repaired.body[:500]
        assert repaired.headers["Location"].endswith("done=child-repaired")
        dropped = self.post(
            path,
            {"child_id": second, "outbox_action": "drop", "reason": "not needed"},
            xsrf_from="/ledger",
        )
        assert dropped.code == 302 and dropped.headers["Location"].endswith("done=child-dropped")
        by_id = {m.child_id: m for m in self.store.children_of(key)}
        assert by_id[first].state == "pending" and "countdown" not in by_id[first].payload
        assert by_id[second].state == "dropped"
        assert [m.child_id for m in self.store.unpublished(older_than=0.0)] == [first]
        events = [(e.event, e.actor) for e in self.store.entry_events(key)[-2:]]
        assert events == [("child-repaired", USER), ("child-dropped", USER)]
        again = self.post(
            path,
            {"child_id": second, "outbox_action": "drop", "reason": "again"},
            xsrf_from="/ledger",
        )
        assert again.code == 409 and b"dropped already" in again.body


class TestOutboxOnAReadOnlyPage(PageCase):
    def test_a_failing_child_is_shown_without_a_form(self) -> None:
        key, ids = TestOutboxOnTheLedgerPage.failing(self)  # type: ignore[arg-type]
        html = self.page(f"/ledger/entry/{key}")
        assert f'data-child="{ids[0]}" data-state="failing"' in html
        assert 'name="outbox_action"' not in html


def test_a_broker_refusal_stops_the_batch_and_a_childs_own_fault_does_not() -> None:
    """``publish``'s one decision: what is the broker's (the batch stops, the sweep tries again,
    nothing is noted on the child) and what is the child's (noted, and the others go on)."""
    from amqp.exceptions import MessageNacked
    from kombu.exceptions import OperationalError

    from celery_ledger.recovery.outbox import Unpublishable, broker_failure

    app = Celery("classify", broker="redis://127.0.0.1:1/0")
    for exc in (MessageNacked(), OperationalError("down"), ConnectionRefusedError()):
        assert broker_failure(app, exc), exc
    for exc in (Unpublishable("countdown='soon'"), ValueError("nan"), OverflowError("date")):
        assert not broker_failure(app, exc), exc

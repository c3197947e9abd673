"""Secret argument values never reach Flower's events or the log lines (design.md § "Secrets out of
sight, and snapshots sealed at rest").

Real processes: a ``page_app`` worker (``-E``) on Redis, the ledger on PostgreSQL, and Flower
with the shipped ``flowerconfig.py``. A plain client sends ``page_app.pay`` by name, so its
message carries the card number in its ``kwargsrepr`` header (the client knows nothing of
``secret_args``). One order is blocked (its pool process SIGKILLed after ``charge`` started),
one completes. Neither Flower's API, its task pages, its metrics nor any process log holds
the card number.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

import pytest
from celery import Celery
from test_metrics import free_port

from celery_ledger.harness.processes import ProcessGroup
from celery_ledger.ledger import EntryNotFound, EntryStatus, LedgerStore, entry_key
from procs import REPO, TESTS, test_env, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.redis, pytest.mark.postgres]

CARD = "4000056655665556"
USER, PASSWORD = "ledger", "secret-page"


def get(port: int, path: str) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def crashing_worker(group: ProcessGroup, env: dict[str, str], point: str, tmp_path: Path) -> None:
    """One ``-E`` worker whose pool process is SIGKILLed once at the crash point ``point``."""
    group.worker(
        "w1",
        queue=env["TEST_QUEUE"],
        node=f"w1-{env['TEST_ID']}@%h",
        concurrency=1,
        heartbeat=True,
        extra=["-E"],
        env={
            "CELERY_LEDGER_CRASH_AT": point,
            "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash"),
        },
    ).wait_ready(90)


def test_secret_values_never_reach_flower_events_or_logs(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    client = Celery("client", broker=redis, backend=redis)
    store = LedgerStore(pg_url)
    store.now()
    port = free_port()
    group = ProcessGroup(tmp_path, app="page_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    try:
        with group:
            flower = group.celery(
                "flower",
                [
                    "flower",
                    f"--port={port}",
                    "--address=127.0.0.1",
                    f"--conf={REPO / 'worker' / 'flowerconfig.py'}",
                    f"--basic-auth={USER}:{PASSWORD}",
                ],
            )

            def flower_up() -> bool:
                assert flower.proc.poll() is None, flower.log_tail()
                try:
                    return bool(get(port, "/api/workers") is not None)
                except OSError:
                    return False

            wait_for(flower_up, timeout=60, what="Flower")
            crashing_worker(group, env, "step-started:charge", tmp_path)

            def send(order: str) -> str:
                return str(
                    client.send_task(
                        "page_app.pay",
                        kwargs={"order_id": order, "amount": 9, "card_number": CARD},
                        queue=env["TEST_QUEUE"],
                    ).id
                )

            # Flower subscribes asynchronously: the first order may come before it listens,
            # so orders are sent until Flower has seen one blocked and one completed.
            blocked_key = entry_key("page_app.pay", {"order_id": "sec-blk"})
            blocked_id = send("sec-blk")

            def blocked() -> bool:
                try:
                    return store.get_entry(blocked_key).status is EntryStatus.BLOCKED
                except EntryNotFound:
                    return False

            wait_for(
                blocked,
                timeout=90,
                interval=0.3,
                what="the first order blocked",
            )
            ids = [blocked_id]

            def both_seen() -> bool:
                ids.append(send(f"sec-ok-{len(ids)}"))
                tasks = json.loads(get(port, "/api/tasks?limit=1000"))
                states = {tasks.get(i, {}).get("state") for i in ids}
                return "SUCCESS" in states and "LEDGER-BLOCKED" in states

            wait_for(both_seen, timeout=90, interval=1.0, what="Flower to see both orders")
            tasks = json.loads(get(port, "/api/tasks?limit=1000"))
            seen = [tasks[i] for i in ids if i in tasks]
            assert any("card_number" in (t.get("kwargs") or "") for t in seen), seen
            pages = [get(port, "/api/tasks?limit=1000"), get(port, "/metrics")]
            pages += [get(port, f"/task/{i}") for i in ids if i in tasks]
            pages += [get(port, f"/ledger/entry/{blocked_key}")]
            for page in pages:
                assert CARD not in page
            for proc in group.started:
                assert CARD not in proc.log_text(), proc.name
    finally:
        store.dispose()


def test_a_blocked_reason_that_quotes_a_secret_never_reaches_the_log_or_list(
    tmp_path: Path, redis: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """guarantees.md § "Bad input", item 5a: a step recorded an external ref built from the card
    number, and
    its worker died after it. The redelivery blocks the entry with a reason that quotes the
    ref: the worker's log line, the ``LedgerBlocked`` Celery logs, and ``list --json`` printed
    the card, while ``show`` scrubbed it."""
    from click.testing import CliRunner

    from celery_ledger.cli.main import main

    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    client = Celery("client", broker=redis, backend=redis)
    store = LedgerStore(pg_url)
    store.now()
    group = ProcessGroup(tmp_path, app="page_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    key = entry_key("page_app.pay_ref", {"order_id": "ref-blk"})
    try:
        with group:
            crashing_worker(group, env, "step-ref:charge", tmp_path)
            client.send_task(
                "page_app.pay_ref",
                kwargs={"order_id": "ref-blk", "card_number": CARD},
                queue=env["TEST_QUEUE"],
            )

            def blocked() -> bool:
                try:
                    return store.get_entry(key).status is EntryStatus.BLOCKED
                except EntryNotFound:
                    return False

            wait_for(blocked, timeout=90, interval=0.3, what="the order blocked")
            # The ledger keeps the reason whole: the ref is what the operator reconciles by.
            assert CARD in (store.get_entry(key).reason or "")
            monkeypatch.chdir(TESTS)
            monkeypatch.syspath_prepend(str(TESTS))
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            listed = CliRunner().invoke(
                main, ["-A", "page_app", "--url", pg_url, "list", "--json", "--limit", "1000"]
            )
            assert listed.exit_code == 0, listed.output
            assert key in listed.output and CARD not in listed.output

            def logged() -> bool:
                return any("blocked key=" in p.log_text() for p in group.started)

            wait_for(logged, timeout=30, interval=0.3, what="the worker's blocked line")
            for proc in group.started:
                assert CARD not in proc.log_text(), proc.name
    finally:
        store.dispose()

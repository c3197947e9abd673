"""Flower's own task list in a real browser (Chromium, Selenium), reading the ledger's events.

Real processes: Flower with the shipped ``flowerconfig.py`` and basic auth, a ``page_app``
worker (``-E``) on Redis, the ledger on PostgreSQL. One order's pool process is SIGKILLed after
``charge`` started; its redelivery blocks it. The task list must show it ``LEDGER-BLOCKED``
(not a red FAILURE) with the ledger's badge ``interrupted``, and the *Blocked* filter button
must list it alone. ``CELERY_LEDGER_SCREENSHOTS=docs`` saves ``docs/ledger-flower-tasks.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from test_ledger_page_browser import chromium, close, find_all, screenshot
from test_metrics import free_port

from celery_ledger.harness.processes import ProcessGroup
from procs import REPO, TESTS, test_env, wait_for

pytestmark = [
    pytest.mark.processes,
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.browser,
    pytest.mark.timeout(300),
]

USER, PASSWORD = "operator-bob", "battery-staple"


def test_flower_task_list_shows_blocked_and_the_ledger_badges(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    import urllib.request

    driver = chromium()  # skips (or fails under CI) before anything starts
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    client = Celery("client", broker=redis, backend=redis)
    port = free_port()
    base = f"http://{USER}:{PASSWORD}@127.0.0.1:{port}"
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

            def api_tasks() -> dict[str, Any]:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/tasks?limit=1000")
                import base64

                token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                req.add_header("Authorization", f"Basic {token}")
                try:
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        return dict(json.loads(resp.read()))
                except OSError:
                    assert flower.proc.poll() is None, flower.log_tail()
                    return {}

            wait_for(
                lambda: api_tasks() is not None and flower.proc.poll() is None,
                timeout=60,
                what="Flower",
            )
            group.worker(
                "w1",
                queue=env["TEST_QUEUE"],
                node=f"w1-{env['TEST_ID']}@%h",
                concurrency=1,
                heartbeat=True,
                extra=["-E"],
                env={
                    "CELERY_LEDGER_CRASH_AT": "step-started:charge",
                    "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash"),
                },
            ).wait_ready(90)
            sent: list[str] = []

            def blocked_in_flower() -> bool:
                # Flower subscribes asynchronously: an order sent before it listens is missed.
                sent.append(
                    client.send_task(
                        "page_app.pay",
                        kwargs={"order_id": f"T-{len(sent)}", "amount": 1, "card_number": "4242"},
                        queue=env["TEST_QUEUE"],
                    ).id
                )
                tasks = api_tasks()
                return any(tasks.get(i, {}).get("state") == "LEDGER-BLOCKED" for i in sent)

            wait_for(blocked_in_flower, timeout=120, interval=3, what="an order LEDGER-BLOCKED")
            tasks = api_tasks()
            blocked = next(i for i in sent if tasks.get(i, {}).get("state") == "LEDGER-BLOCKED")

            driver.get(base + "/tasks")

            def row_of(task_id: str) -> Any:
                rows = [r for r in find_all(driver, "#tasks-table tbody tr") if task_id in r.text]
                return rows[0] if rows else None

            wait_for(lambda: row_of(blocked), timeout=30, what="the blocked order in the list")
            row = row_of(blocked)
            badges = [b.text for b in row.find_elements("css selector", ".badge")]
            assert "LEDGER-BLOCKED" in badges, badges
            assert "FAILURE" not in badges, badges
            [state_badge] = [
                b for b in row.find_elements("css selector", ".badge") if b.text == "LEDGER-BLOCKED"
            ]
            assert "text-bg-warning" in state_badge.get_attribute("class"), "not a red FAILURE"
            marks = [b.text for b in row.find_elements("css selector", ".ledger-marks")]
            assert marks and "interrupted" in marks[0], marks
            screenshot(driver, "flower-tasks")
            [button] = find_all(
                driver, "button.task-state-filter[data-task-state='LEDGER-BLOCKED']"
            )
            button.click()

            from selenium.common.exceptions import StaleElementReferenceException

            def only_blocked() -> bool:
                try:
                    rows = find_all(driver, "#tasks-table tbody tr")
                    states = {
                        b.text
                        for r in rows
                        for b in r.find_elements("css selector", ".badge:not(.ledger-marks)")
                    }
                except StaleElementReferenceException:
                    return False  # Flower redrew the table between two reads: read it again
                return bool(rows) and states == {"LEDGER-BLOCKED"}

            wait_for(only_blocked, timeout=30, what="the Blocked filter to list blocked tasks only")
    finally:
        close(driver)

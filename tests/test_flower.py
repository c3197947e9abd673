"""Flower with the shipped flowerconfig.py, over a real worker on Redis.

What this proves: the worker's ``task-ledger-*`` events reach Flower, which shows them as task
states (``LEDGER-CLAIMED`` while the body runs, ``LEDGER-WAITED`` on the duplicate held back by
the live lease) and counts them in ``flower_events_total``; Flower's ``/metrics`` carries the
ledger's gauges with the right values, and the standalone endpoint serves the same ones.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from test_metrics import assert_same_gauges, cli, free_port, samples

from celery_ledger.harness.processes import ProcessGroup
from procs import REPO, processes, test_env, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.redis, pytest.mark.postgres]

FLOWERCONFIG = REPO / "worker" / "flowerconfig.py"
USER, PASSWORD = "ledger", "not-an-open-api"


class FlowerClient:
    def __init__(self, port: int, auth: tuple[str, str] | None = (USER, PASSWORD)) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.auth = auth

    def get(self, path: str) -> tuple[int, str]:
        req = urllib.request.Request(self.base + path)
        if self.auth:
            token = base64.b64encode(":".join(self.auth).encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def tasks(self) -> dict[str, Any]:
        status, body = self.get("/api/tasks?limit=1000")
        return json.loads(body) if status == 200 else {}

    def state(self, task_id: str) -> str | None:
        return self.tasks().get(task_id, {}).get("state")

    def metrics(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, (status, body[:500])
        return body


def events_total(metrics: str, event_type: str, task: str) -> float:
    return sum(
        v
        for (name, labels), v in samples(metrics, "flower_events_total").items()
        if dict(labels).get("type") == event_type and dict(labels).get("task") == task
    )


def ledger_gauge(metrics: str, name: str, **labels: str) -> float | None:
    return samples(metrics).get((f"celery_ledger_{name}", tuple(sorted(labels.items()))))


def start_flower(procs: Any, port: int) -> Any:
    """``celery flower`` with the shipped flowerconfig.py and basic auth; waits for its API."""
    proc = procs.celery(
        "flower",
        [
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--conf={FLOWERCONFIG}",
            f"--basic-auth={USER}:{PASSWORD}",
        ],
    )
    client = FlowerClient(port)

    def flower_up() -> bool:
        if not proc.alive:
            raise AssertionError(f"flower exited:\n{proc.log_tail()}")
        return client.get("/api/workers")[0] == 200

    wait_for(flower_up, timeout=60, what="Flower's API")
    return proc


def test_flower_shows_ledger_states_events_and_gauges(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    env = test_env(
        tmp_path,
        broker=redis,
        ledger_url=pg_url,
        # the duplicate re-queues itself every second while the first one runs
        CELERY_LEDGER_WAIT_COUNTDOWN_MAX=1,
        CELERY_LEDGER_METRICS_TTL=1,
    )
    client = Celery("client", broker=redis, backend=redis)
    queue = env["TEST_QUEUE"]

    def send(name: str, **kwargs: Any) -> Any:
        return client.send_task(name, kwargs=kwargs, queue=queue)

    port = free_port()
    flower = FlowerClient(port)
    with processes(tmp_path, env) as procs:
        start_flower(procs, port)
        # Authentication is configured: without credentials the API and the UI refuse.
        assert FlowerClient(port, auth=None).get("/api/tasks")[0] == 401
        assert FlowerClient(port, auth=None).get("/tasks")[0] == 401
        assert FlowerClient(port, auth=(USER, "wrong")).get("/api/workers")[0] == 401
        # ...but Flower serves /metrics without authentication (Prometheus scrapes it), and
        # docs/monitoring.md says so: the ledger's gauges are as open as Flower's own.
        assert FlowerClient(port, auth=None).get("/metrics")[0] == 200

        procs.worker(extra=["-E"])
        # Flower subscribes to events asynchronously: resend a plain task until one shows up.
        probes: list[str] = []

        def event_stream_live() -> bool:
            probes.append(send("tests_app.plain_add", x=1, y=2).id)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if any(flower.state(p) == "SUCCESS" for p in probes):
                    return True
                time.sleep(0.2)
            return False

        wait_for(event_stream_live, timeout=60, interval=0, what="task events in Flower")

        first = send("tests_app.order", order_id="o-1", amount=10, pause=4.0)
        wait_for(
            lambda: flower.state(first.id) == "LEDGER-CLAIMED",
            timeout=30,
            interval=0.1,
            what="the first delivery as LEDGER-CLAIMED while its body runs",
        )
        # Same business key, another task id: held back by the live lease, never run beside it.
        duplicate = send("tests_app.order", order_id="o-1", amount=10, pause=4.0)
        wait_for(
            lambda: flower.state(duplicate.id) == "LEDGER-WAITED",
            timeout=30,
            interval=0.1,
            what="the duplicate as LEDGER-WAITED",
        )

        result = first.get(timeout=60)
        assert duplicate.get(timeout=60) == result, "the duplicate returned the stored result"
        # Celery's terminal event outranks a custom state: both end up SUCCESS in Flower.
        wait_for(
            lambda: {flower.state(first.id), flower.state(duplicate.id)} == {"SUCCESS"},
            timeout=30,
            what="both deliveries SUCCESS in Flower",
        )

        def counted() -> str | None:
            page = flower.metrics()
            ok = (
                events_total(page, "task-ledger-returned", "tests_app.order") >= 1
                and ledger_gauge(page, "task_entries", task="tests_app.order", status="completed")
                == 1
            )
            return page if ok else None

        page = wait_for(
            counted,
            timeout=30,
            interval=0.5,
            what="task-ledger-returned and the completed entry in /metrics",
        )
        assert events_total(page, "task-ledger-claimed", "tests_app.order") == 1
        assert events_total(page, "task-ledger-waited", "tests_app.order") >= 1
        assert events_total(page, "task-ledger-settled", "tests_app.order") == 1
        assert ledger_gauge(page, "up") == 1
        assert ledger_gauge(page, "entries", status="completed") == 1
        assert ledger_gauge(page, "entries", status="running") == 0
        assert ledger_gauge(page, "duplicate_executions") == 0
        assert ledger_gauge(page, "duplicate_execution_ratio") == 0
        assert ledger_gauge(page, "blocked_entries") == 0
        assert ledger_gauge(page, "expired_leases") == 0

        standalone = serve_standalone(tmp_path, pg_url)
        # Flower also serves the consumer watchdog's gauges, which it asks of the workers
        # (worker/watchdog_metrics.py); a standalone server has no workers to ask.
        from_flower = {
            k: v
            for k, v in samples(flower.metrics()).items()
            if not k[0].startswith("celery_ledger_consumer_")
        }
        assert_same_gauges(from_flower, samples(standalone))


def serve_standalone(tmp_path: Path, url: str) -> str:
    """Start ``celery-ledger metrics``, scrape it once, stop it."""
    port = free_port()
    with ProcessGroup(tmp_path) as group:
        proc = group.spawn("metrics", cli("--url", url, "metrics", "--port", str(port)))
        scraper = FlowerClient(port, auth=None)

        def page() -> str | None:
            assert proc.alive, proc.log_tail()
            status, body = scraper.get("/metrics")
            return body if status == 200 else None

        return str(wait_for(page, timeout=30, what="the standalone metrics endpoint"))


def test_worker_dash_e_alone_sends_ledger_events(tmp_path: Path, redis: str, pg_url: str) -> None:
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    client = Celery("client", broker=redis, backend=redis)
    port = free_port()
    flower = FlowerClient(port)
    with processes(tmp_path, env) as procs:
        start_flower(procs, port)
        procs.worker(extra=["-E"])
        probes: list[Any] = []

        def order_seen_by_flower() -> bool:
            probes.append(
                client.send_task(
                    "tests_app.order",
                    queue=env["TEST_QUEUE"],
                    kwargs={"order_id": "o-e", "amount": 1},
                )
            )
            probes[-1].get(timeout=30)
            time.sleep(1)
            return any(flower.state(p.id) == "SUCCESS" for p in probes)

        wait_for(order_seen_by_flower, timeout=60, interval=0, what="an order in Flower")
        page = flower.metrics()
        assert events_total(page, "task-ledger-claimed", "tests_app.order") == 1


def test_flower_task_list_tells_what_the_ledger_did(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    """What an operator sees today (design.md § "The Ledger page in Flower"), with real beat, worker
    and Flower processes.

    Beat sends a sweep every second before any worker runs, so a backlog of sweeps expires
    (revoked before any event names them); the worker's pool process is SIGKILLed when
    ``charge`` has started, the redelivery finds ``charge`` ambiguous and blocks the order;
    a CLI release (not executed) re-runs it to success.
    """
    from celery_ledger.app import SWEEP_TASK
    from celery_ledger.ledger import EntryStatus, LedgerStore, entry_key

    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, CELERY_LEDGER_SWEEP_INTERVAL=1)
    client = Celery("client", broker=redis, backend=redis)
    port = free_port()
    flower = FlowerClient(port)
    store = LedgerStore(pg_url)
    key = entry_key("tests_app.order", {"order_id": "o-blk"})
    try:
        with processes(tmp_path, env) as procs:
            start_flower(procs, port)
            beat = procs.beat()
            # the backlog the worker will find: sweeps sent while no worker consumes them
            beat.wait_log("Sending due task", count=4, timeout=60)
            procs.worker(
                extra=["-E"],
                concurrency=1,
                env={
                    "CELERY_LEDGER_CRASH_AT": "step-started:charge",
                    "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash-once"),
                },
            )

            def sweeps_seen() -> bool:
                page = flower.metrics()
                return events_total(page, "task-succeeded", SWEEP_TASK) >= 1 and (
                    events_total(page, "task-revoked", SWEEP_TASK) >= 1
                )

            wait_for(sweeps_seen, timeout=90, interval=0.5, what="sweeps (run and expired)")

            sent = client.send_task(
                "tests_app.order",
                kwargs={"order_id": "o-blk", "amount": 5},
                queue=env["TEST_QUEUE"],
            )
            # The pool process sends task-ledger-blocked itself; the worker's parent buffers
            # the task-failed that carries the exception and sends it a moment later.
            wait_for(
                lambda: (
                    flower.state(sent.id) == "LEDGER-BLOCKED"
                    and "LedgerBlocked" in (flower.tasks()[sent.id].get("exception") or "")
                ),
                timeout=90,
                interval=0.3,
                what="the order as LEDGER-BLOCKED in Flower's task list, with its exception",
            )
            assert store.get_entry(key).status is EntryStatus.BLOCKED
            task = flower.tasks()[sent.id]
            assert task["state"] == "LEDGER-BLOCKED", task
            assert "interrupted" in task["ledger"], task["ledger"]
            assert task["ledger"][-1] == "blocked", task["ledger"]
            # Flower's own search finds it by its state
            status, body = flower.get("/api/tasks?state=LEDGER-BLOCKED")
            assert status == 200 and sent.id in json.loads(body)

            release = procs.celery(
                "release",
                [
                    "ledger",
                    "release",
                    key,
                    "--verified",
                    "not-executed",
                    "--by",
                    "ops",
                    "--reason",
                    "provider shows no charge",
                ],
            )
            wait_for(lambda: release.proc.poll() is not None, timeout=60, what="the release")
            assert release.proc.returncode == 0, release.log_tail()
            assert sent.get(timeout=90)["order_id"] == "o-blk"
            wait_for(
                lambda: flower.state(sent.id) == "SUCCESS",
                timeout=30,
                interval=0.3,
                what="the released order as SUCCESS",
            )
            task = flower.tasks()[sent.id]
            assert task["exception"] is None and task["traceback"] is None, task
            assert task["failed"] is None
            # The CLI's process announced the release (task-ledger-released), then it re-ran.
            after_block = task["ledger"][task["ledger"].index("blocked") + 1 :]
            assert after_block[0] == "released", task["ledger"]
            assert after_block[1] in ("claimed", "resumed"), task["ledger"]
            assert after_block[-1] == "settled", task["ledger"]

            # The sweeps never became tasks, named or nameless.
            listed = flower.tasks()
            assert not [t for t in listed.values() if t.get("name") in (SWEEP_TASK, None, "")]
            assert not [t for t in listed if t.startswith("celery-ledger-sweep-")]
            page = flower.metrics()
            nameless = [
                labels
                for (name, labels), _ in samples(page, "flower_events_total").items()
                if dict(labels).get("task") == ""
            ]
            assert not nameless, nameless
    finally:
        store.dispose()


def test_flower_shows_interrupted_when_the_whole_worker_dies(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    """A worker SIGKILLed whole (parent and pool) sends no event: Flower's task list used to
    keep ``LEDGER-CLAIMED`` until the sweep resumed the task. Its heartbeats stop, so the task
    shows ``LEDGER-INTERRUPTED``; the sweep resumes it on another worker and it ends SUCCESS,
    with ``interrupted`` and ``resumed`` kept in its ``ledger`` field."""
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    client = Celery("client", broker=redis, backend=redis)
    port = free_port()
    flower = FlowerClient(port)
    with processes(tmp_path, env) as procs:
        start_flower(procs, port)
        w1 = procs.worker(
            "w1",
            extra=["-E"],
            concurrency=1,
            env={
                "CELERY_LEDGER_CRASH_AT": "step-completed:reserve@worker",
                "CELERY_LEDGER_CRASH_ONCE": str(tmp_path / "crash-once"),
                "CELERY_LEDGER_LEASE_SECONDS": "3",
            },
        )
        # Flower subscribes to events asynchronously: a plain task first, until Flower sees it.
        probes: list[str] = []

        def event_stream_live() -> bool:
            probes.append(
                client.send_task(
                    "tests_app.plain_add", kwargs={"x": 1, "y": 2}, queue=env["TEST_QUEUE"]
                ).id
            )
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if any(flower.state(p) == "SUCCESS" for p in probes):
                    return True
                time.sleep(0.2)
            return False

        wait_for(event_stream_live, timeout=60, interval=0, what="task events in Flower")
        victim = client.send_task(
            "tests_app.order", kwargs={"order_id": "w-1", "amount": 1}, queue=env["TEST_QUEUE"]
        ).id
        wait_for(lambda: not w1.alive, timeout=60, what="w1 killed whole after reserve")
        wait_for(
            lambda: flower.state(victim) == "LEDGER-INTERRUPTED",
            timeout=60,
            interval=0.5,
            what="the dead worker's task as LEDGER-INTERRUPTED",
        )
        procs.worker("w2", extra=["-E"], concurrency=1)
        sweep = procs.celery("sweep", ["ledger", "sweep"])
        wait_for(lambda: sweep.proc.poll() is not None, timeout=60, what="ledger sweep")
        wait_for(
            lambda: flower.state(victim) == "SUCCESS",
            timeout=90,
            interval=0.5,
            what="the resumed task SUCCESS",
        )
        marks = flower.tasks()[victim]["ledger"]
        assert marks.index("interrupted") < marks.index("resumed"), marks

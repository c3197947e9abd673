"""Real celery worker / beat / flower processes for tests, always cleaned up.

The processes themselves are ``celery_ledger.harness.processes`` (the one harness ``demo``,
``verify`` and the benchmarks use): each in a session of its own, every wait bounded in time.
What the tests add: the app is ``tests_app``, run from ``tests/`` (which goes first on
``PYTHONPATH``), each worker named after the test's id and consuming the test's own queue, and
a worker or beat is waited for until ready unless asked not to.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kombu

from celery_ledger.harness.processes import (
    Process,
    ProcessGroup,
    WaitTimeout,
    wait_for,
)

TESTS = Path(__file__).parent
REPO = TESTS.parent

#: How long a test's worker or beat may take to print its ready line.
READY_TIMEOUT = 60.0
#: A test's processes get this long to stop warmly before their groups are SIGKILLed.
STOP_TIMEOUT = 10.0

__all__ = [
    "REPO",
    "TESTS",
    "Process",
    "Processes",
    "WaitTimeout",
    "processes",
    "redelivering",
    "test_env",
    "wait_for",
]


class Processes:
    """A test's processes (``tests_app``, on the test's queue), logging to ``tmp_path``."""

    def __init__(self, group: ProcessGroup, env: dict[str, str]) -> None:
        self.group = group
        self.env = env

    def worker(
        self,
        name: str = "w1",
        *,
        concurrency: int = 2,
        extra: Iterable[str] = (),
        env: dict[str, str] | None = None,
        ready: bool = True,
    ) -> Process:
        proc = self.group.worker(
            name,
            queue=self.env["TEST_QUEUE"],
            node=f"{name}-{self.env['TEST_ID']}@%h",
            concurrency=concurrency,
            env=env,
            # Flower's tests need the workers' heartbeats; nothing else here minds them.
            heartbeat=True,
            extra=extra,
        )
        return proc.wait_ready(READY_TIMEOUT) if ready else proc

    def beat(self, name: str = "beat", *, env: dict[str, str] | None = None) -> Process:
        return self.group.beat(name, env=env).wait_ready(READY_TIMEOUT)

    def celery(self, name: str, args: list[str]) -> Process:
        """Any ``celery -A tests_app`` command (flower), not waited for."""
        return self.group.celery(name, args)

    def spawn(self, name: str, argv: list[str]) -> Process:
        """Any command (``celery-ledger metrics``), not waited for."""
        return self.group.spawn(name, argv)


@contextmanager
def processes(tmp_path: Path, env: dict[str, str]) -> Iterator[Processes]:
    """A test's processes; every one is stopped when the block ends, also when the test fails."""
    group = ProcessGroup(
        tmp_path,
        app="tests_app",
        env=env,
        cwd=TESTS,
        pythonpath=[TESTS],
        stop_timeout=STOP_TIMEOUT,
    )
    with group:
        yield Processes(group, dict(env))
        # A test waits inside the block for whatever it needs of its processes, so once the
        # block ends they are SIGKILLed, not stopped warmly: a warm shutdown cost 2 to 8 s per
        # test on a loaded machine and nothing checks it. A test that needs a warm stop calls
        # ``Process.stop`` itself. (A failing test still gets the warm stop, and its logs.)
        for proc in reversed(group.started):
            proc.kill()


def test_env(
    tmp_path: Path,
    *,
    broker: str | None,
    ledger_url: str,
    effects_url: str | None = None,
    **extra: Any,
) -> dict[str, str]:
    """Environment for tests_app: its own queue, data dir, broker, ledger and results."""
    test_id = uuid.uuid4().hex[:8]
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    env = {
        "TEST_ID": test_id,
        "TEST_QUEUE": f"q-{test_id}",
        "CELERY_LEDGER_DATA_DIR": str(data),
        "CELERY_LEDGER_URL": ledger_url,
        "TEST_EFFECTS_URL": effects_url or ledger_url,
        "CELERY_RESULT_BACKEND": f"db+sqlite:///{data / 'results.sqlite3'}",
    }
    if broker:
        env["CELERY_BROKER_URL"] = broker
        if broker.startswith("redis"):
            env["CELERY_RESULT_BACKEND"] = broker
    env.update({k: str(v) for k, v in extra.items()})
    return env


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@contextmanager
def redelivering(env: dict[str, str]) -> Iterator[None]:
    """Redis's redelivery, once a second: its unacked messages past the test's visibility
    timeout (``TEST_VISIBILITY_TIMEOUT``) go back to their queues, for another worker to take.

    On kombu 5.7 the workers do it themselves, as often as tests_app asks
    (``unacked_restore_interval`` and ``_throttle``). kombu 5.4 to 5.6 have neither setting:
    a worker scans every 100 s (every 10th call of a 10 s timer), so a task of a few seconds
    is acked before any scan finds it, and it is never delivered twice. There this process
    runs the same scan (``QoS.restore_visible``) on a connection of its own: the unacked
    messages are the Redis database's, not one worker's.
    """
    if kombu.VERSION >= (5, 7):
        yield
        return
    stop = threading.Event()
    options = {"visibility_timeout": float(env["TEST_VISIBILITY_TIMEOUT"])}

    def scan() -> None:
        with kombu.Connection(env["CELERY_BROKER_URL"], transport_options=options) as conn:
            qos = conn.default_channel.qos
            while not stop.wait(1.0):
                qos.restore_visible(num=100, interval=1)

    thread = threading.Thread(target=scan, name="redelivering", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)

"""Real celery worker / beat / flower processes for tests, always cleaned up.

Each process runs in a session of its own (``start_new_session``), so stopping it by its pid's
process group reaches its pool processes too, and never anything this test did not start.
Every wait is bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parent
REPO = TESTS.parent


def wait_for(
    predicate: Callable[[], Any], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class CeleryProcess:
    """One ``celery`` command (worker, beat, flower) started in its own session."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str],
        log_path: Path,
        app: str = "tests_app",
        cwd: Path = TESTS,
    ) -> None:
        self.args = [sys.executable, "-m", "celery", "-A", app, *args]
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryProcess:
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args,
            cwd=self.cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, text: str, *, timeout: float = 30, count: int = 1) -> None:
        def seen() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"process exited ({self.proc.returncode}) before "
                    f"{text!r}:\n{self.log()[-3000:]}"
                )
            return self.log().count(text) >= count

        try:
            wait_for(seen, timeout=timeout, what=f"{text!r} in {self.log_path.name}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- log tail ---\n{self.log()[-3000:]}") from None

    def children(self) -> list[int]:
        """Pids of this process's direct children (the prefork pool processes)."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL the process and everything in its session (its pool processes)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGCONT)  # a stopped process cannot exit
                # The parent only: a warm shutdown. SIGTERM to the whole group would kill the
                # pool processes, and the parent would fork new ones and keep consuming.
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.kill_all()
        self._log.close()


class Processes:
    """A test's processes; ``stop_all`` runs even when the test fails."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = dict(env)
        self.started: list[CeleryProcess] = []

    def worker(
        self,
        name: str = "w1",
        *,
        concurrency: int = 2,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        ready: bool = True,
    ) -> CeleryProcess:
        queue = self.env["TEST_QUEUE"]
        args = [
            "worker",
            "-c",
            str(concurrency),
            "-Q",
            queue,
            "-n",
            f"{name}-{self.env['TEST_ID']}@%h",
            "-l",
            "info",
            "--without-mingle",
            "--without-gossip",
            *(extra or []),
        ]
        proc = CeleryProcess(
            args, env={**self.env, **(env or {})}, log_path=self.tmp_path / f"{name}.log"
        ).start()
        self.started.append(proc)
        if ready:
            proc.wait_log(" ready.", timeout=60)
        return proc

    def beat(self, name: str = "beat", *, env: dict[str, str] | None = None) -> CeleryProcess:
        schedule = self.tmp_path / f"{name}-schedule"
        proc = CeleryProcess(
            ["beat", "-l", "info", "-s", str(schedule)],
            env={**self.env, **(env or {})},
            log_path=self.tmp_path / f"{name}.log",
        ).start()
        self.started.append(proc)
        proc.wait_log("beat: Starting", timeout=60)
        return proc

    def command(self, args: list[str], name: str) -> CeleryProcess:
        proc = CeleryProcess(args, env=self.env, log_path=self.tmp_path / f"{name}.log").start()
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()


@contextmanager
def processes(tmp_path: Path, env: dict[str, str]) -> Iterator[Processes]:
    procs = Processes(tmp_path, env)
    try:
        yield procs
    finally:
        procs.stop_all()


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

"""Brokers of a test's own, to cut and restart: a redis-server and a RabbitMQ node.

The shared servers (Redis on 6379, RabbitMQ on 5672) are never restarted; a test that cuts
its broker starts one of these on free ports, kills it with SIGKILL (no goodbye to any
client) and starts it again on the same ports. Each is stopped by its own process id.

Without the server program a test skips, and fails under ``CI=true``
(``celery_ledger.harness.pgbouncer`` does the same).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from celery_ledger.harness.processes import wait_for


def _missing(program: str, why: str = "") -> None:
    why = why or f"{program} is not installed"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class OwnRedis:
    """A redis-server without persistence: a restart loses every queued message."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None:
            _missing("redis-server")
        self.port = free_port()
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: port_open(self.port), timeout=20, what="redis-server")

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.proc = None

    def stop(self) -> None:
        """Kill the node and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class OwnRabbitMQ:
    """A second RabbitMQ node (its own name, ports, database and logs) beside the shared one.

    Durable queues and persistent messages survive its restart (the message store is on
    disk); what a consumer held unacknowledged is ready again after it. Its directory is a
    new one under the system's temporary folder (a test's own ``tmp_path`` is not readable by
    the ``rabbitmq`` user the node runs as), removed by ``stop``.
    """

    def __init__(self) -> None:
        if shutil.which("rabbitmq-server") is None:
            _missing("rabbitmq-server")
        directory = Path(tempfile.mkdtemp(prefix="celery-ledger-rabbitmq-"))
        directory.chmod(0o755)
        self.dir = directory
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"ledger{self.port}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        (directory / "enabled_plugins").write_text("[].\n")
        (directory / "rabbitmq.conf").write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        (directory / "env").write_text("")
        for sub in ("mnesia", "log"):
            (directory / sub).mkdir(exist_ok=True)
        # Started as root, rabbitmq-server runs the node as the rabbitmq user.
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", str(directory)], check=False)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def pid_file(self) -> Path:
        return self.dir / "node.pid"

    def _env(self) -> dict[str, str]:
        d = self.dir
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "env"),
        }

    def start(self, timeout: float = 90.0) -> None:
        self.pid_file.unlink(missing_ok=True)
        with open(self.dir / "server.out", "ab") as out:
            self.proc = subprocess.Popen(
                ["rabbitmq-server"],
                env=self._env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(
            lambda: port_open(self.port) or self.proc is None or self.proc.poll() is not None,
            timeout=timeout,
            what="the second RabbitMQ node",
        )
        if not port_open(self.port):
            tail = (self.dir / "server.out").read_text(errors="replace")[-600:]
            if not self._started_once:  # this machine cannot run a second node
                self.stop()
                _missing("rabbitmq-server", f"a second RabbitMQ node does not start here: {tail}")
            raise RuntimeError(f"the second RabbitMQ node did not start again: {tail}")
        self._started_once = True

    def _node_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the node's Erlang VM, then its launcher; wait until the port is closed."""
        pid = self._node_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None
        deadline = time.monotonic() + 30
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        """Kill the node and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

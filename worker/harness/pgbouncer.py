"""A PgBouncer of the tests' own, in transaction pooling, in front of a PostgreSQL server.

The ledger must work behind a transaction pooler (docs/operations.md § "Deploying"): a
client's consecutive transactions may run on different server sessions, and a server session
goes from one client to the next. ``OwnPgBouncer`` starts Debian's ``pgbouncer`` (or
``CELERY_LEDGER_PGBOUNCER``) on a free port of 127.0.0.1 with a configuration, user list,
log and pid file in a temporary directory of its own, ``pool_mode = transaction`` and a
small pool (two server connections per database and user, so that sessions are shared by
every client), in front of the given server with trust authentication. It runs in the
foreground, as a child of the test, and ``close`` stops it by its PID; nobody else's
pgbouncer is touched.

PgBouncer refuses to run as root: run as root, it runs as the ``postgres`` user, which owns the
directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from celery_ledger.harness.pgserver import free_port

#: Server connections per database and user: few, so that clients share sessions.
POOL_SIZE = 2


class PgBouncerUnavailable(RuntimeError):
    """No pgbouncer on this machine, or it would not start."""


def find_pgbouncer() -> str:
    """The pgbouncer executable (``CELERY_LEDGER_PGBOUNCER``, or on PATH, or Debian's)."""
    configured = os.environ.get("CELERY_LEDGER_PGBOUNCER")
    for candidate in (configured, shutil.which("pgbouncer"), "/usr/sbin/pgbouncer"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise PgBouncerUnavailable(
        "pgbouncer is not installed (apt-get install pgbouncer), "
        "or set CELERY_LEDGER_PGBOUNCER to its path"
    )


class OwnPgBouncer:
    """One throwaway pgbouncer: ``start`` it, use ``url(dbname)``, ``close`` it."""

    def __init__(
        self,
        server_host: str = "127.0.0.1",
        server_port: int = 5432,
        *,
        pool_mode: str = "transaction",
        pool_size: int = POOL_SIZE,
    ) -> None:
        self.executable = find_pgbouncer()
        self.root = Path(tempfile.mkdtemp(prefix="celery-ledger-pgbouncer-"))
        self.port = free_port()
        self.log = self.root / "pgbouncer.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._run_as: dict[str, Any] = {}
        (self.root / "userlist.txt").write_text('"postgres" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={server_host} port={server_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            "unix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.root / 'userlist.txt'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n"
            "max_client_conn = 500\n"
            f"logfile = {self.log}\npidfile = {self.root / 'pgbouncer.pid'}\n"
        )
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PgBouncerUnavailable(
                    "pgbouncer refuses to run as root and there is no postgres user"
                ) from None
            self._run_as = {"user": user.pw_uid, "group": user.pw_gid}
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)

    def url(self, dbname: str = "postgres") -> str:
        """A ledger URL for ``dbname`` through this pgbouncer (no pooler declared)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self, timeout: float = 30.0) -> None:
        """Start pgbouncer and wait until it accepts connections (bounded by ``timeout``)."""
        self.proc = subprocess.Popen(
            [self.executable, str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.root,
            **self._run_as,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PgBouncerUnavailable(
                    f"pgbouncer exited ({self.proc.returncode}): {self.tail()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise PgBouncerUnavailable(f"pgbouncer did not listen within {timeout:g} s")

    def tail(self) -> str:
        """The last line of pgbouncer's log (for a failure message)."""
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def close(self) -> None:
        """Stop pgbouncer (SIGTERM, then SIGKILL after 10 s) and remove its directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

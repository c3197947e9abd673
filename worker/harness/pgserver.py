"""A PostgreSQL server of verify's own, to crash (``verify --crash-ledger``, design.md § "Durability
follows effects").

``initdb`` into a temporary directory, started by ``pg_ctl`` on a free port of 127.0.0.1, from
the binaries installed on the machine (``/usr/lib/postgresql/<version>/bin``, or
``CELERY_LEDGER_PG_BINDIR``). ``crash`` is ``pg_ctl stop -m immediate``: the postmaster and its
backends quit without a checkpoint, and the WAL buffers in shared memory are gone, so a commit
that had not reached the WAL file (``synchronous_commit = off``) is lost; ``start`` recovers
from the WAL on disk, as after a power cut of the server process. Nobody else's server is ever
touched.

PostgreSQL refuses to run as root: run as root, the server runs as the ``postgres`` user,
which owns the directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

#: How often the WAL writer flushes asynchronous commits (PostgreSQL's default is 200 ms). A
#: longer delay leaves more of them in shared memory for a crash to take: the harsher test.
WAL_WRITER_DELAY = "1000ms"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine, or the server would not start."""


def find_bindir() -> Path:
    """The newest ``bin`` directory that holds ``initdb`` and ``pg_ctl``."""
    configured = os.environ.get("CELERY_LEDGER_PG_BINDIR")
    candidates = (
        [configured] if configured else sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_ver)
    )
    for path in reversed(candidates):
        if (Path(path) / "initdb").exists() and (Path(path) / "pg_ctl").exists():
            return Path(path)
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin; "
        "set CELERY_LEDGER_PG_BINDIR to their directory"
    )


def _ver(path: str) -> tuple[int, ...]:
    version = Path(path).parent.name
    return tuple(int(p) for p in version.split(".") if p.isdigit()) or (0,)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnPostgres:
    """One throwaway PostgreSQL cluster: ``start``, ``crash``, ``start`` again, ``close``."""

    def __init__(self) -> None:
        self.bindir = find_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="celery-ledger-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.crashes = 0
        self._run_as: dict[str, Any] = {}
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable(
                    "PostgreSQL refuses to run as root and there is no postgres user"
                ) from None
            self._run_as = {"user": user.pw_uid, "group": user.pw_gid}
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._pg(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        """Start the server (after a crash: recover from the WAL) and wait until it accepts."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            f"-c wal_writer_delay={WAL_WRITER_DELAY} -c max_connections=200"
        )
        self._pg(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: quit without a checkpoint, losing the WAL buffers."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self.crashes += 1

    def stop(self) -> None:
        with contextlib.suppress(PostgresUnavailable):
            self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop")

    def close(self) -> None:
        """Stop the server and remove its directory."""
        if (self.data / "postmaster.pid").exists():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _pg(self, program: str, *args: str) -> None:
        proc = subprocess.run(
            [str(self.bindir / program), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=self.root,
            **self._run_as,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise PostgresUnavailable(f"{program} failed ({proc.returncode}): {tail[0]}")

"""The CLI's check of a SQLite ledger file must not drop the SQLite locks of its own process.

POSIX record locks belong to a process and a file, and closing *any* descriptor of that file
drops them all. A process that holds SQLite connections to the ledger and then reads the
file's header with ``open()`` and ``close()`` (``celery-ledger`` called in-process, as the
tests and an operator's script do) loses the shared lock its connections hold. Another
process closing its own connection then believes it is the last one: it checkpoints and
deletes the WAL that the first process still uses, which goes on reading and writing an
orphaned WAL that no other process sees, and loses what it wrote there when it is killed.
Seen in ``test_faults_task.py``: the test's process read an old view of the ledger while the
workers wrote a new one.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from celery_ledger.cli.common import sqlite_file_problem


def wal_database(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x INTEGER)")
    conn.execute("INSERT INTO t VALUES (1)")
    return conn


def other_process_reads_and_closes(path: Path) -> None:
    code = (
        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
        "c.execute('SELECT * FROM t').fetchall(); c.close()"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)


def test_checking_the_file_keeps_this_processs_wal_alive(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    mine = wal_database(path)
    try:
        assert sqlite_file_problem(str(path)) is None
        other_process_reads_and_closes(path)
        # This process's connection is open: the WAL is still in use, so the other process
        # must have left it in place.
        assert Path(f"{path}-wal").exists(), "the check dropped this process's SQLite locks"
        mine.execute("INSERT INTO t VALUES (2)")
        seen = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute("
                "'SELECT count(*) FROM t').fetchone()[0])",
                str(path),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert seen.stdout.strip() == "2", "another process does not see this process's write"
    finally:
        mine.close()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "no ledger database at"),
        (b"", "is an empty file"),
        (
            b"this is not a database, just some text long enough to have a header" * 2,
            "not an SQLite file",
        ),
    ],
)
def test_the_check_still_names_a_missing_empty_or_foreign_file(
    tmp_path: Path, content: bytes | None, says: str
) -> None:
    path = tmp_path / "ledger.sqlite3"
    if content is not None:
        path.write_bytes(content)
    problem = sqlite_file_problem(str(path))
    assert problem is not None and says in problem, problem
    if content is not None:
        assert path.read_bytes() == content  # the check wrote nothing into it
    else:
        assert not path.exists()
    assert not Path(f"{path}-wal").exists() and not Path(f"{path}-journal").exists()
    assert os.listdir(tmp_path) == ([] if content is None else ["ledger.sqlite3"])

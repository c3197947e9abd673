"""Bad input at the CLI (guarantees.md § "The hardening faults"): the failing-first tests.

Each case must print one line on stderr, in the ledger's own words (no driver text, no
SQLAlchemy web link, no "None"), exit non-zero, and change nothing. The commands run in-process
through ``celery_ledger.cli.main.main`` with click's runner, in a working directory of their own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from celery_ledger.cli.main import main
from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner
from celery_ledger.ledger.engine import make_engine

#: What only a driver or SQLAlchemy says; the ledger says it in its own words.
RAW = ("sqlalche.me", "Background on this error", "sqlite3.", "psycopg.", "(sqlite3", "None")

COMMANDS = [
    ["list"],
    ["list", "--stuck"],
    ["show", "abc"],
    ["stats"],
    ["sweep"],
    ["resume", "abc"],
    ["release", "abc", "--verified", "not-executed", "--by", "a", "--reason", "r"],
    ["migrate", "--plan"],
]


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Invoke ``celery-ledger`` in-process from ``tmp_path/cwd`` with a clean environment."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for name in (
        "CELERY_LEDGER_URL",
        "CELERY_BROKER_URL",
        "CELERY_RESULT_BACKEND",
        "CELERY_LEDGER_OPERATOR_TOKENS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NO_COLOR", "1")
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(main, list(args), catch_exceptions=True)

    return invoke


def assert_one_clear_line(result: Any, *words: str) -> str:
    """Exit non-zero, no traceback, one ``Error:`` line without driver text."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"raised {result.exception!r}"
    )
    assert result.exit_code != 0, f"exit 0:\n{result.output}"
    err = result.stderr.strip()
    assert err.startswith("Error: ") and "\n" not in err, err
    for raw in RAW:
        assert raw not in err, f"raw {raw!r} in: {err}"
    for word in words:
        assert word in err, err
    return str(err)


def blocked_entry(url: str) -> str:
    store = LedgerStore(url)
    try:
        claim = store.claim(
            ClaimRequest(
                key="k-blocked",
                task_name="shop.charge",
                task_id="t-blocked",
                args_hash="task-id",
                snapshot=None,
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            )
        )
        assert store.settle("k-blocked", claim.fence, EntryStatus.BLOCKED, reason="parked")
    finally:
        store.dispose()
    return "k-blocked"


# -- a file that is not SQLite ------------------------------------------------------------------


@pytest.mark.parametrize("args", COMMANDS + [["migrate"]], ids=lambda a: " ".join(a[:2]))
def test_a_file_that_is_not_sqlite_is_one_clear_line(cli: Any, tmp_path: Path, args: list[str]):
    garbage = tmp_path / "notes.txt"
    content = b"these are my notes, not a database\n" * 200
    garbage.write_bytes(content)
    result = cli("--url", f"sqlite:///{garbage}", *args)
    assert_one_clear_line(result, str(garbage))
    assert garbage.read_bytes() == content, "the file was changed"


# -- an empty file --------------------------------------------------------------------------------


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_an_empty_file_is_one_clear_line(cli: Any, tmp_path: Path, args: list[str]):
    """An empty file is an SQLite database without a ledger: say so (and that `migrate`
    creates one), not "schema is at None"."""
    empty = tmp_path / "empty.sqlite3"
    empty.write_bytes(b"")
    result = cli("--url", f"sqlite:///{empty}", *args)
    if args == ["migrate", "--plan"]:
        # A plan for an empty database is a fair question: answer it, in words.
        assert result.exit_code == 0 and "None" not in result.output, result.output
    else:
        assert_one_clear_line(result, "migrate")
    assert empty.read_bytes() == b""


# -- --url "" ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["list"], ["stats"], ["sweep"]], ids=lambda a: a[0])
def test_an_empty_url_is_refused_not_replaced_by_the_default(
    cli: Any, tmp_path: Path, args: list[str]
):
    """``--url ""`` silently fell back to the default ledger under the data directory; an
    operator who typed a URL (even an empty one from an unset shell variable) must not
    operate on another ledger."""
    default = LedgerStore(f"sqlite:///{tmp_path / 'data' / 'ledger.sqlite3'}")
    default.claim(
        ClaimRequest(
            key="k-default",
            task_name="shop.charge",
            task_id="t-default",
            args_hash="task-id",
            snapshot=None,
            side_effect="non_idempotent",
            owner=Owner("w@h", "b", 1),
            lease_seconds=-1.0,
        )
    )
    default.dispose()
    result = cli("--url", "", *args)
    assert_one_clear_line(result, "--url")
    check = LedgerStore(f"sqlite:///{tmp_path / 'data' / 'ledger.sqlite3'}")
    try:
        assert check.get_entry("k-default").status is EntryStatus.RUNNING  # not swept
    finally:
        check.dispose()


# -- doctor ----------------------------------------------------------------------------------------


def doctor_checks(cli: Any, url: str) -> tuple[int, dict[str, dict[str, str]]]:
    result = cli("--url", url, "doctor", "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"raised {result.exception!r}"
    )
    data = json.loads(result.stdout)
    return result.exit_code, {c["name"]: c for c in data["checks"]}


def test_doctor_fails_the_backend_on_a_garbage_file(cli: Any, tmp_path: Path) -> None:
    garbage = tmp_path / "notes.txt"
    garbage.write_bytes(b"not a database\n" * 100)
    code, checks = doctor_checks(cli, f"sqlite:///{garbage}")
    assert code != 0
    assert checks["backend"]["status"] != "PASS", checks["backend"]
    for raw in RAW[:4]:
        assert raw not in checks["schema"]["reason"], checks["schema"]


def test_doctor_fails_the_backend_on_a_newer_schema(cli: Any, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    made = LedgerStore(url)
    made.ensure_ready()
    made.dispose()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE ledger_alembic_version SET version_num = 'f00d'"))
    engine.dispose()
    code, checks = doctor_checks(cli, url)
    assert code != 0 and checks["schema"]["status"] == "FAIL"
    assert checks["backend"]["status"] != "PASS", checks["backend"]


# -- fault 14: unbounded operator text ----------------------------------------------------------


@pytest.mark.parametrize("field", ["--reason", "--by"])
def test_release_with_a_megabyte_of_text_is_refused(cli: Any, tmp_path: Path, field: str):
    """``release --reason`` of 1 MB was accepted, and every later ``show`` of the entry took
    seconds and printed megabytes."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    key = blocked_entry(url)
    options = {"--by": "alice", "--reason": "checked the provider"}
    options[field] = "x" * 1_000_000
    result = cli(
        "--url", url, "release", key, "--verified", "not-executed", *sum(options.items(), ())
    )
    assert_one_clear_line(result, field)
    check = LedgerStore(url)
    try:
        entry = check.get_entry(key)
        assert (entry.status, entry.released_by) == (EntryStatus.BLOCKED, None)
    finally:
        check.dispose()


# -- fault 12 and 14: what `show` prints of stored text it did not write ------------------------


def test_show_prints_stored_text_escaped_and_an_unreadable_snapshot_in_words(
    cli: Any, tmp_path: Path
) -> None:
    """A task id and a reason carrying terminal escapes are printed escaped, never sent to
    the terminal; a snapshot nested too deeply to decode is shown as such, not a traceback."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    deep = '{"args":[' + "[" * 5000 + "]" * 5000 + '],"kwargs":{}}'
    store = LedgerStore(url)
    try:
        claim = store.claim(
            ClaimRequest(
                key="k-hostile",
                task_name="shop.charge",
                task_id="t-\x1b[2J-clear",
                args_hash="task-id",
                snapshot=deep,
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            )
        )
        assert store.settle(
            "k-hostile", claim.fence, EntryStatus.BLOCKED, reason="line\n\x1b]0;title\x07"
        )
    finally:
        store.dispose()
    shown = cli("--url", url, "show", "k-hostile")
    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.output and "\x07" not in shown.output
    assert "t-\\x1b[2J-clear" in shown.output and "line\\n\\x1b]0;title\\x07" in shown.output
    assert "arguments    cannot be read: nested too deeply to decode" in shown.output
    data = json.loads(cli("--url", url, "show", "k-hostile", "--json").stdout)
    assert data["snapshot"] is None and "nested too deeply" in data["unreadable"]["snapshot"]
    listed = cli("--url", url, "list", "--stuck")
    assert listed.exit_code == 0 and "\x1b" not in listed.output


def test_an_overdue_retry_is_stuck_with_what_moves_it_on(cli: Any, tmp_path: Path) -> None:
    """guarantees.md § "The hardening faults", fault 3: a retry past its due time is in ``list
    --stuck``; with a snapshot the sweep re-sends it, without one the operator must."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    store = LedgerStore(url)
    try:
        for key, snapshot in (("k-late", '{"args":[1],"kwargs":{}}'), ("k-bare", None)):
            claim = store.claim(
                ClaimRequest(
                    key=key,
                    task_name="shop.charge",
                    task_id=f"t-{key}",
                    args_hash="task-id",
                    snapshot=snapshot,
                    side_effect="non_idempotent",
                    owner=Owner("w@h", "b", 1),
                    lease_seconds=60.0,
                )
            )
            assert store.settle(key, claim.fence, EntryStatus.RETRYING, due_in=-5.0)
    finally:
        store.dispose()
    data = json.loads(cli("--url", url, "list", "--stuck", "--json").stdout)
    actions = {e["key"]: (e["status"], e["next_action"]) for e in data["entries"]}
    assert actions == {"k-late": ("retrying", "sweep"), "k-bare": ("retrying", "resend")}
    assert all(e["due_at"] is not None for e in data["entries"])

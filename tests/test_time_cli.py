"""Durable time (design.md § "Durable time") at the CLI: ``cancel`` and ``resume`` of scheduled
entries, and bad input.

In-process through ``celery_ledger.cli.main.main`` (``test_cli_bad_input``'s ``cli`` fixture) on
the embedded SQLite ledger: what a command writes is read back from the store. Bad input is one
line in the ledger's own words, a non-zero exit, and nothing changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli_bad_input import assert_one_clear_line

from celery_ledger.cli.main import main
from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``celery-ledger`` in-process from ``tmp_path/cwd`` with a clean environment (as
    ``test_cli_bad_input``'s)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for name in ("CELERY_LEDGER_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CELERY_LEDGER_OPERATOR_TOKENS", raising=False)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NO_COLOR", "1")
    runner = CliRunner()
    return lambda *args: runner.invoke(main, list(args), catch_exceptions=True)


def scheduled_entry(url: str, key: str = "k-sched", due_in: float = 3600.0) -> str:
    store = LedgerStore(url)
    try:
        assert store.schedule(
            ClaimRequest(
                key=key,
                task_name="shop.remind",
                task_id=f"t-{key}",
                args_hash="task-id",
                snapshot='{"args": [1], "kwargs": {}, "queue": null, "ledger_key": null}',
                side_effect="non_idempotent",
                owner=Owner("producer", None, None),
                lease_seconds=60.0,
            ),
            due_in=due_in,
        )
    finally:
        store.dispose()
    return key


def running_entry(url: str, key: str = "k-run") -> int:
    store = LedgerStore(url)
    try:
        claim = store.claim(
            ClaimRequest(
                key=key,
                task_name="shop.charge",
                task_id=f"t-{key}",
                args_hash="task-id",
                snapshot=None,
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            )
        )
    finally:
        store.dispose()
    return claim.fence


def status_of(url: str, key: str) -> EntryStatus:
    store = LedgerStore(url)
    try:
        return store.get_entry(key).status
    finally:
        store.dispose()


def url_of(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'data' / 'ledger.sqlite3'}"


def test_cancel_settles_a_scheduled_entry_and_list_shows_it(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    key = scheduled_entry(url)
    listed = json.loads(cli("--url", url, "list", "--status", "scheduled", "--json").stdout)
    assert [e["key"] for e in listed["entries"]] == [key]
    assert listed["entries"][0]["hint"].startswith("due in")
    done = cli("--url", url, "cancel", key, "--by", "ops", "--reason", "customer asked")
    assert done.exit_code == 0, done.output
    assert "scheduled -> cancelled" in done.stdout
    assert status_of(url, key) is EntryStatus.CANCELLED
    listed = json.loads(cli("--url", url, "list", "--status", "cancelled", "--json").stdout)
    assert [e["key"] for e in listed["entries"]] == [key]


def test_cancel_of_a_running_entry_is_recorded_and_refuses_its_next_effect_start(
    cli: Any, tmp_path: Path
) -> None:
    """The attempt's next ``started`` write is refused, and the store says why."""
    url = url_of(tmp_path)
    fence = running_entry(url)
    done = cli("--url", url, "cancel", "t-k-run", "--by", "ops", "--reason", "stop it")
    assert done.exit_code == 0, done.output
    assert "next effect step" in done.stdout
    store = LedgerStore(url)
    try:
        assert store.get_entry("k-run").status is EntryStatus.RUNNING
        from celery_ledger.ledger import StepStatus

        started = store.write_step(
            "k-run", fence, ("charge", "h" * 64, 0), seq=1, status=StepStatus.STARTED
        )
        assert started is False, "an effect step started after the cancellation"
        assert store.stop_reason("k-run", fence) == "cancelled"
    finally:
        store.dispose()


def test_resume_sends_a_scheduled_entry_now(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    key = scheduled_entry(url)
    done = cli("--url", url, "resume", key)
    assert done.exit_code == 0, done.output
    assert "sent" in done.stdout
    store = LedgerStore(url)
    try:
        entry = store.get_entry(key)
        # Woken: running under the resume marker, its due time kept until a claim runs it.
        assert entry.status is EntryStatus.RUNNING and entry.due_at is not None
        assert store.list_due() == []
        assert "woken" in [e.event for e in store.entry_events(key)]
    finally:
        store.dispose()


def test_cancel_without_by_or_reason_is_one_clear_line(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    key = scheduled_entry(url)
    assert_one_clear_line(cli("--url", url, "cancel", key, "--reason", "r"), "--by")
    assert_one_clear_line(cli("--url", url, "cancel", key, "--by", "ops"), "--reason")
    assert_one_clear_line(
        cli("--url", url, "cancel", key, "--by", "ops", "--reason", "bad\x1b[2Jtext"),
        "control character",
    )
    assert status_of(url, key) is EntryStatus.SCHEDULED


def test_cancel_of_an_unknown_or_settled_entry_is_one_clear_line(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    key = scheduled_entry(url)
    assert_one_clear_line(
        cli("--url", url, "cancel", "nope", "--by", "ops", "--reason", "r"), "no ledger entry"
    )
    assert cli("--url", url, "cancel", key, "--by", "ops", "--reason", "r").exit_code == 0
    assert_one_clear_line(
        cli("--url", url, "cancel", key, "--by", "ops", "--reason", "again"),
        "cancelled already",
    )


def test_list_stuck_shows_a_scheduled_entry_past_its_due_time(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    late = scheduled_entry(url, "k-late", due_in=-60.0)
    scheduled_entry(url, "k-later", due_in=3600.0)
    listed = json.loads(cli("--url", url, "list", "--stuck", "--json").stdout)
    assert [e["key"] for e in listed["entries"]] == [late]
    assert listed["entries"][0]["hint"] == "due now: the sweep sends it"

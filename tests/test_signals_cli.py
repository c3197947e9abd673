"""Durable signals (design.md § "Durable signals") at the CLI: ``celery-ledger signal`` keeps a
signal for a task, sends a waiting one now, and refuses bad input in one line.

In-process on the embedded SQLite ledger, as ``test_time_cli``: what a command writes is read
back from the store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli_bad_input import assert_one_clear_line
from test_time_cli import running_entry, url_of

from celery_ledger.cli.main import main
from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner
from celery_ledger.ledger.signals import wait_reason


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``celery-ledger`` in-process, as ``test_time_cli``'s."""
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


def waiting_entry(url: str, key: str = "k-wait", name: str = "approved") -> None:
    """An entry asleep in ``wait_for(name)``, with an argument snapshot to be sent with."""
    store = LedgerStore(url)
    try:
        claim = store.claim(
            ClaimRequest(
                key=key,
                task_name="shop.approve",
                task_id=f"t-{key}",
                args_hash="task-id",
                snapshot='{"args": [1], "kwargs": {}, "queue": null, "ledger_key": null}',
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            )
        )
        assert store.settle(
            key, claim.fence, EntryStatus.SLEEPING, due_in=3600.0, reason=wait_reason(name)
        )
    finally:
        store.dispose()


def test_signal_sends_a_waiting_task_now(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    running_entry(url)  # makes the ledger; the waiting entry is another
    waiting_entry(url)
    done = cli("--url", url, "signal", "k-wait", "approved", "--payload", '{"ok": true}')
    assert done.exit_code == 0, done.output
    assert "it was waiting; sent now" in done.stdout
    store = LedgerStore(url)
    try:
        entry = store.get_entry("k-wait")
        assert entry.status is EntryStatus.RUNNING  # woken: the sweep's own wake
        events = [e.event for e in store.entry_events("k-wait")]
        assert events[-2:] == ["signalled", "woken"], events
        [row] = store.signals_of("k-wait")
        assert (row.name, json.loads(row.payload or ""), row.wait) == (
            "approved",
            {"ok": True},
            None,
        )
    finally:
        store.dispose()


def test_signal_to_a_task_not_waiting_is_kept_for_its_wait(cli: Any, tmp_path: Path) -> None:
    url = url_of(tmp_path)
    running_entry(url)
    done = cli("--url", url, "signal", "t-k-run", "approved", "--json")  # by task id
    assert done.exit_code == 0, done.output
    said = json.loads(done.stdout)
    assert said["key"] == "k-run" and said["woken"] is False and said["status"] == "running"
    store = LedgerStore(url)
    try:
        assert store.get_entry("k-run").status is EntryStatus.RUNNING
        assert [(r.name, r.payload) for r in store.signals_of("k-run")] == [("approved", "null")]
    finally:
        store.dispose()


def test_signal_to_an_unknown_or_settled_key_or_with_bad_json_is_one_clear_line(
    cli: Any, tmp_path: Path
) -> None:
    url = url_of(tmp_path)
    fence = running_entry(url)
    assert_one_clear_line(cli("--url", url, "signal", "nope", "go"), "no ledger entry")
    assert_one_clear_line(
        cli("--url", url, "signal", "k-run", "go", "--payload", "{bad"), "--payload is not JSON"
    )
    assert_one_clear_line(
        cli("--url", url, "signal", "k-run", "go", "--payload", "NaN"), "--payload is not JSON"
    )
    assert_one_clear_line(cli("--url", url, "signal", "k-run", "bad\nname"), "signal name")
    store = LedgerStore(url)
    try:
        assert store.signals_of("k-run") == []
        assert store.settle("k-run", fence, EntryStatus.COMPLETED, result="null")
    finally:
        store.dispose()
    assert_one_clear_line(
        cli("--url", url, "signal", "k-run", "go"), "k-run is completed", "not kept"
    )


def test_a_payload_is_sealed_at_rest_and_shown_redacted(
    cli: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """With ``ledger_snapshot_keys`` the payload is stored sealed; ``show`` opens it and hides
    a secret name (``ledger_redact``) at any depth, as it does an argument's."""
    from cryptography.fernet import Fernet

    monkeypatch.setenv("CELERY_LEDGER_SNAPSHOT_KEYS", Fernet.generate_key().decode())
    monkeypatch.setenv("CELERY_LEDGER_REDACT", "card_number")
    url = url_of(tmp_path)
    running_entry(url)
    payload = '{"approved": true, "billing": {"card_number": "4111111111111111"}}'
    done = cli("--url", url, "signal", "k-run", "approved", "--payload", payload)
    assert done.exit_code == 0, done.output
    store = LedgerStore(url)
    try:
        [row] = store.signals_of("k-run")
        assert row.payload is not None and row.payload.startswith("fernet:"), row.payload
        assert "4111" not in row.payload
    finally:
        store.dispose()
    shown = json.loads(cli("--url", url, "show", "k-run", "--json").stdout)
    assert shown["signals"][0]["payload"] == {
        "approved": True,
        "billing": {"card_number": "[redacted]"},
    }
    text = cli("--url", url, "show", "k-run").stdout
    assert "pending: kept for the next wait" in text and "[redacted]" in text
    assert "4111111111111111" not in text
    # Without the key here, the payload is unreadable, never shown sealed or plain.
    monkeypatch.delenv("CELERY_LEDGER_SNAPSHOT_KEYS")
    shown = json.loads(cli("--url", url, "show", "k-run", "--json").stdout)
    assert shown["signals"][0]["payload"] is None and "sealed" in shown["signals"][0]["unreadable"]


def test_list_says_an_entry_waits_for_a_signal_since_when_and_how_to_send_it(
    cli: Any, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    waiting_entry(url)
    listed = cli("--url", url, "list", "--json")
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.output)["entries"]
    assert row["next_action"] == "signal", row
    assert "waiting" in row["hint"] and "for signal 'approved'" in row["hint"], row
    assert "times out in" in row["hint"], row
    assert row["next_command"].endswith("signal k-wait approved --payload JSON"), row
    text = cli("--url", url, "list")
    assert "for signal 'approved'" in text.output, text.output

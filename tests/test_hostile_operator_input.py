"""Hostile input (guarantees.md § "Bad input") at the operator's surfaces: the failing-first tests.

``verify --duration nan``, ``metrics --port -1``, a URL that does not parse, a 55 KB key prefix
and a cancel with a megabyte of reason each got Python's words (or a traceback, or "ledger
database unavailable"). Each must be one line in the ledger's words, exit non-zero (Flower: a
400), and change nothing. The CLI runs in-process (``test_cli_bad_input``'s fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
import test_cli_bad_input
from test_cli_bad_input import assert_one_clear_line, blocked_entry
from test_ledger_page import PageCase

from celery_ledger.ledger import EntryStatus, LedgerStore, OperatorTextError

#: Longer than SQLite's LIKE pattern limit (50,000 bytes): it failed as "unavailable".
HUGE_REF = "a" * 55_000

#: The in-process CLI of ``test_cli_bad_input`` (its own working directory, a clean env).
cli = test_cli_bad_input.cli


# -- item 13: verify --duration nan ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_verify_refuses_a_duration_that_is_not_finite(value: str) -> None:
    """``FloatRange(1, 3600)`` let NaN through (every comparison with NaN is false)."""
    from celery_ledger.harness.verify import verify

    with pytest.raises(click.BadParameter) as caught:
        verify.make_context("verify", ["--duration", value])
    assert "finite" in str(caught.value) or "range" in str(caught.value), caught.value


# -- item 14: a URL that does not parse -----------------------------------------------------------


@pytest.mark.parametrize("url", ["postgresql://[::1", "postgresql://host:port/db"])
def test_a_url_that_does_not_parse_is_one_line_in_the_ledgers_words(cli: Any, url: str) -> None:
    err = assert_one_clear_line(cli("--url", url, "list"), "URL")
    assert "int()" not in err and "literal" not in err, err


# -- item 15: an over-long key or prefix is bad input, not an outage ------------------------------


@pytest.mark.parametrize(
    "command", [["show"], ["resume"], ["cancel", "--by", "a", "--reason", "r"]]
)
def test_an_over_long_key_prefix_is_refused_as_bad_input(
    cli: Any, tmp_path: Path, command: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    blocked_entry(url)  # a table with a row: SQLite only then evaluates the LIKE
    err = assert_one_clear_line(cli("--url", url, command[0], HUGE_REF, *command[1:]), "long")
    assert "unavailable" not in err and len(err) < 400, err[:400]


class TestFlowerRefusesAnOverLongReference(PageCase):
    def test_the_search_box_answers_400_not_503(self) -> None:
        self.blocked()
        resp = self.get(f"/ledger/find?q={HUGE_REF}")
        assert resp.code == 400, (resp.code, resp.body[:300])
        assert b"long" in resp.body

    def test_the_task_link_answers_400_not_503(self) -> None:
        self.blocked()
        resp = self.get(f"/ledger/task/{HUGE_REF}")
        assert resp.code in (400, 404), (resp.code, resp.body[:300])


# -- item 16: metrics --port -1, --address 999.1.1.1 ----------------------------------------------


@pytest.mark.parametrize(
    "option", [["--port", "-1"], ["--port", "70000"], ["--port", "0", "--address", "999.1.1.1"]]
)
def test_metrics_refuses_an_address_it_cannot_listen_on(
    cli: Any, tmp_path: Path, option: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    LedgerStore(url).dispose()
    err = assert_one_clear_line(cli("--url", url, "metrics", *option))
    assert "bind()" not in err and "Errno" not in err, err


# -- item 17: cancel's own words, and the store's own check ---------------------------------------


@pytest.mark.parametrize("field", ["--reason", "--by"])
def test_cancel_refuses_a_megabyte_of_text_in_its_own_words(
    cli: Any, tmp_path: Path, field: str
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    key = blocked_entry(url)
    options = {"--by": "alice", "--reason": "the customer asked"}
    options[field] = "x" * 1_000_000
    err = assert_one_clear_line(cli("--url", url, "cancel", key, *sum(options.items(), ())), field)
    assert "cancel" in err and "release" not in err, err


@pytest.mark.parametrize(
    "by, reason",
    [("alice", "x" * 1_000_000), ("alice", "stop\x1b[2J"), ("a" * 1000, "why"), ("al\nice", "r")],
)
def test_the_store_refuses_a_cancel_with_unbounded_or_control_text(
    tmp_path: Path, by: str, reason: str
) -> None:
    """``LedgerStore.request_cancel`` (the Python cancel API) took what release and mark-dead
    refuse at the store: a megabyte of reason and terminal escapes."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    key = blocked_entry(url)
    store = LedgerStore(url)
    try:
        with pytest.raises(OperatorTextError, match="^cancel "):
            store.request_cancel(key, by=by, reason=reason, error='"x"')
        entry = store.get_entry(key)
        assert entry.status is EntryStatus.BLOCKED and entry.cancel_reason is None
    finally:
        store.dispose()


# -- a --url command without -A writes nothing in the current directory --------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["list"],
        ["list", "--stuck", "--json"],
        ["show", "k-blocked"],
        ["stats"],
        ["doctor"],
        ["sweep"],
        ["metrics", "--once"],
        ["cancel", "k-nope", "--by", "a", "--reason", "r"],
        ["migrate", "--plan"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_url_command_without_an_app_creates_no_data_directory_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """The CLI's default app (no ``-A``) made ``./.celery-ledger`` (its filesystem broker's
    folders) in whatever directory the operator stood in, for a ledger named by ``--url``."""
    from click.testing import CliRunner

    from celery_ledger.cli.main import main

    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    blocked_entry(url)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for name in ("CELERY_LEDGER_DATA_DIR", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(main, ["--url", url, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert list(here.iterdir()) == [], (sorted(p.name for p in here.iterdir()), result.output)


def test_a_resume_without_an_app_and_no_embedded_broker_here_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``-A`` the CLI's default app sends through ``./.celery-ledger``'s broker folders;
    where they do not exist no worker reads them: refused in one line, before anything moves."""
    from click.testing import CliRunner

    from celery_ledger.cli.main import main
    from celery_ledger.codec import encode
    from celery_ledger.ledger import ClaimRequest, Owner

    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    store = LedgerStore(url)
    try:
        claim = store.claim(
            ClaimRequest(
                key="k-int",
                task_name="shop.charge",
                task_id="t-int",
                args_hash="task-id",
                snapshot=encode({"args": [], "kwargs": {}}, limit=10_000, what="snapshot"),
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            )
        )
        assert store.interrupt_owner(claim.key, node="w@h", boot="b", pid=1, actor="w@h", why="x")
    finally:
        store.dispose()
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for name in ("CELERY_LEDGER_DATA_DIR", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    err = assert_one_clear_line(CliRunner().invoke(main, ["--url", url, "resume", "k-int"]), "-A")
    assert "no embedded broker" in err, err
    assert list(here.iterdir()) == []
    check = LedgerStore(url)
    try:
        assert check.get_entry("k-int").status is EntryStatus.INTERRUPTED
    finally:
        check.dispose()

"""guarantees.md § "Bad input", item 5: a secret quoted by a reason or escaped inside JSON text
stays out of sight.

(a) A blocked reason that quotes a secret (an external ref built from the card) was printed
raw by ``list --json`` and Flower's stuck list, while ``show`` scrubbed it. (b) A secret that
JSON escapes (a non-ASCII letter, a quote, a backslash) was shown in the audit trail by
``show`` and the entry page: the scrub looked for the raw text inside escaped JSON. The
ledger's state is written through the store as a worker writes it; the worker's own log line
is ``test_secrets_out_of_sight``'s (real processes).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import test_cli_bad_input
from test_ledger_page import PageCase

from celery_ledger.codec import encode
from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner, entry_key

#: Escapes in JSON three ways: a non-ASCII letter, quotes, a backslash.
SECRET = 'Pässwort "9" \\ 4711'
#: In every form the secret can take (raw, ensure_ascii-escaped, escaped): this never shows.
CORE = "sswort"

#: The in-process CLI of ``test_cli_bad_input`` (its own working directory, a clean env).
cli = test_cli_bad_input.cli


def parked(store: LedgerStore, task: str, kwargs: dict[str, Any], status: EntryStatus) -> str:
    """An entry of ``task`` with ``kwargs``, blocked on a ref that quotes the secret, or failed
    with an error that quotes it (stored as JSON, as a worker stores it)."""
    task_id = str(uuid.uuid4())
    key = entry_key(task, task_id)
    snapshot = {"args": [], "kwargs": kwargs, "queue": "q", "ledger_key": None}
    claim = store.claim(
        ClaimRequest(
            key=key,
            task_name=task,
            task_id=task_id,
            args_hash="task-id",
            snapshot=encode(snapshot, limit=100_000, what="snapshot"),
            side_effect="non_idempotent",
            owner=Owner("w@h", "b", 1),
            lease_seconds=60.0,
        )
    )
    if status is EntryStatus.BLOCKED:
        reason = f"step 'charge' may have executed (external ref: ch-{SECRET}); reconcile"
        assert store.settle(key, claim.fence, status, reason=reason, actor="w@h")
    else:
        error = encode(
            {"exc_type": "ValueError", "exc_message": [f"login refused for {SECRET}"]},
            limit=100_000,
            what="error",
        )
        assert store.settle(key, claim.fence, status, error=error, actor="w@h")
    return key


@pytest.fixture
def ledger(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("CELERY_LEDGER_REDACT", "password")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    store = LedgerStore(url)
    kwargs = {"order_id": "A-1", "password": SECRET}
    keys = {
        s: parked(store, "shop.login", kwargs, s) for s in (EntryStatus.BLOCKED, EntryStatus.FAILED)
    }
    store.dispose()

    def run(*args: str) -> str:
        result = cli("--url", url, *args)
        assert result.exit_code == 0, result.output
        return str(result.output)

    return run, keys


@pytest.mark.parametrize("args", [["list", "--json"], ["list", "--stuck", "--json"], ["list"]])
def test_list_scrubs_a_reason_that_quotes_a_secret(ledger: Any, args: list[str]) -> None:
    run, keys = ledger
    out = run(*args)
    assert CORE not in out, out
    if "--json" in args:
        reasons = [e["reason"] for e in json.loads(out)["entries"]]
        assert any(r and "[redacted]" in r for r in reasons), reasons


@pytest.mark.parametrize("as_json", [True, False])
def test_show_scrubs_a_secret_escaped_inside_a_stored_error(ledger: Any, as_json: bool) -> None:
    run, keys = ledger
    out = run("show", keys[EntryStatus.FAILED], *(["--json"] if as_json else []))
    assert CORE not in out, out
    assert "[redacted]" in out


class TestFlowerScrubsReasonsAndEscapedSecrets(PageCase):
    def test_the_stuck_list_scrubs_a_reason_that_quotes_a_secret(self) -> None:
        kwargs = {"order_id": "A-1", "amount": 1, "card_number": SECRET}
        parked(self.store, "shop.pay", kwargs, EntryStatus.BLOCKED)
        html = self.page("/ledger/stuck")
        assert "stuck-row" in html and CORE not in html, html

    def test_the_entry_page_scrubs_a_secret_escaped_in_the_audit_trail(self) -> None:
        kwargs = {"order_id": "A-1", "amount": 1, "card_number": SECRET}
        key = parked(self.store, "shop.pay", kwargs, EntryStatus.FAILED)
        html = self.page(f"/ledger/entry/{key}")
        assert CORE not in html, html[html.find(CORE) - 300 : html.find(CORE) + 100]

    def test_the_entry_page_scrubs_an_operators_release_reason_that_quotes_a_secret(self) -> None:
        """The operator's own why (a release, a mark-dead) is free text too, shown on the page
        as the stuck list and ``show`` show it: scrubbed."""
        from celery_ledger.ledger import Verdict

        kwargs = {"order_id": "A-1", "amount": 1, "card_number": SECRET}
        key = parked(self.store, "shop.pay", kwargs, EntryStatus.BLOCKED)
        self.store.release(
            key, Verdict.NOT_EXECUTED, by="alice", reason=f"provider has no charge for {SECRET}"
        )
        html = self.page(f"/ledger/entry/{key}")
        assert 'id="entry-released"' in html
        assert CORE not in html, html[html.find(CORE) - 300 : html.find(CORE) + 100]

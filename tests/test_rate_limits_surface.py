"""Fleet-wide rate limits (design.md § "Fleet-wide rate limits") as operators see them: ``list``,
``show`` and ``stats`` show an entry held for a token with why and since when, and so does the
Ledger page in Flower (its overview, per bucket). In-process, on SQLite, as ``test_time_cli``
and ``test_ledger_page``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from test_ledger_page import PageCase
from test_signals_cli import cli  # noqa: F401 - the fixture
from test_store_contract import request
from test_time_cli import url_of

from celery_ledger import LedgerTask, create_app
from celery_ledger.ledger import Gate, LedgerStore, TokenAsk, entry_key
from celery_ledger.ratelimit import token_ask

#: One token a minute: the second claim is held for about a minute.
SLOW = TokenAsk("shop.charge", 60.0, "1/m")


def held_entry(url: str) -> str:
    """Two claims of a 1/m task: the second is held for a token. Returns its key."""
    store = LedgerStore(url)
    try:
        assert store.claim(dataclasses.replace(request("k-run"), rate=SLOW)).gate is Gate.RUN
        key = entry_key("shop.charge", "held")
        held = store.claim(dataclasses.replace(request(key, task_id="t-held"), rate=SLOW))
        assert held.gate is Gate.HOLD
    finally:
        store.dispose()
    return key


def test_list_show_and_stats_show_a_held_entry_with_why_and_since_when(
    cli: Any,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    url = url_of(tmp_path)
    key = held_entry(url)
    listed = json.loads(cli("--url", url, "list", "--json").stdout)
    (row,) = [e for e in listed["entries"] if e["key"] == key]
    assert row["status"] == "scheduled"
    held = row["held_for_token"]
    assert (held["bucket"], held["rate"], held["holds"]) == ("shop.charge", "1/m", 1)
    assert held["held_seconds"] >= 0 and held["due_at"] > listed["now"]
    assert row["hint"].startswith("held for a token: rate limit 1/m (shop.charge) since ")
    text = cli("--url", url, "list").stdout
    assert "held for a token: rate limit 1/m" in text
    shown = json.loads(cli("--url", url, "show", key, "--json").stdout)
    assert shown["held_for_token"]["bucket"] == "shop.charge"
    assert "held for a token" in cli("--url", url, "show", key).stdout
    stats = json.loads(cli("--url", url, "stats", "--json").stdout)
    assert stats["held_for_token"]["shop.charge"]["entries"] == 1
    assert "held: shop.charge" in cli("--url", url, "stats").stdout


class TestHeldOnTheLedgerPage(PageCase):
    def test_overview_shows_held_entries_per_bucket(self) -> None:
        html = self.page("/ledger")
        assert "no delivery waits for a rate limit" in html
        key = held_entry(self.url)
        html = self.page("/ledger")
        assert 'id="token-buckets"' in html and "<code>shop.charge</code>" in html
        assert key[:16] in html and "held for a token: rate limit 1/m (shop.charge)" in html
        entry = self.page(f"/ledger/entry/{key}")
        assert "held for a token" in entry


# -- the task option ------------------------------------------------------------------------------


def test_the_option_names_one_bucket_per_task_or_per_argument_value(tmp_path: Path) -> None:
    app = create_app("rate-option", data_dir=tmp_path)

    @app.task(shared=False, base=LedgerTask, name="shop.notify", ledger_rate_limit="5/m per cid")
    def notify(cid: Any, text: str = "") -> None:
        return None

    @app.task(shared=False, base=LedgerTask, name="shop.call", ledger_rate_limit="10/s")
    def call(n: int) -> None:
        return None

    @app.task(shared=False, base=LedgerTask, name="shop.free")
    def free(n: int) -> None:
        return None

    per = app.tasks["shop.notify"]
    assert token_ask(per, (42,), {}) == TokenAsk("shop.notify cid=42", 12.0, "5/m")
    assert token_ask(per, (), {"cid": "a", "text": "x"}).bucket == 'shop.notify cid="a"'
    long = token_ask(per, ("x" * 400,), {})
    assert long is not None and len(long.bucket) <= 255 and "sha256:" in long.bucket
    assert token_ask(app.tasks["shop.call"], (1,), {}) == TokenAsk("shop.call", 0.1, "10/s")
    assert token_ask(app.tasks["shop.free"], (1,), {}) is None


@pytest.mark.parametrize(
    ("bad", "says"), [("10/d", "is not of the form"), ("5/m per nope", "nope")]
)
def test_a_bad_option_is_refused_at_registration(tmp_path: Path, bad: str, says: str) -> None:
    app = create_app("rate-bad", data_dir=tmp_path)
    with pytest.raises(ValueError) as err:

        @app.task(shared=False, base=LedgerTask, name="bad.rate", ledger_rate_limit=bad)
        def late(cid: int) -> None:
            return None

        app.tasks["bad.rate"]  # registration binds it
    assert "bad.rate" in str(err.value) and says in str(err.value), str(err.value)


def test_a_rate_limit_with_a_concurrency_key_registers_both(tmp_path: Path) -> None:
    # Both gates in one claim (docs/concurrency.md § "With a rate limit"): no longer refused.
    app = create_app("rate-and-slot", data_dir=tmp_path)

    @app.task(
        shared=False,
        base=LedgerTask,
        name="both.limits",
        ledger_rate_limit="5/s per cid",
        concurrency_key=("cid",),
        concurrency_limit=1,
    )
    def both(cid: int) -> None:
        return None

    task = app.tasks["both.limits"]  # registration binds it
    assert (task.ledger_rate_limit, task.concurrency_limit) == ("5/s per cid", 1)

"""Hostile times (guarantees.md § "Bad input", items 4, 13, 14): the failing-first tests.

A time that is not a finite number in range (``countdown=float('inf')``, NaN, ``'abc'``) is
refused where it is given, in the ledger's words, before anything is recorded or published;
a time already stored (an infinite or huge ``due_at``) is still shown by every view.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from celery_ledger import LedgerTask, create_app, envelope, runtime
from celery_ledger.cli.main import main
from celery_ledger.ledger import ClaimRequest, LedgerStore, Owner
from celery_ledger.view import duration, timestamp

INF, NAN = float("inf"), float("nan")


@pytest.fixture
def held_app(tmp_path: Path) -> Any:
    """A producer whose long countdowns the ledger holds; its broker accepts nothing."""
    app = create_app(
        "bad-times",
        data_dir=tmp_path,
        ledger_hold_threshold_seconds=60,
        broker_url="memory://",
    )

    @app.task(shared=False, base=LedgerTask, bind=True, name="bad.remind")
    def remind(self: LedgerTask, n: int) -> int:
        return n

    yield app, remind
    runtime.store_for(app).dispose()


def _entries(app: Any) -> int:
    from sqlalchemy import text

    with runtime.store_for(app).engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM ledger_entries")).scalar_one())


# -- item 4 and 13: refused at send -----------------------------------------------------------


@pytest.mark.parametrize(
    "options, word",
    [
        ({"countdown": INF}, "countdown"),
        ({"countdown": -INF}, "countdown"),
        ({"countdown": NAN}, "countdown"),
        ({"countdown": 1e300}, "countdown"),
        ({"countdown": 3600, "expires": NAN}, "expires"),
        ({"countdown": 3600, "expires": INF}, "expires"),
        ({"expires": NAN}, "expires"),
        ({"countdown": 3600, "headers": {"ledger_deadline": NAN}}, "ledger_deadline"),
        ({"countdown": 3600, "headers": {"ledger_deadline": "abc"}}, "ledger_deadline"),
        ({"headers": {"ledger_deadline": "abc"}}, "ledger_deadline"),
        ({"headers": {"ledger_deadline": INF}}, "ledger_deadline"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_apply_async_refuses_a_time_that_is_no_finite_number(
    held_app: Any, options: dict[str, Any], word: str
) -> None:
    app, remind = held_app
    with pytest.raises(ValueError) as err:
        remind.apply_async((1,), **options)
    message = str(err.value)
    assert word in message and "finite" in message, message
    for raw in ("could not convert", "cannot convert float", "OverflowError"):
        assert raw not in message, message
    assert _entries(app) == 0, "recorded in the ledger"


# -- item 13, 14: the task option ``deadline`` at registration ---------------------------------


@pytest.mark.parametrize("bad", [NAN, INF, "soon"])
def test_a_deadline_option_that_is_no_finite_number_is_refused_at_registration(
    tmp_path: Path, bad: Any
) -> None:
    app = create_app("bad-deadline", data_dir=tmp_path)
    with pytest.raises((ValueError, TypeError)) as err:

        @app.task(shared=False, base=LedgerTask, name="bad.deadline", deadline=bad)
        def late() -> None:
            return None

        app.tasks["bad.deadline"]  # registration binds it
    message = str(err.value)
    assert "bad.deadline" in message and "deadline" in message, message


def test_a_good_deadline_option_is_kept(tmp_path: Path) -> None:
    app = create_app("good-deadline", data_dir=tmp_path)

    @app.task(shared=False, base=LedgerTask, name="good.deadline", deadline=30)
    def soon() -> None:
        return None

    assert app.tasks["good.deadline"].deadline == 30


# -- item 13: a malformed header at the worker ----------------------------------------------------


@pytest.mark.parametrize("raw", [NAN, "nan", "abc", INF, [1]])
def test_a_malformed_deadline_header_at_the_worker_is_ignored_with_a_warning(
    raw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Decided: a delivery whose ``ledger_deadline`` header is no finite number runs without
    that deadline (its ``expires`` still counts), with a warning; the claim never raises."""
    with caplog.at_level(logging.WARNING, logger="celery_ledger.envelope"):
        assert envelope.absolute_deadline(None, raw) is None
        assert envelope.absolute_deadline(10.0, raw) is not None
    assert "ledger_deadline" in caplog.text and "ignored" in caplog.text, caplog.text


# -- item 4: every view renders a stored time --------------------------------------------------


@pytest.mark.parametrize("value", [INF, -INF, NAN, 1e300, -1e300])
def test_the_time_helpers_render_any_stored_value(value: float) -> None:
    assert isinstance(duration(value), str)
    assert isinstance(timestamp(value), str)


def _held_forever(url: str, due_at: float) -> str:
    store = LedgerStore(url)
    try:
        assert store.schedule(
            ClaimRequest(
                key="k-forever",
                task_name="shop.remind",
                task_id="t-forever",
                args_hash="task-id",
                snapshot='{"args":[1],"kwargs":{}}',
                side_effect="non_idempotent",
                owner=Owner("w@h", "b", 1),
                lease_seconds=60.0,
            ),
            due_at=due_at,
            deadline_at=due_at,
        )
    finally:
        store.dispose()
    return "k-forever"


def _refuse_constant(name: str) -> Any:
    raise AssertionError(f"not strict JSON: {name}")


@pytest.mark.parametrize("due_at", [INF, 1e300], ids=["inf", "huge"])
def test_list_and_show_render_a_stored_infinite_due_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, due_at: float
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("CELERY_LEDGER_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    key = _held_forever(url, due_at)
    runner = CliRunner()
    for args in (["list"], ["list", "--json"], ["show", key], ["show", key, "--json"]):
        result = runner.invoke(main, ["--url", url, *args], catch_exceptions=True)
        assert result.exception is None, f"{args}: raised {result.exception!r}"
        assert result.exit_code == 0, (args, result.output)
        assert key in result.stdout
        if "--json" in args:  # strict JSON: no Infinity/NaN that other parsers refuse
            json.loads(result.stdout, parse_constant=_refuse_constant)


@pytest.mark.parametrize("since", ["nan", "inf", "nanm"])
def test_list_since_refuses_a_value_that_is_no_finite_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, since: str
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    _held_forever(url, 2e9)
    result = CliRunner().invoke(main, ["--url", url, "list", "--since", since])
    assert result.exit_code != 0, result.output
    err = result.stderr.strip()
    assert err.startswith("Error: ") and "\n" not in err and "--since" in err, err


def test_math_sanity() -> None:
    assert math.isnan(NAN) and math.isinf(INF)

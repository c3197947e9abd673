"""Who may act: the authorizer hook shared by the CLI and the Flower page.

The default rule (operator tokens for the CLI's self-declared ``--by``), a configured
``ledger_authorizer`` and its failure modes (fails closed), and the CLI's release and resume
asking it before their one write. The page's side is in ``test_ledger_page.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli import blocked, interrupted
from test_cli import rows as ledger_rows

from celery_ledger.authorize import (
    Action,
    AuthorizerError,
    Decision,
    Operator,
    authorize,
    default_decision,
    load_authorizer,
)
from celery_ledger.cli.main import main
from celery_ledger.ledger import RESUME_OWNER, EntryStatus, LedgerStore, Verdict
from celery_ledger.settings import LedgerSettings

CLI_USER = Operator("tok-alice", "cli", authenticated=False)
FLOWER_USER = Operator("alice@example.com", "flower", authenticated=True)
ASKED: list[tuple[Operator, Action, str]] = []


def only_completed(operator: Operator, action: Action, entry: Any) -> Decision:
    ASKED.append((operator, action, entry.key))
    if action is Action.RELEASE_COMPLETED:
        return Decision.allow()
    return Decision.deny(f"{operator.name}: only completed verdicts here")


def says_yes(operator: Operator, action: Action, entry: Any) -> bool:
    return True


def answers_nonsense(operator: Operator, action: Action, entry: Any) -> str:
    return "yes please"


def explodes(operator: Operator, action: Action, entry: Any) -> Decision:
    raise ConnectionError("LDAP unreachable")


class Holder:
    nested = staticmethod(says_yes)


NOT_CALLABLE = 42


def settings(**values: Any) -> LedgerSettings:
    return LedgerSettings.from_mapping({f"ledger_{k}": v for k, v in values.items()}, env={})


# -- the default rule ---------------------------------------------------------------------------


def test_default_rule_gates_self_declared_releases_with_tokens() -> None:
    tokens = frozenset({"tok-alice", "tok-bob"})
    for action in (Action.RELEASE_COMPLETED, Action.RELEASE_NOT_EXECUTED):
        assert default_decision(tokens, CLI_USER, action).allowed
        denied = default_decision(tokens, Operator("mallory", "cli", False), action)
        assert not denied.allowed and "operator token" in denied.reason
        # without tokens, anyone may (today's behaviour)
        assert default_decision(frozenset(), Operator("mallory", "cli", False), action).allowed
    # Flower vouches for its user; resume is what the sweep does anyway
    assert default_decision(tokens, FLOWER_USER, Action.RELEASE_NOT_EXECUTED).allowed
    assert default_decision(tokens, Operator("mallory", "cli", False), Action.RESUME).allowed


def test_action_of_a_verdict() -> None:
    assert Action.release(Verdict.COMPLETED) is Action.RELEASE_COMPLETED
    assert Action.release(Verdict.NOT_EXECUTED) is Action.RELEASE_NOT_EXECUTED
    assert not Action.RESUME.is_release


# -- a configured authorizer --------------------------------------------------------------------


def test_load_authorizer_by_name_or_callable() -> None:
    assert load_authorizer(None) is None
    assert load_authorizer("test_authorize:says_yes") is says_yes
    assert load_authorizer("test_authorize.says_yes") is says_yes
    assert load_authorizer("test_authorize:Holder.nested") is says_yes
    assert load_authorizer(says_yes) is says_yes
    for bad, words in (
        ("no_such_module_here:fn", "cannot be imported"),
        ("test_authorize:missing", "cannot be imported"),
        ("test_authorize:NOT_CALLABLE", "is not callable"),
    ):
        with pytest.raises(AuthorizerError, match=words):
            load_authorizer(bad)


def test_authorizer_answers_and_fails_closed(store: LedgerStore) -> None:
    entry = store.get_entry(blocked(store))
    ask = lambda spec: authorize(settings(authorizer=spec), FLOWER_USER, Action.RESUME, entry)  # noqa: E731
    assert ask("test_authorize:says_yes") == Decision(True, "")
    denied = ask("test_authorize:only_completed")
    assert not denied.allowed and "only completed verdicts" in denied.reason
    nonsense = ask("test_authorize:answers_nonsense")
    assert not nonsense.allowed and "not a Decision or a bool" in nonsense.reason
    exploded = ask("test_authorize:explodes")
    assert not exploded.allowed and "the authorizer failed (ConnectionError)" in exploded.reason


def test_settings_check_the_authorizer_and_parse_the_new_switches() -> None:
    with pytest.raises(ValueError, match="must be 'package.module:function'"):
        settings(authorizer="not a path")
    with pytest.raises(ValueError, match="or a callable"):
        settings(authorizer=42)
    s = LedgerSettings.from_mapping(
        {},
        env={
            "CELERY_LEDGER_AUTHORIZER": "pkg.mod:fn",
            "CELERY_LEDGER_REDACT": "card_number, cvv",
            "CELERY_LEDGER_FLOWER_ACTIONS": "1",
        },
    )
    assert s.authorizer == "pkg.mod:fn" and s.redact == {"card_number", "cvv"}
    assert s.flower_actions is True
    assert settings().flower_actions is False  # read-only unless switched on


# -- the CLI asks it before its one write -------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ledger_url: str) -> Any:
    monkeypatch.setenv("CELERY_LEDGER_URL", ledger_url)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CELERY_LEDGER_OPERATOR_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0) -> Any:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == code, (result.exit_code, result.output)
        return result

    return invoke


def one_line_error(result: Any, words: str) -> None:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], lines


def test_cli_release_and_resume_ask_the_authorizer(
    cli: Any, store: LedgerStore, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_LEDGER_AUTHORIZER", "test_authorize:only_completed")
    ASKED.clear()
    key, other = blocked(store), interrupted(store)
    before = ledger_rows(ledger_url)
    one_line_error(
        cli("release", key, "--verified", "not-executed", "--by", "bob", "--reason", "r", code=1),
        "bob: only completed verdicts here; nothing was released",
    )
    one_line_error(
        cli("resume", other, code=1), "only completed verdicts here; nothing was re-enqueued"
    )
    assert ledger_rows(ledger_url) == before
    assert ASKED[0] == (Operator("bob", "cli", False), Action.RELEASE_NOT_EXECUTED, key)
    assert ASKED[1][1] is Action.RESUME and ASKED[1][0].name.startswith("celery-ledger")
    cli(
        "release",
        key,
        "--verified",
        "completed",
        "--result-json",
        "1",
        "--by",
        "bob",
        "--reason",
        "r",
    )
    assert store.get_entry(key).status is EntryStatus.COMPLETED


def test_cli_refuses_an_authorizer_it_cannot_load(
    cli: Any, store: LedgerStore, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_LEDGER_AUTHORIZER", "test_authorize:NOT_CALLABLE")
    key = interrupted(store)
    before = ledger_rows(ledger_url)
    one_line_error(cli("resume", key, code=1), "is not callable")
    assert ledger_rows(ledger_url) == before
    monkeypatch.setenv("CELERY_LEDGER_AUTHORIZER", "test_authorize:says_yes")
    cli("resume", key)
    assert store.get_entry(key).owner == RESUME_OWNER


def refuses_overrides(operator: Operator, action: Action, entry: Any, details: Any = None) -> bool:
    """An authorizer that lets anyone mark an entry dead, but not over a recent sign of life:
    overriding one is the on-call's call. ``details`` describes the request (its override)."""
    ASKED.append((operator, action, entry.key))
    return not (action is Action.MARK_DEAD and getattr(details, "override_heartbeat", False))


def test_cli_mark_dead_tells_the_authorizer_about_an_override(
    cli: Any, store: LedgerStore, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_LEDGER_AUTHORIZER", "test_authorize:refuses_overrides")
    key = blocked(store)
    before = ledger_rows(ledger_url)
    mark = ("mark-dead", key, "--by", "bob", "--reason", "VM destroyed")
    one_line_error(
        cli(*mark, "--override-heartbeat", code=1),
        "denied by ledger_authorizer; nothing was marked",
    )
    assert ledger_rows(ledger_url) == before and store.get_entry(key).dead_at is None
    cli(*mark)  # a plain mark-dead is allowed
    assert store.get_entry(key).dead_at is not None


def details_by_keyword(operator: Operator, action: Action, entry: Any, *, details: Any) -> bool:
    return not details.override_heartbeat


def test_details_reach_the_authorizers_that_take_them(store: LedgerStore) -> None:
    """A fourth positional parameter or a ``details`` keyword gets ``ActionDetails``; an
    authorizer with the three original parameters is still called with three."""
    from celery_ledger.authorize import ActionDetails

    entry = store.get_entry(blocked(store))
    override = ActionDetails(override_heartbeat=True)
    for spec, plain, overriding in (
        ("test_authorize:refuses_overrides", True, False),
        ("test_authorize:details_by_keyword", True, False),
        ("test_authorize:says_yes", True, True),  # three parameters: called as before
    ):
        s = settings(authorizer=spec)
        assert authorize(s, CLI_USER, Action.MARK_DEAD, entry).allowed is plain, spec
        assert authorize(s, CLI_USER, Action.MARK_DEAD, entry, override).allowed is overriding

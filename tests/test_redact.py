"""``celery_ledger.redact``: the one function every renderer of arguments goes through."""

from __future__ import annotations

from typing import Any

from celery_ledger.redact import HIDDEN, REDACTED, redact_arguments, secret_names


class Task:
    secret_args = ("card_number",)

    def run(self, order_id: str, card_number: str, amount: int = 0, *rest: Any) -> None: ...


def test_names_come_from_the_setting_and_the_task() -> None:
    assert secret_names({"cvv"}, Task()) == {"cvv", "card_number"}
    assert secret_names((), object()) == frozenset()
    assert secret_names(["x"], None) == {"x"}


def test_positional_and_keyword_secrets_are_hidden_by_parameter_name() -> None:
    names = secret_names({"cvv"}, Task())
    args, kwargs, r = redact_arguments(
        ["A-1", 4111111111111111, 5, "extra"],
        {"cvv": "7391", "meta": {"payment": {"card_number": "5500000000000004"}}},
        names=names,
        task=Task(),
    )
    # the 4th positional lands in *rest: no name, so it cannot be told safe
    assert args == ["A-1", REDACTED, 5, REDACTED]
    assert kwargs == {"cvv": REDACTED, "meta": {"payment": {"card_number": REDACTED}}}
    assert not r.blind
    # the same values are scrubbed from any other text shown next to them
    assert r.text("declined 4111111111111111 (cvv 7391)") == "declined [redacted] (cvv [redacted])"
    assert r.text("refund 5500000000000004") == "refund [redacted]"
    assert r.value({"echo": 4111111111111111, "note": ["x 7391"]}) == {
        "echo": REDACTED,
        "note": [f"x {REDACTED}"],
    }


def test_short_secrets_are_hidden_where_named_but_not_searched_for() -> None:
    args, kwargs, r = redact_arguments(
        [], {"pin": "42", "n": 42}, names=frozenset({"pin"}), task=Task()
    )
    assert kwargs == {"pin": REDACTED, "n": 42}
    assert r.text("answer 42") == "answer 42"


def test_an_unknown_task_hides_every_value() -> None:
    args, kwargs, r = redact_arguments(
        ["A-1", "DE44500105175407324931"], {"iban": "DE44"}, names=frozenset(), task=None
    )
    assert args == [HIDDEN, HIDDEN] and kwargs == {"iban": HIDDEN} and r.blind
    assert r.text("iban DE44500105175407324931") == "iban [redacted]"


class Notify:
    secret_args = ("token",)

    def run(self, previous: Any, token: str) -> None: ...


def test_a_snapshot_placement_is_redacted_by_each_tasks_own_rules() -> None:
    """The rest of a chain, a callback's own link and an errback are other tasks' arguments:
    each hidden by its own task's names (``secret_args`` of the link's task, ``ledger_redact``),
    an unknown task's wholly, and every secret found is scrubbed from the rest."""
    from celery_ledger.redact import redact_snapshot

    notify = {"task": "shop.notify", "args": ["tok-123456"], "kwargs": {}, "options": {}}
    audit = {"task": "shop.audit", "args": [], "kwargs": {"cvv": "7391-x"}, "options": {}}
    notify["options"] = {"link": [audit]}
    unknown = {"task": "elsewhere.alert", "args": ["DE44500105175407324931"], "kwargs": {}}
    snapshot = {
        "args": ["A-1"],
        "kwargs": {"note": "echo tok-123456"},
        "queue": "q",
        "canvas": {"chain": [notify], "link_error": [unknown], "root_id": "r-1"},
    }
    tasks = {"shop.charge": Task(), "shop.notify": Notify(), "shop.audit": object()}
    shown, r = redact_snapshot(snapshot, redact={"cvv"}, task=Task(), task_of=tasks.get)
    (link,) = shown["canvas"]["chain"]
    assert link["args"] == [REDACTED]  # secret_args of shop.notify, positional by its name
    assert link["options"]["link"][0]["kwargs"] == {"cvv": REDACTED}
    assert shown["canvas"]["link_error"][0]["args"] == [HIDDEN]
    assert shown["kwargs"] == {"note": f"echo {REDACTED}"}  # a link's secret, scrubbed
    assert shown["args"] == ["A-1"] and shown["queue"] == "q" and not r.blind
    assert r.text("failed: DE44500105175407324931 7391-x") == f"failed: {REDACTED} {REDACTED}"
    assert "token" in r.names and "cvv" in r.names
    # An immutable signature gets no result first: its arguments are its parameters in order.
    frozen = {"task": "shop.notify", "args": ["p", "tok-654321"], "kwargs": {}, "immutable": True}
    shown, _ = redact_snapshot(
        {"args": [], "kwargs": {}, "canvas": {"link": [frozen]}},
        redact=(),
        task=Task(),
        task_of=tasks.get,
    )
    assert shown["canvas"]["link"][0]["args"] == ["p", REDACTED]
    # No placement: exactly the arguments' redaction.
    plain, r2 = redact_snapshot(
        {"args": ["A-1"], "kwargs": {}}, redact=(), task=None, task_of=tasks.get
    )
    assert plain["args"] == [HIDDEN] and r2.blind


def test_a_secret_is_scrubbed_from_json_in_every_escaped_form() -> None:
    """guarantees.md § "Bad input", item 5b: an audit detail or a stored error is JSON text, where a
    secret with a non-ASCII letter, a quote or a backslash is escaped (``P\\u00e4sswort``,
    ``\\"``, ``\\\\``); scrubbing only the raw text missed every one of them."""
    import json

    secret = 'Pässwort "x" \\ tail'
    _, _, r = redact_arguments([], {"password": secret}, names=frozenset({"password"}), task=Task())
    for ensure_ascii in (True, False):
        detail = json.dumps(
            {"exc_message": [f"login failed for {secret}"]}, ensure_ascii=ensure_ascii
        )
        scrubbed = r.text(detail)
        assert REDACTED in scrubbed, scrubbed
        for part in ("P\\u00e4sswort", "Pässwort", '\\"x\\"'):
            assert part not in scrubbed, (ensure_ascii, scrubbed)
    assert r.text(f"raw {secret}") == f"raw {REDACTED}"


def test_secret_args_naming_no_parameter_fails_at_registration() -> None:
    """guarantees.md § "Bad input", item 5c: ``secret_args=("card_numbr",)`` was accepted and the
    card shown in clear; the names are checked against the signature, as ``key_from``'s are."""
    import pytest
    from celery import Celery

    from celery_ledger import LedgerTask

    app = Celery("reg", broker="memory://", set_as_current=False)

    def pay(order_id: str, card_number: str) -> None:
        return None

    app.task(base=LedgerTask, name="reg.pay", secret_args=("card_numbr",), shared=False)(pay)
    with pytest.raises(
        ValueError, match=r"secret_args names \['card_numbr'\].*pay\(order_id, card_number\)"
    ):
        app.finalize(auto=True)
        app.tasks["reg.pay"]
    good = Celery("reg2", broker="memory://", set_as_current=False)

    def open_account(**fields: str) -> None:
        return None

    # A name any call may give through **kwargs cannot be checked: accepted.
    good.task(base=LedgerTask, name="reg.open", secret_args=("pin",), shared=False)(open_account)
    good.task(base=LedgerTask, name="reg.pay", secret_args="card_number", shared=False)(pay)
    good.finalize(auto=True)
    assert good.tasks["reg.pay"].secret_args == "card_number"

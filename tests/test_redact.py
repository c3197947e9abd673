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

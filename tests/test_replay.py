"""Step identity in one process (guarantees.md § "The hardening faults", fault 6): which replay row
a step call takes, when a
call is drift, declared identities, and the checks made before a step writes anything.

Pure code paths over ``celery_ledger.replay.ReplayBook`` and ``celery_ledger.attempt``; the
behaviour with real workers killed mid-task is proven in ``test_faults_task.py``
(``test_drifted_step_input_fails_closed_...``, ``test_declared_step_identity_...``,
``test_reordered_...``).
"""

from __future__ import annotations

import operator
from typing import Any

import pytest

from celery_ledger.codec import MAX_ARGUMENT_DEPTH, arguments_hash, check_depth
from celery_ledger.ledger import (
    PayloadTooLarge,
    StepRecord,
    StepStatus,
    declared_identity,
    is_declared,
    step_provider_key,
)
from celery_ledger.replay import (
    MAX_STEP_NAME,
    Drift,
    ReplayBook,
    check_step_name,
    identity_of,
)

H = {c: c * 64 for c in "abcdx"}  # input hashes


def row(name: str, ihash: str, occurrence: int, status: str = "completed") -> StepRecord:
    return StepRecord(
        name=name,
        input_hash=ihash,
        occurrence=occurrence,
        seq=occurrence + 1,
        status=StepStatus(status),
        fence=1,
        output='"out"',
    )


def place(book: ReplayBook, name: str, ihash: str, *, effect: bool = True) -> Any:
    ident, found = book.place(name, ihash, identity=None, effect=effect)
    return ident, None if found is None else found.ident


# -- undeclared steps: name + position, input checked ------------------------------------------


def test_a_step_takes_its_own_row_at_its_position() -> None:
    book = ReplayBook([row("charge", H["a"], 0), row("receipt", H["b"], 0)])
    assert place(book, "charge", H["a"]) == (("charge", H["a"], 0), ("charge", H["a"], 0))
    assert place(book, "receipt", H["b"]) == (("receipt", H["b"], 0), ("receipt", H["b"], 0))
    # A new call of a name takes the next position.
    assert place(book, "charge", H["c"]) == (("charge", H["c"], 1), None)


def test_reordered_items_each_find_their_own_row() -> None:
    book = ReplayBook([row("ship", H[c], i) for i, c in enumerate("abc")])
    got = [place(book, "ship", H[c])[1] for c in "cba"]
    assert got == [("ship", H["c"], 2), ("ship", H["b"], 1), ("ship", H["a"], 0)]


def test_one_input_repeated_takes_its_rows_in_order_then_a_new_one() -> None:
    book = ReplayBook([row("tick", H["a"], 0), row("tick", H["a"], 1)])
    got = [place(book, "tick", H["a"]) for _ in range(3)]
    assert got == [
        (("tick", H["a"], 0), ("tick", H["a"], 0)),
        (("tick", H["a"], 1), ("tick", H["a"], 1)),
        (("tick", H["a"], 2), None),
    ]


def test_an_effect_step_with_another_input_at_its_position_is_drift() -> None:
    book = ReplayBook([row("charge", H["a"], 0)])
    with pytest.raises(Drift) as info:
        place(book, "charge", H["x"])
    reason = info.value.reason
    assert "'charge' #0" in reason and H["a"][:16] in reason and H["x"][:16] in reason
    assert "identify=" in reason


@pytest.mark.parametrize("status", ["started", "completed"])
def test_drift_counts_a_row_that_may_have_run(status: str) -> None:
    with pytest.raises(Drift):
        place(ReplayBook([row("charge", H["a"], 0, status)]), "charge", H["x"])


def test_a_row_proven_not_executed_does_not_hold_its_position() -> None:
    book = ReplayBook([row("charge", H["a"], 0, "not_executed")])
    assert place(book, "charge", H["x"]) == (("charge", H["x"], 0), None)


def test_steps_that_record_no_intent_never_drift() -> None:
    book = ReplayBook([row("look", H["a"], 0)])
    assert place(book, "look", H["x"], effect=False) == (("look", H["x"], 0), None)


def test_a_reordered_loop_interrupted_midway_fails_closed() -> None:
    """The first attempt shipped a and crashed; the next meets c first. Without a
    declaration c at position 0 cannot be told from a drifted a: refused (documented)."""
    book = ReplayBook([row("ship", H["a"], 0)])
    with pytest.raises(Drift):
        place(book, "ship", H["c"])


def test_a_changed_order_that_repeats_an_input_fails_closed() -> None:
    book = ReplayBook([row("n", H["x"], 0), row("n", H["a"], 1)])
    assert place(book, "n", H["a"])[1] == ("n", H["a"], 1)  # re-ordered: takes its row
    with pytest.raises(Drift, match="order of the steps changed"):
        place(book, "n", H["a"])  # a again, at the position whose row it took


def test_a_changed_order_that_repeats_a_read_gets_a_row_of_its_own() -> None:
    book = ReplayBook([row("n", H["x"], 0), row("n", H["a"], 1)])
    place(book, "n", H["a"], effect=False)
    assert place(book, "n", H["a"], effect=False) == (("n", H["a"], 2), None)


# -- declared identity -------------------------------------------------------------------------


def declared(value: Any) -> str:
    return declared_identity(arguments_hash(value))


def test_a_declared_step_is_found_by_its_identity_wherever_it_sits() -> None:
    ids = {c: declared({"item": c}) for c in "abc"}
    book = ReplayBook([row("ship", ids["a"], 0)])
    got = [book.place("ship", H[c], identity=ids[c], effect=True) for c in "cba"]
    assert [(ident, found is not None) for ident, found in got] == [
        (("ship", ids["c"], 0), False),
        (("ship", ids["b"], 0), False),
        (("ship", ids["a"], 0), True),
    ]


def test_a_declared_step_replays_a_row_stored_before_the_declaration_with_the_same_input() -> None:
    book = ReplayBook([row("charge", H["a"], 0)])
    ident, found = book.place("charge", H["a"], identity=declared("o-1"), effect=True)
    assert found is not None and ident == ("charge", H["a"], 0)


def test_a_declared_step_cannot_check_a_row_stored_without_the_declaration() -> None:
    book = ReplayBook([row("charge", H["a"], 0)])
    with pytest.raises(Drift, match="stored without it"):
        book.place("charge", H["x"], identity=declared("o-1"), effect=True)


def test_an_undeclared_step_cannot_check_rows_stored_with_a_declaration() -> None:
    book = ReplayBook([row("charge", declared("o-1"), 0)])
    with pytest.raises(Drift, match="stored with one"):
        place(book, "charge", H["x"])


def test_declared_identities_are_marked_and_get_provider_keys_of_their_own() -> None:
    a, c = declared({"item": "a"}), declared({"item": "c"})
    assert is_declared(a) and len(a) == 64 and not is_declared(H["a"])
    # Two items of one loop never share a provider key; a position keeps its own.
    assert step_provider_key("k", ("ship", a, 0)) != step_provider_key("k", ("ship", c, 0))
    assert step_provider_key("k", ("ship", H["a"], 1)) == step_provider_key(
        "k", ("ship", H["x"], 1)
    )
    assert step_provider_key("k", ("ship", H["a"], 0)) != step_provider_key(
        "k", ("ship", H["a"], 1)
    )


# -- identify= -----------------------------------------------------------------------------------


def charge(order_id: str, ts: float, currency: str = "EUR", **extra: Any) -> None:
    return None


def test_identify_names_parameters_bound_as_the_function_binds_them() -> None:
    by_name = identity_of("charge", charge, ("o-1", 1.0), {}, ("order_id",))
    assert by_name == identity_of(
        "charge", charge, (), {"ts": 2.0, "order_id": "o-1"}, ("order_id",)
    )
    assert by_name == declared({"order_id": "o-1"})
    assert by_name != identity_of("charge", charge, ("o-2", 1.0), {}, ("order_id",))
    # Defaults apply; **kwargs are parameters too.
    assert identity_of("charge", charge, ("o-1", 1.0), {}, ("currency",)) == declared(
        {"currency": "EUR"}
    )
    assert identity_of("charge", charge, ("o-1", 1.0), {"shop": "s1"}, ("shop",)) == declared(
        {"shop": "s1"}
    )


def test_identify_may_be_a_callable_of_the_step_arguments() -> None:
    got = identity_of("charge", charge, ("o-1", 1.0), {}, lambda order_id, ts: order_id)
    assert got == declared("o-1")


@pytest.mark.parametrize(
    ("identify", "args", "error", "match"),
    [
        ("order_id", ("o-1", 1.0), TypeError, "not the string"),
        (("order",), ("o-1", 1.0), ValueError, r"names \['order'\], which are not parameters"),
        (("order_id",), (), TypeError, "missing a required argument"),
    ],
)
def test_bad_identify_is_refused(identify: Any, args: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        identity_of("charge", charge, args, {}, identify)


def test_identify_on_a_function_without_a_signature_asks_for_a_callable() -> None:
    with pytest.raises(TypeError, match="pass a callable"):
        identity_of("get", operator.itemgetter(0), (["x"],), {}, ("x",))


# -- names and depth -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("", "step name is empty"),
        ("n" * (MAX_STEP_NAME + 1), f"is {MAX_STEP_NAME + 1} characters, over the limit"),
        ("charge\nsettled", "unprintable character '\\\\n' at 6"),
        ("\x1b[31mcharge", "unprintable character '\\\\x1b' at 0"),
        ("__body__", "reserved"),
        (42, "must be a string"),
    ],
)
def test_bad_step_names_are_refused(name: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_step_name(name)


def test_good_step_names_pass() -> None:
    for name in ("charge", "charge card #2", "paiement – carte", "n" * MAX_STEP_NAME):
        check_step_name(name)


def test_arguments_deeper_than_a_worker_decodes_are_refused_naming_the_depth() -> None:
    value: Any = "leaf"
    for _ in range(MAX_ARGUMENT_DEPTH):
        value = [value]
    check_depth(value, what="arguments of t")  # exactly at the limit
    with pytest.raises(PayloadTooLarge, match=f"nest {MAX_ARGUMENT_DEPTH + 1} levels deep"):
        check_depth({"k": value}, what="arguments of t")


def test_a_transaction_steps_marker_does_not_hold_its_position() -> None:
    """A transaction step that died before its commit left only its marker row
    (``started``, ``TRANSACTION_STEP_REF``); nothing of it committed, so the step coming back
    with another input is not drift."""
    from dataclasses import replace

    from celery_ledger.ledger import TRANSACTION_STEP_REF

    marker = replace(row("credit", H["a"], 0, "started"), external_ref=TRANSACTION_STEP_REF)
    ident, found = place(ReplayBook([marker]), "credit", H["x"])
    assert found is None and ident == ("credit", H["x"], 0)

"""Effect identity: canonical JSON and the keys derived from it (no server needed)."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json

import pytest
from celery import Celery

from celery_ledger import LedgerTask
from celery_ledger.codec import arguments_hash
from celery_ledger.ledger import IdentityError, canonical_json, entry_key, input_hash, provider_key

# -- canonical_json -----------------------------------------------------------------------


def test_canonical_json_sorts_keys_and_is_compact() -> None:
    assert canonical_json({"b": 1, "a": [1, 2, {"d": None, "c": True}]}) == (
        '{"a":[1,2,{"c":true,"d":null}],"b":1}'
    )


def test_canonical_json_is_independent_of_insertion_order() -> None:
    one = {"x": 1, "y": {"p": "q", "r": [1.5, "s"]}}
    two = {"y": {"r": [1.5, "s"], "p": "q"}, "x": 1}
    assert canonical_json(one) == canonical_json(two)


def test_canonical_json_keeps_unicode_and_tuples_as_lists() -> None:
    assert canonical_json(("é", 1)) == '["é",1]'
    assert canonical_json(["é", 1]) == canonical_json(("é", 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_canonical_json_rejects_non_finite_floats(bad: float) -> None:
    with pytest.raises(IdentityError, match=r"\$\.amount\[1\]"):
        canonical_json({"amount": [1.0, bad]})


@pytest.mark.parametrize("key", [1, True, None, 2.5, ("a",)])
def test_canonical_json_rejects_non_string_dict_keys(key: object) -> None:
    # json.dumps would silently turn 1 and True into "1" and "true": two meanings, one key.
    with pytest.raises(IdentityError, match=r"\$\.outer: dict key .* is not a string"):
        canonical_json({"outer": {key: "v"}})


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "set"),
        (b"raw", "bytes"),
        (datetime.date(2024, 1, 1), "date"),
        (decimal.Decimal("1.10"), "Decimal"),
        (object(), "object"),
    ],
)
def test_canonical_json_rejects_non_json_types_naming_the_path(
    value: object, type_name: str
) -> None:
    with pytest.raises(IdentityError) as info:
        canonical_json({"order": {"items": [0, value]}})
    message = str(info.value)
    assert "$.order.items[1]" in message
    assert type_name in message


def test_identity_error_is_a_value_error() -> None:
    # Callers that validate input with `except ValueError` keep working.
    with pytest.raises(ValueError):
        canonical_json(float("nan"))


# -- entry_key ----------------------------------------------------------------------------


def test_entry_key_is_sha256_of_canonical_task_and_material() -> None:
    material = {"order_id": 42, "region": "eu"}
    expected = hashlib.sha256(
        json.dumps(["shop.charge", material], sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert entry_key("shop.charge", material) == expected
    assert len(entry_key("shop.charge", material)) == 64


def test_entry_key_is_stable_across_key_order() -> None:
    assert entry_key("t", {"a": 1, "b": 2}) == entry_key("t", {"b": 2, "a": 1})


def test_entry_key_is_scoped_by_task_name() -> None:
    assert entry_key("shop.charge", [42]) != entry_key("shop.refund", [42])


def test_entry_key_distinguishes_material() -> None:
    assert entry_key("t", [42]) != entry_key("t", ["42"])
    assert entry_key("t", [1]) != entry_key("t", [True])


def test_entry_key_rejects_bad_material() -> None:
    with pytest.raises(IdentityError):
        entry_key("t", {"when": datetime.datetime(2024, 1, 1)})


def test_input_hash_is_stable() -> None:
    assert input_hash([[1, 2], {"b": 1, "a": 2}]) == input_hash([[1, 2], {"a": 2, "b": 1}])
    assert input_hash([[1, 2], {}]) != input_hash([[2, 1], {}])


# -- provider_key -------------------------------------------------------------------------


def test_provider_key_is_stable_and_distinguishes_step_and_occurrence() -> None:
    key = entry_key("shop.charge", [42])
    first = provider_key(key, "charge", 0)
    assert first == provider_key(key, "charge", 0)
    assert len(first) == 40
    assert int(first, 16) >= 0  # hex, safe for any provider's idempotency header
    assert first != provider_key(key, "charge", 1)
    assert first != provider_key(key, "refund", 0)
    assert first != provider_key(entry_key("shop.charge", [43]), "charge", 0)


# -- the worker parent's key (LedgerTask.entry_key_of) --------------------------------------


def _keyed_tasks():
    app = Celery("keys", broker="memory://", set_as_current=False)

    def charge(order_id, amount, note=None):
        return order_id

    by_id = app.task(base=LedgerTask, name="keys.by_id", shared=False)(charge)
    by_names = app.task(
        base=LedgerTask, name="keys.by_names", key_from=("order_id",), shared=False
    )(charge)
    by_call = app.task(
        base=LedgerTask,
        name="keys.by_call",
        key_from=lambda order_id, amount, note=None: [order_id, amount],
        shared=False,
    )(charge)
    return by_id, by_names, by_call


@pytest.mark.parametrize("header_key", [None, "shop-key-7", {"order": 7}])
def test_the_parents_key_is_the_claims_key_without_hashing_the_arguments(header_key) -> None:
    """The worker's parent holds and interrupts entries by ``entry_key_of``; the pool's claim
    keys them by ``ledger_key``. The two must name the same entry in every keying mode, or a
    receipt hold and a worker-lost interrupt would miss the entry the claim wrote."""
    for task in _keyed_tasks():
        for args, kwargs in ((("o-1", 5), {}), (("o-2",), {"amount": 9, "note": "x"})):
            key, args_hash = task.ledger_key(args, kwargs, "task-id-1", header_key)
            assert task.entry_key_of(args, kwargs, "task-id-1", header_key) == key
            assert args_hash == arguments_hash([list(args), dict(kwargs)])
    by_id, by_names, _ = _keyed_tasks()
    assert by_id.entry_key_of(("o-1", 5), {}, "t-1") == entry_key("keys.by_id", "t-1")
    assert by_names.entry_key_of(("o-1", 5), {}, "t-1") == entry_key(
        "keys.by_names", {"order_id": "o-1"}
    )


def test_the_parents_key_needs_no_json_arguments() -> None:
    """A key that does not read the arguments does not hash them in the parent: an argument
    that is not JSON is the claim's to refuse, in the pool, with the ledger's error."""
    by_id, by_names, _ = _keyed_tasks()
    not_json = object()
    assert by_id.entry_key_of(("o-1", not_json), {}, "t-1") == entry_key("keys.by_id", "t-1")
    assert by_names.entry_key_of(("o-1", not_json), {}, "t-1") == entry_key(
        "keys.by_names", {"order_id": "o-1"}
    )
    with pytest.raises(IdentityError):
        by_id.ledger_key(("o-1", not_json), {}, "t-1")

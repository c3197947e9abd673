"""Results and step outputs, stored with kombu's JSON (the serializer Celery already uses).

kombu's JSON keeps datetimes, UUIDs, Decimals and bytes intact across a round trip, so a
replayed step returns what the original returned. Anything it cannot encode, or anything
larger than the configured limit, is an error here: nothing is ever truncated.
"""

from __future__ import annotations

import json
from typing import Any

from kombu.utils.json import dumps, loads

from celery_ledger.ledger import PayloadNotSerializable, PayloadTooLarge, canonical_json
from celery_ledger.ledger.errors import IdentityError


def encode(value: Any, *, limit: int, what: str) -> str:
    """Serialize ``value`` for the ledger.

    Raises:
        PayloadNotSerializable: kombu's JSON cannot encode it.
        PayloadTooLarge: the encoding exceeds ``limit`` bytes.
    """
    try:
        text = dumps(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PayloadNotSerializable(
            f"{what} of type {type(value).__name__} cannot be stored as JSON: {exc}"
        ) from exc
    size = len(text.encode("utf-8"))
    if size > limit:
        raise PayloadTooLarge(
            f"{what} is {size} bytes serialized, over the limit of {limit} bytes "
            "(ledger_max_result_bytes); store it elsewhere and return a reference"
        )
    return text


def decode(text: str | None) -> Any:
    return None if text is None else loads(text)


def canonical_arguments(value: Any) -> str:
    """Canonical JSON of arguments, via kombu's JSON for the types it knows (datetime ...).

    Raises:
        IdentityError: the arguments hold something JSON cannot represent.
    """
    try:
        return canonical_json(value)
    except IdentityError:
        pass
    try:
        plain = json.loads(dumps(value))
    except (TypeError, ValueError) as exc:
        raise IdentityError(f"arguments cannot be serialized as JSON: {exc}") from exc
    return canonical_json(plain)

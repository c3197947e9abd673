"""Effect identity: canonical JSON and the SHA-256 keys derived from it."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from celery_ledger.ledger.errors import IdentityError

__all__ = ["canonical_json", "entry_key", "input_hash", "provider_key", "sha256_hex"]


def _check(value: Any, path: str) -> None:
    # json.dumps(allow_nan=False) rejects NaN but silently stringifies dict keys like 1 or
    # True; a key must mean one thing, so walk the value and refuse anything ambiguous.
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise IdentityError(f"{path}: {value!r} is not allowed in key material")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise IdentityError(f"{path}: dict key {k!r} is not a string")
            _check(item, f"{path}.{k}")
        return
    raise IdentityError(
        f"{path}: {type(value).__name__} is not JSON (use str, int, float, bool, None, "
        "list or dict in key material)"
    )


def canonical_json(value: Any) -> str:
    """Serialize ``value`` as canonical JSON: sorted keys, compact separators, no NaN.

    Raises:
        IdentityError: when ``value`` holds anything that is not plain JSON.
    """
    _check(value, "$")
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False
    )


def sha256_hex(text: str) -> str:
    """Return the hex SHA-256 of ``text`` encoded as UTF-8: every key and hash of the ledger."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def entry_key(task_name: str, key_material: Any) -> str:
    """Return the entry key: SHA-256 of the canonical JSON of ``[task_name, key_material]``."""
    return sha256_hex(canonical_json([task_name, key_material]))


def input_hash(value: Any) -> str:
    """Return the SHA-256 of the canonical JSON of a step's (or a task's) arguments."""
    return sha256_hex(canonical_json(value))


def provider_key(key: str, step_name: str, occurrence: int) -> str:
    """Return the stable idempotency key a ``keyed`` step sends to its provider.

    It is the same on every resume of the same entry, step and occurrence.
    """
    return sha256_hex(canonical_json(["provider", key, step_name, occurrence]))[:40]

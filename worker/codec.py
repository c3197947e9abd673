"""Results and step outputs, stored with kombu's JSON (the serializer Celery already uses).

kombu's JSON keeps datetimes, UUIDs, Decimals and bytes intact across a round trip, so a
replayed step returns what the original returned. Anything it cannot encode, or anything
larger than the configured limit, is an error here: nothing is ever truncated.
"""

from __future__ import annotations

import json
from typing import Any

from celery.exceptions import Reject
from kombu.utils.json import dumps, loads

from celery_ledger.ledger import (
    ArgumentSnapshot,
    PayloadNotSerializable,
    PayloadTooLarge,
    SnapshotCipher,
    canonical_json,
)
from celery_ledger.ledger.errors import IdentityError, loadable_failure, stored_failure
from celery_ledger.ledger.identity import lone_surrogate, sha256_hex


def encode(
    value: Any,
    *,
    limit: int,
    what: str,
    setting: str = "ledger_max_result_bytes",
    advice: str = "store it elsewhere and return a reference",
) -> str:
    """Serialize ``value`` for the ledger; ``setting`` names the limit in the error.

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
            f"({setting}); {advice}"
        )
    return text


def encode_failure(exc: BaseException, *, limit: int) -> str:
    """``exc`` as the ledger stores a failure (``ledger.errors.stored_failure``, the one
    writer), with kombu's JSON: what Celery's result backend would store for it.

    Raises:
        PayloadTooLarge: even its short form exceeds ``limit`` (``ledger_max_exception_bytes``).
    """
    return stored_failure(exc, limit=limit, dumps=dumps)


def decode_failure(backend: Any, error: str) -> BaseException:
    """The exception a RETURN raises for a stored failure: read through ``loadable_failure``
    (classes that moved since it was stored), then Celery's ``backend.exception_to_python``."""
    data = loadable_failure(decode(error))
    try:
        exc = backend.exception_to_python(data)
    except Exception:  # noqa: BLE001
        exc = None
    if isinstance(exc, Reject) and exc.requeue:
        # Stored before a requeueing Reject settled ``retrying`` (``Delivery.after_reject``):
        # raising it again requeued the message forever. The entry is settled; the message
        # has nothing left to do.
        return Reject(exc.reason, requeue=False)
    if isinstance(exc, Exception):
        return exc
    # Never raise a stored SystemExit/KeyboardInterrupt again (older versions stored
    # them): in a worker it would end the pool process on every delivery.
    return RuntimeError(f"stored failure: {data!r}")


def encode_snapshot(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    queue: str | None,
    ledger_key: Any,
    limit: int,
    retries: int = 0,
    cipher: SnapshotCipher | None = None,
    canvas: dict[str, Any] | None = None,
) -> str:
    """The stored argument snapshot of a task (``ArgumentSnapshot``), for recovery's resume,
    sealed with ``cipher`` when given (``ledger_snapshot_keys``: encryption at rest). The size
    limit applies to the plain JSON.

    Raises:
        PayloadNotSerializable: the arguments are not JSON.
        PayloadTooLarge: the snapshot exceeds ``limit`` (``ledger_max_snapshot_bytes``).
    """
    snapshot = ArgumentSnapshot(
        args=args,
        kwargs=kwargs,
        queue=queue,
        ledger_key=ledger_key,
        retries=retries,
        canvas=canvas or {},
    )
    text = encode(
        snapshot.as_data(),
        limit=limit,
        what="argument snapshot",
        setting="ledger_max_snapshot_bytes",
        advice="pass a reference to large data instead of the data",
    )
    return cipher.seal(text) if cipher is not None else text


#: Deepest nesting of lists, tuples and dicts a task's arguments may have. A worker decodes a
#: message with the JSON decoder's C recursion, bounded by Python's recursion limit (1000 by
#: default) minus the frames already on the worker's stack; a sender that raised its own limit
#: can encode what no worker can read, and the worker then drops the message. 200 is far below
#: that bound and far above any argument seen in practice.
MAX_ARGUMENT_DEPTH = 200


def check_depth(value: Any, *, what: str, limit: int = MAX_ARGUMENT_DEPTH) -> None:
    """Refuse ``value`` if lists, tuples and dicts nest in it deeper than ``limit``.

    Walks the value without recursion (a value too deep for Python's recursion is exactly
    what it looks for), once over every container.

    Raises:
        PayloadTooLarge: the value nests deeper than ``limit``; the message names the depth.
    """
    if not isinstance(value, _NESTED):
        return
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    push = stack.append
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, _NESTED):
                push((child, depth + 1))
    if deepest > limit:
        raise PayloadTooLarge(
            f"{what} nest {deepest} levels deep, over the limit of {limit}: a worker could "
            "not decode the message; pass a flatter structure or a reference to the data"
        )


_NESTED = (dict, list, tuple)


def check_text(value: Any, *, what: str) -> None:
    """Refuse ``value`` if a string in it (a value or a dict key) holds a lone surrogate: a
    worker could decode the message but not hash its arguments (``sha256_hex``).

    Raises:
        IdentityError: naming the surrogate; nothing is sent.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise IdentityError(lone_surrogate(item[exc.start], what)) from None
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


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


def arguments_hash(value: Any) -> str:
    """SHA-256 of the canonical JSON of arguments (``canonical_arguments``): a task's
    ``args_hash`` and a step's input hash.

    Raises:
        IdentityError: the arguments hold something JSON cannot represent.
    """
    return sha256_hex(canonical_arguments(value))

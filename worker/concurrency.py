"""Concurrency keys (docs/concurrency.md): ``concurrency_key=`` and ``concurrency_limit=N``.

At most N entries with one concurrency key are ``running`` across the fleet. The decision is
the ledger's (``ledger.slots``): the claim takes a slot under the key's lock, or parks the entry
in the slot wait and answers HOLD (the delivery is acked, runs nothing, holds no worker slot).
This module is the worker's side:

- **the key** of a call (``slot_ask``): a ``concurrency_key`` tuple names arguments, like
  ``key_from``, and keys the slots per task (``<task name>:<name>=<value>,...``); a callable
  returns the key itself, shared by every task that returns it (so two tasks can share a
  customer's slots);
- **the handover** after a run (``after_run``): the attempt's settle served the key's oldest
  waiters in its own transaction (``LedgerStore.settle_in_slot``), and they are sent at once
  through the sweep's own wake (``recovery.slots``); a run that ended without a settle of its
  own (stopped, superseded) serves them then. A handover that fails is the sweep's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_ledger import runtime
from celery_ledger.ledger import Claim, SlotAsk
from celery_ledger.ledger.slots import MAX_CONCURRENCY_KEY_CHARS, Granted
from celery_ledger.recovery import slots

if TYPE_CHECKING:
    from celery_ledger.attempt import Attempt

log = logging.getLogger(__name__)

#: The key of ``concurrency_key`` argument names: a readable prefix, and when too long for
#: the column, a digest of the whole in place of the tail.
_DIGEST_CHARS = 32

#: A delivery's slot before its claim asked for one (``Delivery.slot``).
NO_SLOT: SlotAsk | None = None


def check_options(task_name: str, key: Any, limit: Any) -> None:
    """Refuse concurrency options that cannot work (at registration, not at run time).

    Raises:
        TypeError: ``concurrency_key`` is a string (a tuple of names was meant).
        ValueError: a key without a limit of at least 1, or a limit without a key.
    """
    if key is None:
        if limit is not None:
            raise ValueError(f"task {task_name}: concurrency_limit without a concurrency_key")
        return
    if isinstance(key, str):
        raise TypeError(
            f"task {task_name}: concurrency_key must be a tuple of argument names or a "
            f"callable, not the string {key!r}"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(
            f"task {task_name}: concurrency_limit must be an int of at least 1 with a "
            f"concurrency_key, not {limit!r}"
        )


def slot_ask(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> SlotAsk | None:
    """The concurrency key and limit of this call of ``task`` (a ``LedgerTask``; None: it has
    no key).

    Raises:
        MissingKeyArgument: the call lacks an argument ``concurrency_key`` names.
        Exception: whatever a ``concurrency_key`` callable raises (the delivery is refused,
            as for ``key_from``).
    """
    given = task.concurrency_key
    if given is None:
        return None
    assert task.concurrency_limit is not None  # ``check_options`` at registration
    if callable(given):
        value = given(*args, **kwargs)
        text = value if isinstance(value, str) else _canonical(value)
    else:
        material = task._named_key_material(args, kwargs, given)
        named = ",".join(f"{n}={_text(material.get(n))}" for n in given)
        text = f"{task.name}:{named}"
    return SlotAsk(_fit(text), task.concurrency_limit)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else _canonical(value)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _fit(text: str) -> str:
    """``text`` if it fits the column, else its head and a digest of the whole."""
    if len(text) <= MAX_CONCURRENCY_KEY_CHARS:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{text[: MAX_CONCURRENCY_KEY_CHARS - _DIGEST_CHARS - 1]}#{digest}"


def after_run(app: Any, attempt: Attempt) -> None:
    """After a run: when ``attempt`` held (or may have held) a slot of a concurrency key,
    send the waiters its settle served (``attempt.served``, handed over in the settle's
    transaction), or, when no settle of it did (stopped, superseded, a ``wait_for``, an
    unreachable ledger), serve the key's waiters now and send them. Never raises: what it
    could not do, the sweep does."""
    if attempt.slot is not None:
        _hand_over(app, attempt.slot, attempt.actor or "worker", attempt.served)


def after_hold(app: Any, ask: SlotAsk | None, claim: Claim, actor: str | None) -> None:
    """After a HOLD: when the claim held the entry for a rate limit's token
    (docs/concurrency.md § "With a rate limit"), a slot a handover had given it went back
    with that hold, so the key's waiters are served now, not at the sweep's next handover.
    Never raises."""
    if ask is not None and claim.token_due_in is not None:
        _hand_over(app, ask, actor or "worker", None)


def _hand_over(app: Any, ask: SlotAsk, actor: str, served: list[Granted] | None) -> None:
    """Send ``served`` (waiters a settle served), or serve the key's waiters now and send
    them (``served`` None)."""
    store = runtime.store_for(app)
    lease = runtime.settings_for(app).lease_seconds
    try:
        if served is not None:
            slots.wake_granted(
                store,
                app,
                served,
                lease_seconds=lease,
                actor=actor,
                cipher=runtime.snapshot_cipher(app),
            )
        else:
            slots.hand_over(
                store,
                app,
                ask.key,
                limit=ask.limit,
                lease_seconds=lease,
                actor=actor,
                cipher=runtime.snapshot_cipher(app),
            )
    except Exception as exc:  # noqa: BLE001 - the sweep's handover is the backstop
        log.warning("could not hand over a slot of %s (%r); the sweep will", ask.key, exc)


__all__ = ["after_run", "after_hold", "check_options", "slot_ask"]

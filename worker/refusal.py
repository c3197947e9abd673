"""A delivery the ledger refuses: what it says, and the entry that keeps it (guarantees.md § "Bad
input").

A message sent by name can carry what no ledgered task can run: arguments that do not fit the
signature, a ``key_from`` that raises on them, a lone surrogate no store keeps, a key reused
with other arguments, or message fields of the wrong kind (``args`` no list, a ``timelimit``
that is no pair of numbers). Nothing runs and the worker goes on. So that an operator finds
what a careless sender sent, the delivery gets an entry of its own, keyed by its task id under
material no business key can have (``refused_key``), settled ``failed`` with the refusal as
its reason; a redelivery of the same message RETURNs that failure. The refusal names what is
wrong, never the arguments (a secret may be among them).

Two callers: the pool process (``Delivery``: keying and storing the arguments) and
the worker's parent (``LedgerRequest``: the message's fields, before Celery uses them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from celery_ledger import runtime
from celery_ledger.codec import encode_failure
from celery_ledger.ledger import (
    ClaimRequest,
    EntryStatus,
    Gate,
    IdentityError,
    KeyConflict,
    LedgerError,
    LedgerStore,
    MalformedArguments,
    entry_key,
)
from celery_ledger.settings import LedgerSettings

log = logging.getLogger(__name__)

#: The ``args_hash`` of a refused delivery's entry: no arguments hash to it.
REFUSED_ARGUMENTS = "refused"
#: A refusal's reason is at most this long.
REASON_LIMIT = 500


def one_line(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def refused_key(task_name: str, task_id: str) -> str:
    """The entry key of a refused delivery: its task id, as material no business key has."""
    return entry_key(task_name, {"refused_task_id": task_id})


def as_refusal(task: Any, exc: BaseException) -> LedgerError:
    """The ledger's error for a delivery whose arguments could not be keyed or stored: the
    ledger's own errors as they are, anything else (user code, Python's words) said again."""
    if isinstance(exc, (IdentityError, KeyConflict)):
        return exc
    if isinstance(exc, UnicodeError):
        what = "a string in them is not valid Unicode (a lone surrogate): no store keeps it"
    elif callable(getattr(task, "key_from", None)):
        what = f"its key_from raised {type(exc).__name__}: {one_line(str(exc), 200)}"
    elif isinstance(exc, TypeError):
        what = f"they do not fit its signature {task._signature()}: {one_line(str(exc), 200)}"
    else:
        what = f"{type(exc).__name__}: {one_line(str(exc), 200)}"
    return MalformedArguments(
        f"{task.name}: the delivery's arguments cannot be keyed or stored ({what}); nothing ran"
    )


def record(
    task: Any,
    store: LedgerStore,
    task_id: str,
    refusal: LedgerError,
    actor: str,
    settings: LedgerSettings | None = None,
) -> None:
    """Settle the refused delivery's own entry ``failed`` with ``refusal`` as its reason
    (``settings``: the delivery's, else the app's). Never raises: a refusal that cannot be
    recorded is logged, and refused all the same."""
    key = refused_key(task.name, task_id)
    reason = one_line(str(refusal), REASON_LIMIT)
    try:
        settings = settings or runtime.settings_for(task.app)
        claim = store.claim(
            ClaimRequest(
                key=key,
                task_name=task.name,
                task_id=task_id,
                args_hash=REFUSED_ARGUMENTS,
                snapshot=None,
                side_effect=task.side_effect,
                owner=runtime.owner_for(actor, per_process=True),
                lease_seconds=float(settings.lease_seconds),
            )
        )
        if claim.gate is Gate.RUN:
            store.settle(
                key,
                claim.fence,
                EntryStatus.FAILED,
                error=encode_failure(refusal, limit=settings.max_exception_bytes),
                reason=reason,
                actor=actor,
            )
    except Exception as err:  # noqa: BLE001 - the worker's parent runs this too: never raise
        log.warning("refused task_id=%s not recorded in the ledger: %s", task_id, err)
    log.warning("refused task_id=%s: %s", task_id, reason)


def malformed_fields(headers: Mapping[str, Any], body: Any) -> str | None:
    """What is wrong with a protocol-2 message's fields, or None: the checks Celery does not
    make before it unpacks them in the worker's parent (a ``timelimit`` that is no pair of
    numbers ended the worker there)."""
    if not isinstance(body, (list, tuple)) or len(body) != 3:
        return "the message body is not [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(args, (list, tuple)):
        return f"its args are a {type(args).__name__}, not a list"
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        return f"its kwargs are a {type(kwargs).__name__}, not a mapping of names"
    if embed is not None and not isinstance(embed, Mapping):
        return f"its canvas (embed) is a {type(embed).__name__}, not a mapping"
    for name in ("callbacks", "errbacks", "chain"):
        value = (embed or {}).get(name)
        if value is not None and not isinstance(value, (list, tuple)):
            return f"its {name} are a {type(value).__name__}, not a list"
    chord = (embed or {}).get("chord")
    if chord is not None and not isinstance(chord, Mapping):
        return f"its chord is a {type(chord).__name__}, not a signature"
    limits = headers.get("timelimit")
    if limits is not None and not _time_limits(limits):
        return "its timelimit header is not a pair of time limits in seconds"
    retries = headers.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)):
        return "its retries header is not a count"
    index = headers.get("group_index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        return "its group_index header is not an index"
    return None


def _time_limits(value: Any) -> bool:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return False
    return all(
        v is None
        or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
        for v in value
    )

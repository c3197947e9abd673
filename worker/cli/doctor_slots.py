"""``doctor``'s check of concurrency keys (docs/concurrency.md): a key whose waiters wait long.

A waiter is sent when a holder of its key settles or its lease is interrupted; one that waits
past the bound means the key's holders run long, its limit is too small for its load, or its
slots are not handed on (no beat running the sweep, the backstop of every handover).
"""

from __future__ import annotations

from typing import Any

from celery_ledger.view import duration, slot_key_view

#: ``doctor --slot-wait``'s default: a waiter older than this is a warning. Ten minutes is
#: many times a sweep interval (the handover's backstop) and longer than most tasks run.
SLOT_WAIT_SECONDS = 600.0


def check_slot_waits(store: Any, bound: float) -> tuple[str, str, str]:
    """(name, PASS|WARN, why): WARN when a concurrency key has waiters older than ``bound``
    seconds (``store`` None: the schema check failed, nothing is read)."""
    if store is None:
        return ("slot waits", "WARN", "not checked: the ledger's schema is not usable (schema)")
    now = store.now()
    keys = [slot_key_view(k, now) for k in store.slot_keys()]
    late = [k for k in keys if (k["oldest_wait_seconds"] or 0.0) > bound]
    if not late:
        waiting = sum(k["waiting"] for k in keys)
        return (
            "slot waits",
            "PASS",
            f"{waiting} task(s) wait for a concurrency slot, none over {duration(bound)}",
        )
    shown = ", ".join(
        f"{k['concurrency_key']} ({k['waiting']} waiting, {k['holding']}/{k['limit']} held, "
        f"oldest {duration(k['oldest_wait_seconds'])})"
        for k in late[:5]
    )
    return (
        "slot waits",
        "WARN",
        f"{len(late)} concurrency key(s) with waiters older than {duration(bound)}: {shown}; "
        "are their holders stuck (celery-ledger list --status running), is beat running, or "
        "is the limit too small for the load?",
    )

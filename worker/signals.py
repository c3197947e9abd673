"""Durable signals (design.md § "Durable signals"): ``self.wait_for(name, timeout=)`` in a body,
``celery_ledger.signal(app, key, name, payload)`` from anywhere.

- **The wait** is a step whose output is its deadline (database clock), so a resume never
  waits longer than the first run said. It then asks the ledger for its signal
  (``LedgerStore.take_signal``: the wait is the body's n-th wait for that name, the same on
  every run). No signal yet: the entry settles ``sleeping`` with ``due_at`` = the deadline
  and the reason ``signal:<name>``, and the attempt ends (message acked, no worker slot
  held), exactly as ``self.sleep`` does. The sweep wakes it at the deadline: the replay
  finds no signal and raises ``SignalTimeout``.
- **The signal** is recorded under the entry's row lock; an entry asleep in that wait is
  made due now and woken through the sweep's own wake (``recovery.wake.wake_entry``: the
  CAS to running under the resume marker, then ``recovery.resend.send`` of the stored
  envelope, whose claim passes the admission gate). If that send fails or this process dies
  first, the entry is due: the next sweep wakes it.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from celery_ledger import runtime
from celery_ledger.errors import SignalTimeout, StepUsageError, Stopped
from celery_ledger.ledger import (
    EntryNotFound,
    EntryStatus,
    LedgerStore,
    SignalRefused,
    SnapshotCipher,
    open_snapshot,
)
from celery_ledger.ledger.signals import check_signal_name, wait_reason

if TYPE_CHECKING:
    from celery_ledger.attempt import Attempt

log = logging.getLogger(__name__)

#: The step a wait records: its output is the wait's deadline.
WAIT_STEP = "ledger.wait_for"

#: Who a signal is from when the caller does not say.
DEFAULT_SENDER = "signal"


# -- the wait ----------------------------------------------------------------------------------


def wait_for(attempt: Attempt, name: str, timeout: float) -> Any:
    """The body of ``LedgerTask.wait_for``: the payload of the signal this wait takes.

    Raises:
        StepUsageError: a bad name or timeout (the same on every run).
        SignalTimeout: the deadline passed with no signal for this wait.
        Stopped: the entry sleeps until the signal or the deadline (the delivery is acked).
    """
    try:
        check_signal_name(name)
    except ValueError as exc:
        raise StepUsageError(str(exc)) from None
    seconds = float(timeout)
    if not math.isfinite(seconds) or seconds < 0:
        raise StepUsageError(f"wait_for timeout is finite seconds >= 0, not {timeout!r}")
    deadline = float(
        attempt.step(WAIT_STEP, lambda _n, t: attempt.now() + t, (name, seconds), {}, effect=False)
    )
    waits: Counter[str] = attempt.signal_waits
    waits[name] += 1
    wait = waits[name]
    taken = attempt.take_signal(name, wait, deadline)
    if taken is not None:
        if taken.timed_out:
            raise SignalTimeout(
                f"{attempt.task.name}[{attempt.task_id}] key {attempt.key}: no signal "
                f"{name!r} within {seconds:g}s"
            )
        assert taken.payload is not None
        text = open_snapshot(taken.payload, runtime.snapshot_cipher(attempt.task.app))
        log.info(
            "signal %r taken by wait %d of key=%s task_id=%s",
            name,
            wait,
            attempt.key,
            attempt.task_id,
        )
        return json.loads(text)
    if not attempt.settle(EntryStatus.SLEEPING, due_at=deadline, reason=wait_reason(name)):
        raise Stopped(Ignore())
    try:
        # A signal sent while this attempt still ran saw no wait to make due.
        runtime.store_for(attempt.task.app).due_if_signalled(attempt.key, attempt.fence, name)
    except Exception as exc:  # noqa: BLE001 - the deadline wakes it at worst
        log.warning("could not check key=%s for a pending signal %r: %r", attempt.key, name, exc)
    log.info(
        "waiting key=%s task_id=%s for signal %r until %.3f",
        attempt.key,
        attempt.task_id,
        name,
        deadline,
    )
    raise Stopped(Ignore())


# -- the signal --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignalSent:
    """A signal the ledger kept: its entry, and whether a waiting task was sent now."""

    key: str
    task_name: str
    task_id: str
    status: EntryStatus
    woken: bool


def payload_text(payload: Any) -> str:
    """``payload`` as the JSON the ledger stores.

    Raises:
        SignalRefused: it is not JSON (a set, an object, NaN ...).
    """
    try:
        return json.dumps(payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise SignalRefused(f"a signal's payload must be JSON: {exc}") from None


def signal(
    app: Any, ref: str, name: str, payload: Any = None, *, by: str | None = None
) -> SignalSent:
    """Send signal ``name`` with ``payload`` (any JSON value) to the entry ``ref`` (its key,
    or its task id), durably: the wait for ``name`` in its body returns ``payload``, once.

    A task asleep in that wait is sent now (the sweep's wake); one not waiting yet keeps the
    signal for its wait. Sealed at rest when ``ledger_snapshot_keys`` is set.

    Raises:
        EntryNotFound: no entry has this key or task id.
        SignalRefused: the entry is settled, or the payload is not JSON.
        ValueError: a bad signal name.
        LedgerUnavailable: the ledger cannot be reached (nothing was kept).
    """
    return send(
        runtime.store_for(app),
        app,
        ref,
        name,
        payload,
        by=by or DEFAULT_SENDER,
        cipher=runtime.snapshot_cipher(app),
        lease_seconds=runtime.settings_for(app).lease_seconds,
    )


def send(
    store: LedgerStore,
    app: Any,
    ref: str,
    name: str,
    payload: Any,
    *,
    by: str,
    cipher: SnapshotCipher | None,
    lease_seconds: float,
) -> SignalSent:
    """``signal`` over a given store (the CLI's, Flower's): record it, then wake a waiting
    entry through ``recovery.wake.wake_entry``, the sweep's own wake. Raises as ``signal``."""
    from celery_ledger.recovery.wake import wake_entry

    text = payload_text(payload)
    stored = cipher.seal(text) if cipher is not None else text
    try:
        sent = store.send_signal(ref, name, stored, by=by)
    except EntryNotFound:
        keys = store.keys_of_task_id(ref, limit=2)
        if len(keys) != 1:
            raise EntryNotFound(
                f"no ledger entry with key or task id {ref}; the signal was not kept"
            ) from None
        sent = store.send_signal(keys[0], name, stored, by=by)
    woken = False
    if sent.due_now:
        entry = store.get_entry(sent.key)
        outcome = wake_entry(
            store,
            app,
            sent.key,
            entry.fence,
            entry.status,
            entry.snapshot,
            task_id=entry.task_id,
            lease_seconds=lease_seconds,
            actor=by,
            cipher=cipher,
        )
        woken = outcome.value == "resumed"
        if not woken:
            log.info("signal %r to key=%s: %s; the sweep wakes it", name, sent.key, outcome.value)
    return SignalSent(sent.key, sent.task_name, sent.task_id, sent.status, woken)

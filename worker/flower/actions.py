"""The page's actions, through the store and recovery. Blocking.

Release, resume, mark-dead, cancel, a durable signal, and an outbox child's drop or repair.

They take the same path as ``celery-ledger release`` and ``celery-ledger resume``
(``celery_ledger.cli.ops``): every check runs before the one write, the one-shot and
live-lease refusals are the store's own (decided inside ``store.release``'s transaction),
a ``not-executed`` release is followed by ``recovery.resume_entry`` exactly as in the CLI,
and a resume is ``resume_entry``'s compare-and-set, which admits one resumer however many
operators click. The authorizer (``celery_ledger.authorize``) is asked last, with the entry
as it is now; the operator is the user Flower (or the Django admin,
``celery_ledger.contrib.django``) authenticated, stamped as ``by``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from celery_ledger.announce import announce
from celery_ledger.authorize import Action, ActionDetails, Operator, authorize
from celery_ledger.codec import encode
from celery_ledger.flower.context import LedgerPage
from celery_ledger.ledger import (
    EntryStatus,
    Interrupted,
    MarkDeadRefused,
    OperatorTextError,
    PayloadError,
    Release,
    ReleaseRefused,
    Verdict,
    cipher_from,
)
from celery_ledger.outbox import repaired_payload
from celery_ledger.recovery import resume_entry

log = logging.getLogger(__name__)

#: What an entry page says after a successful action, by the code each action returns (the
#: redirect carries only the code): Flower's page and the Django admin say the same.
DONE = {
    "released-completed": "Released as completed: every later delivery returns the result "
    "you gave.",
    "released-resumed": "Released as not executed and re-enqueued with its task id: a worker "
    "runs it once more.",
    "released-no-snapshot": "Released as not executed. It has no argument snapshot: re-send "
    "the task id by hand; it stays interrupted until then.",
    "released-blocked": "Released as not executed, then blocked as a crash loop.",
    "released-lost-race": "Released as not executed; not re-enqueued now (another resumer, or "
    "the broker refused): the sweep picks it up.",
    "resumed": "Re-enqueued with its task id and argument snapshot.",
    "resume-blocked": "Not re-enqueued: interrupted more than ledger_max_resumes times, so it "
    "was blocked as a crash loop.",
    "marked-dead": "Marked dead: every attempt so far is asserted dead, stamped with your "
    "user and the reason.",
    "cancel-cancelled": "Cancelled: it never starts; a later delivery raises TaskCancelled.",
    "cancel-requested": "Cancellation recorded: it is running and stops at its next effect "
    "step (a step already started finishes).",
    "signal-sent": "Signal sent: the task was waiting for it and is sent now; its wait "
    "returns the payload.",
    "signal-kept": "Signal kept: the task's next wait for that name takes it.",
    "child-dropped": "Child dropped: it is never published; stamped with your user and the reason.",
    "child-repaired": "Child repaired: the option is cleared, and the next sweep publishes it.",
}

#: Longest reason kept; the entry's column is text, but a reason is a sentence.
MAX_REASON_CHARS = 2000


class ActionRefused(Exception):
    """Raised when an action is refused before (or by) its one write; nothing was changed."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Released:
    release: Release
    #: What the follow-up resume did (``resumed``, ``no-snapshot``, ...); None for completed.
    resume: str | None


def parse_verdict(raw: str | None) -> Verdict:
    value = (raw or "").strip().lower().replace("_", "-")
    if value == "completed":
        return Verdict.COMPLETED
    if value == "not-executed":
        return Verdict.NOT_EXECUTED
    raise ActionRefused("choose a verdict: completed or not-executed", 400)


def parse_reason(raw: str | None) -> str:
    reason = " ".join((raw or "").split())
    if not reason:
        raise ActionRefused("a reason is required: it is stamped on the entry and audited", 400)
    if len(reason) > MAX_REASON_CHARS:
        raise ActionRefused(f"the reason is over {MAX_REASON_CHARS} characters", 400)
    return reason


def parse_result(text: str | None, verdict: Verdict, limit: int) -> str | None:
    """The result a ``completed`` release stores, checked as JSON."""
    if verdict is Verdict.NOT_EXECUTED:
        if text and text.strip():
            raise ActionRefused("a result goes with the verdict completed only", 400)
        return None
    if text is None or not text.strip():
        raise ActionRefused(
            "the verdict completed needs the task's result as JSON ('null' for none)", 400
        )

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        detail = " ".join(str(exc).split())
        raise ActionRefused(f"the result is not valid JSON: {detail}", 400) from None
    try:
        return encode(value, limit=limit, what="the result")
    except PayloadError as exc:
        raise ActionRefused(str(exc), 400) from None


def _authorized(
    page: LedgerPage,
    operator: Operator,
    action: Action,
    key: str,
    details: ActionDetails | None = None,
) -> Any:
    entry = page.store.get_entry(key)
    decision = authorize(page.settings, operator, action, entry, details)
    if not decision.allowed:
        raise ActionRefused(f"not allowed: {decision.reason or 'denied'}", 403)
    return entry


def release(
    page: LedgerPage,
    key: str,
    *,
    operator: Operator,
    verdict_raw: str | None,
    reason_raw: str | None,
    result_raw: str | None,
) -> Released:
    """Release ``key`` once, then (not-executed) re-enqueue it as the CLI does.

    Raises:
        ActionRefused: bad input, denied, or refused by the store.
        EntryNotFound: no such key.
    """
    verdict = parse_verdict(verdict_raw)
    reason = parse_reason(reason_raw)
    result = parse_result(result_raw, verdict, page.settings.max_result_bytes)
    action = Action.release(verdict)
    _authorized(page, operator, action, key)
    try:
        rel = page.store.release(
            key,
            verdict,
            by=operator.name,
            reason=reason,
            result=result,
            require_death_signal=page.settings.release_requires_death_signal,
        )
    except ReleaseRefused as exc:
        raise ActionRefused(str(exc), 409) from None
    announce(
        page.capp,
        "released",
        task_id=rel.task_id,
        key=key,
        fence=rel.fence,
        verified=verdict.value,
        by=operator.name,
    )
    outcome = None
    if rel.to_status is EntryStatus.INTERRUPTED:
        outcome = "no-snapshot"
        if rel.snapshot is not None:
            s = page.settings
            outcome = resume_entry(
                page.store,
                page.capp,
                Interrupted(key, rel.task_name, rel.task_id, rel.fence),
                lease_seconds=s.lease_seconds,
                max_resumes=s.max_resumes,
                actor=operator.name,
                cipher=cipher_from(page.settings.snapshot_keys),
            ).value
    log.info(
        "released key=%s task_id=%s fence=%s from %s as %s by %s via %s (resume: %s)",
        key,
        rel.task_id,
        rel.fence,
        rel.from_status.value,
        verdict.value,
        operator.name,
        operator.via,
        outcome,
    )
    return Released(rel, outcome)


def resume(page: LedgerPage, key: str, *, operator: Operator, reason_raw: str | None) -> str:
    """Re-enqueue an interrupted entry now; returns ``resume_entry``'s outcome.

    Raises:
        ActionRefused: bad input, denied, not interrupted, no snapshot, or lost the race.
        EntryNotFound: no such key.
    """
    reason = parse_reason(reason_raw)
    entry = _authorized(page, operator, Action.RESUME, key)
    if entry.status is not EntryStatus.INTERRUPTED:
        raise ActionRefused(f"it is {entry.status.value}, not interrupted: nothing to resume")
    if entry.snapshot is None:
        raise ActionRefused(
            f"it has no argument snapshot: re-send task id {entry.task_id} by hand, or release it"
        )
    s = page.settings
    outcome = resume_entry(
        page.store,
        page.capp,
        Interrupted(key, entry.task_name, entry.task_id, entry.fence, entry.interruptions),
        lease_seconds=s.lease_seconds,
        max_resumes=s.max_resumes,
        actor=operator.name,
        cipher=cipher_from(page.settings.snapshot_keys),
    ).value
    # The store's resume event has no detail column to carry it: the reason is in this log
    # line (with key, task id, fence) until resume takes one (docs/design.md).
    log.info(
        "resume of key=%s task_id=%s fence=%s by %s via %s: %s (%s)",
        key,
        entry.task_id,
        entry.fence,
        operator.name,
        operator.via,
        outcome,
        reason,
    )
    if outcome == "lost-race":
        raise ActionRefused(
            "not re-enqueued: another resumer moved it first, or the broker refused the message"
        )
    return outcome


def mark_dead(
    page: LedgerPage, key: str, *, operator: Operator, reason_raw: str | None, override: bool
) -> None:
    """Assert the entry's old attempts dead (``celery-ledger mark-dead``), stamped with the
    Flower user; refused on a recent sign of life unless ``override``.

    Raises:
        ActionRefused: bad input, denied, or refused by the store (a sign of life, completed).
        EntryNotFound: no such key.
    """
    reason = parse_reason(reason_raw)
    _authorized(page, operator, Action.MARK_DEAD, key, ActionDetails(override_heartbeat=override))
    s = page.settings
    try:
        signal = page.store.mark_dead(
            key,
            by=operator.name,
            reason=reason,
            grace_seconds=s.death_grace_seconds,
            lease_seconds=s.lease_seconds,
            override_heartbeat=override,
        )
    except (MarkDeadRefused, OperatorTextError) as exc:
        raise ActionRefused(str(exc), 409) from None
    entry = page.store.get_entry(key)
    announce(
        page.capp,
        "marked-dead",
        task_id=entry.task_id,
        key=key,
        fence=signal.fence,
        by=operator.name,
    )
    log.info(
        "marked dead key=%s fence<=%s by %s via %s%s",
        key,
        signal.fence,
        operator.name,
        operator.via,
        f" (overriding: {'; '.join(signal.overridden)})" if signal.overridden else "",
    )


def cancel(page: LedgerPage, key: str, *, operator: Operator, reason_raw: str | None) -> str:
    """Cancel a task (design.md § "Durable time"; ``celery-ledger cancel``): ``cancelled`` or
    ``requested``.

    Raises:
        ActionRefused: bad input, denied, or settled already.
        EntryNotFound: no such key.
    """
    from celery_ledger.timing import cancel_entry

    reason = parse_reason(reason_raw)
    _authorized(page, operator, Action.CANCEL, key)
    done = cancel_entry(page.capp, page.store, key, by=operator.name, reason=reason)
    if done.outcome == "settled":
        raise ActionRefused(f"it is {done.found.value} already: nothing to cancel")
    return str(done.outcome)


def signal(
    page: LedgerPage,
    key: str,
    *,
    operator: Operator,
    name_raw: str | None,
    payload_raw: str | None,
) -> str:
    """Send a durable signal to the task (design.md § "Durable signals"; ``celery-ledger
    signal``): ``signal-sent`` (it was waiting and is sent now) or ``signal-kept``.

    Raises:
        ActionRefused: bad input, denied, or the entry is settled.
        EntryNotFound: no such key.
    """
    from celery_ledger.ledger import SignalRefused
    from celery_ledger.ledger.signals import check_signal_name
    from celery_ledger.signals import send

    name = (name_raw or "").strip()
    try:
        check_signal_name(name)
    except ValueError as exc:
        raise ActionRefused(str(exc), 400) from None

    def no_constants(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    text = payload_raw if payload_raw is not None and payload_raw.strip() else "null"
    try:
        value = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        detail = " ".join(str(exc).split())
        raise ActionRefused(f"the payload is not valid JSON: {detail}", 400) from None
    _authorized(page, operator, Action.SIGNAL, key)
    try:
        sent = send(
            page.store,
            page.capp,
            key,
            name,
            value,
            by=operator.name,
            cipher=cipher_from(page.settings.snapshot_keys),
            lease_seconds=page.settings.lease_seconds,
        )
    except SignalRefused as exc:
        raise ActionRefused(str(exc)) from None
    return "signal-sent" if sent.woken else "signal-kept"


def outbox_child(
    page: LedgerPage,
    key: str,
    *,
    operator: Operator,
    child_id: str | None,
    action_raw: str | None,
    reason_raw: str | None,
) -> str:
    """Drop a failing child of ``key``, or clear one of its options (``celery-ledger outbox
    drop|repair``): ``child-dropped`` or ``child-repaired``.

    Raises:
        ActionRefused: bad input, denied, or the child was published or dropped already.
        EntryNotFound: no such key.
    """
    reason = parse_reason(reason_raw)
    what = (action_raw or "").strip()
    if not child_id or not (what == "drop" or what.startswith("clear:")):
        raise ActionRefused("choose a child and what to do with it: drop, or clear an option", 400)
    _authorized(page, operator, Action.OUTBOX, key)
    try:
        if what == "drop":
            page.store.drop_child(key, child_id, by=operator.name, reason=reason)
            return "child-dropped"
        found = next((c for c in page.store.children_of(key) if c.child_id == child_id), None)
        if found is None:
            raise ActionRefused(f"entry {key} recorded no child {child_id}", 404)
        option = what.removeprefix("clear:")
        payload = repaired_payload(found, (option,), page.cipher)
        page.store.repair_child(
            key, child_id, payload, by=operator.name, reason=f"cleared {option}: {reason}"
        )
    except (ReleaseRefused, ValueError) as exc:
        raise ActionRefused(str(exc)) from None
    return "child-repaired"

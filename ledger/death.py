"""The death-signal gate: ``mark-dead``, a fenced attempt's signs of life, and the release gate.

Why (the Mycelium seed): a ``not-executed`` release lets an effect run again. The fence stops
a superseded attempt's *ledger* writes, not its HTTP call: an attempt that was only paused
(SIGSTOP, a long GC, a partition) and wakes mid-call can still land the effect the release
just authorized again. Only someone who knows the old worker is gone (its VM destroyed, its
process seen killed) can say so, and the ledger records that they did:

- ``mark_dead`` stamps the entry: every attempt up to its current fence is asserted dead, by
  whom, why, when (audited as ``marked-dead``). It refuses while the old owner showed a sign
  of life within a grace window (its claim or a lease renewal, kept in ``renewed_at`` where
  the sweep's interrupt cannot erase it, or a refused write), judged by the task's own lease,
  unless overridden;
- ``record_seen_alive`` is what a superseded attempt writes when the fence refuses it (its
  first refused renewal or step write): "seen alive at ...", which ``show`` and the Ledger
  page print, and which makes ``mark_dead`` refuse;
- ``body_starter`` finds, for a body that records no steps, the last attempt that may have
  run it: the takeovers after it only waited out the grace (``worker/ambiguity.py``), and a
  waiter's lease renewals say nothing of the body;
- ``death_gate`` runs inside ``release``'s transaction under
  ``ledger_release_requires_death_signal``: a ``not-executed`` release of an ambiguous step
  (a ``started`` row, or the body of a task that recorded none) is refused until a
  ``mark_dead`` covers the fence that started it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update

from celery_ledger.ledger import statements as sql
from celery_ledger.ledger.core import Note, StoreCore
from celery_ledger.ledger.dbclock import db_now
from celery_ledger.ledger.errors import DeathSignalRequired, EntryNotFound, MarkDeadRefused
from celery_ledger.ledger.operator_text import check_release_text
from celery_ledger.ledger.schema import entries, events, steps
from celery_ledger.ledger.states import EntryStatus, StepStatus

#: Longest owner name kept with a sign of life (the column's width).
MAX_OWNER_CHARS = 255


@dataclass(frozen=True)
class DeathSignal:
    """What ``mark_dead`` stamped."""

    key: str
    #: Every attempt with a fence up to this one is asserted dead.
    fence: int
    by: str
    reason: str
    at: float
    #: The signs of life the operator overrode (``--override-heartbeat``); empty if none.
    overridden: tuple[str, ...] = ()


def grace_for(row: Any, *, grace_seconds: float, lease_seconds: float) -> float:
    """The grace window for ``row``: ``grace_seconds`` is set for the global lease
    (``lease_seconds``; two leases by default), and a task with a longer lease of its own
    (``row.lease_seconds``) renews less often, so its window grows in proportion. It never
    shrinks below ``grace_seconds``."""
    return scaled_grace(row.lease_seconds, grace_seconds=grace_seconds, lease_seconds=lease_seconds)


def scaled_grace(own: float | None, *, grace_seconds: float, lease_seconds: float) -> float:
    """``grace_for`` of an attempt renewed under its own lease ``own`` (None: the global)."""
    if own is None or lease_seconds <= 0 or own <= lease_seconds:
        return grace_seconds
    return grace_seconds * own / lease_seconds


def last_sign_of_life(row: Any, lease_seconds: float) -> float | None:
    """The latest sign of life an entry row holds of its attempts: the last claim or renewal
    (``renewed_at``; for a row not renewed since ``0008_renewed_at``, a live lease less the
    lease), or a superseded attempt's refused write (``seen_alive_at``). None: none."""
    found = [t for t in (row.renewed_at, row.seen_alive_at) if t is not None]
    if row.renewed_at is None and row.lease_until is not None:
        found.append(row.lease_until - float(row.lease_seconds or lease_seconds))
    return max(found) if found else None


def signs_of_life(row: Any, now: float, *, grace_seconds: float, lease_seconds: float) -> list[str]:
    """What says the entry's old owner may still be alive, within the grace window of ``now``
    (``grace_for``).

    An attempt's last claim or lease renewal is ``renewed_at``, which the sweep's interrupt
    leaves as it is (it clears only the lease): an attempt paused mid-call and then
    interrupted is still a sign of life for the whole window. A row no attempt claimed or
    renewed since ``0008_renewed_at`` falls back to its live lease (``lease_until`` minus the
    task's lease, or the global one). A superseded attempt that tried to write left
    ``seen_alive_at``.
    """
    grace = grace_for(row, grace_seconds=grace_seconds, lease_seconds=lease_seconds)
    running = row.status == EntryStatus.RUNNING.value and row.lease_until is not None
    renewed = row.renewed_at
    if renewed is None and running:
        renewed = row.lease_until - (row.lease_seconds or lease_seconds)
    signs = []
    if renewed is not None and now - renewed < grace:
        live = running and row.lease_until > now
        signs.append(
            f"its owner {row.owner} renewed the lease {max(now - renewed, 0.0):.0f}s ago"
            + (" (the lease is live)" if live else f" (entry {row.status} since)")
        )
    if row.seen_alive_at is not None and now - row.seen_alive_at < grace:
        signs.append(
            f"the superseded attempt of fence {row.seen_alive_fence} on "
            f"{row.seen_alive_owner or 'an unknown worker'} tried to write "
            f"{max(now - row.seen_alive_at, 0.0):.0f}s ago"
        )
    return signs


def death_gate(conn: Any, row: Any) -> None:
    """Refuse a ``not-executed`` release of an ambiguous step that no ``mark-dead`` covers.

    ``row`` is the entry, read under its row lock in ``release``'s transaction.

    Raises:
        DeathSignalRequired: an ambiguous step (or body) was started by an attempt whose
            fence is above ``dead_fence`` (or nobody marked any attempt dead).
    """
    started, count = conn.execute(
        select(func.max(steps.c.fence), func.count()).where(
            steps.c.key == row.key, steps.c.status == StepStatus.STARTED.value
        )
    ).one()
    if count:
        needed, what = int(started), "its ambiguous step was started by the attempt of fence"
    else:
        has_rows = conn.execute(
            select(func.count()).select_from(steps).where(steps.c.key == row.key)
        ).scalar_one()
        if has_rows:
            return  # nothing ambiguous: releasing it lets nothing run twice
        needed, what = int(row.fence), "its body (no steps recorded) ran under fences up to"
    if row.dead_fence is not None and row.dead_fence >= needed:
        return
    have = (
        "no attempt of it is marked dead"
        if row.dead_fence is None
        else f"mark-dead covers fences up to {row.dead_fence} only"
    )
    raise DeathSignalRequired(
        f"{row.key}: a not-executed release needs a death signal: {what} {needed}, and {have} "
        "(ledger_release_requires_death_signal); assert the old worker dead with "
        "`mark-dead KEY --by WHO --reason WHY` first"
    )


#: The claims that run a step-less body (a first claim, and a re-run of a settled retry):
#: audited under these names (``claim_gates``). A ``takeover`` of a body that ran before asks
#: about it first, and runs it only after a verdict row, which names its own fence.
BODY_RUNNING_CLAIMS = ("claimed", "rerun")


@dataclass(frozen=True)
class BodyStarter:
    """The last attempt that may have run a step-less body, and its last sign of life."""

    fence: int
    #: When the attempt after it claimed the entry (a takeover, which needs its lease run
    #: out, so it renewed no later), or a later refused write of any superseded attempt.
    last_alive: float


class DeathSignals(StoreCore):
    """``mark_dead`` and ``record_seen_alive``: one transaction each; ``body_starter``."""

    def body_starter(self, key: str, fence: int) -> BodyStarter | None:
        """For ``key``'s body when it recorded no steps, the last attempt below ``fence``
        that may have run it (read-only; two index reads of its audit events).

        Every claim is audited with its fence. Only a first claim or a re-run runs a
        step-less body at once; a takeover of a body that ran before asks the reconciler and
        may wait out the death grace, and runs the body only once a verdict row names its
        fence (``Ambiguity``). So the attempts between the starter and ``fence`` only waited,
        and the starter's last renewal came before the first of them claimed. A superseded
        attempt's refused write (``seen_alive_at``) still counts, whoever made it.

        None: no such event is left (pruned), or no attempt claimed after the starter; the
        caller then keeps its own, earlier judgement.
        """
        with self._read() as conn:
            starter = conn.execute(
                select(func.max(events.c.fence)).where(
                    events.c.key == key,
                    events.c.event.in_(BODY_RUNNING_CLAIMS),
                    events.c.fence < fence,
                )
            ).scalar_one_or_none()
            if starter is None:
                return None
            after = conn.execute(
                select(func.min(events.c.at)).where(
                    events.c.key == key,
                    events.c.event == "takeover",
                    events.c.fence > starter,
                    events.c.fence < fence,
                )
            ).scalar_one_or_none()
            seen = conn.execute(
                select(entries.c.seen_alive_at).where(entries.c.key == key)
            ).scalar_one_or_none()
        if after is None:
            return None
        alive = max(float(after), float(seen)) if seen is not None else float(after)
        return BodyStarter(int(starter), alive)

    def mark_dead(
        self,
        key: str,
        *,
        by: str,
        reason: str,
        grace_seconds: float,
        lease_seconds: float,
        override_heartbeat: bool = False,
    ) -> DeathSignal:
        """Assert every attempt of ``key`` up to its current fence dead; audited.

        Atomic (one transaction, under the entry's row lock, so a renewal or a sign of life
        written concurrently is either seen here or comes after the stamp).

        Raises:
            EntryNotFound: no such key.
            MarkDeadRefused: the entry is completed, or its old owner showed a sign of life
                within the grace window (``grace_seconds`` for the global ``lease_seconds``,
                scaled to the task's own lease: ``grace_for``) and ``override_heartbeat`` is
                False.
            OperatorTextError: ``by`` or ``reason`` is blank, too long or not printable.
        """
        check_release_text(by, reason, action="mark-dead")
        with self._txn() as conn:
            row = conn.execute(
                select(entries, db_now().label("now")).where(entries.c.key == key).with_for_update()
            ).one_or_none()
            if row is None:
                raise EntryNotFound(f"no ledger entry with key {key}")
            if row.status == EntryStatus.COMPLETED.value:
                raise MarkDeadRefused(f"{key} is completed; no attempt of it can matter now")
            now = float(row.now)
            signs = signs_of_life(
                row, now, grace_seconds=grace_seconds, lease_seconds=lease_seconds
            )
            if signs and not override_heartbeat:
                grace = grace_for(row, grace_seconds=grace_seconds, lease_seconds=lease_seconds)
                raise MarkDeadRefused(
                    f"{key} not marked dead: {'; '.join(signs)} (grace "
                    f"{grace:.0f}s); stop that worker first, or give "
                    "--override-heartbeat if you know it is gone"
                )
            upd = (
                update(entries)
                .where(entries.c.key == key)
                .values(dead_fence=row.fence, dead_by=by, dead_reason=reason, dead_at=now)
                .returning(*sql.RETURNED)
            )
            detail = f"attempts up to fence {row.fence} asserted dead: {reason}" + (
                f" (overriding: {'; '.join(signs)})" if signs else ""
            )
            self._write_with_event(
                conn, sql.with_event(self.dialect, upd), {}, Note("marked-dead", by, detail)
            )
        return DeathSignal(key, int(row.fence), by, reason, now, tuple(signs))

    def record_seen_alive(self, key: str, fence: int, *, owner: str | None, what: str) -> bool:
        """Record that the attempt of ``fence`` tried to write after it was superseded.

        One transaction; the entry's row is written only while its fence is above ``fence``
        (so a current attempt never marks itself). Audited as ``seen-alive``. Returns False
        when nothing was recorded (no such entry, or ``fence`` is current).
        """
        owner = (owner or "")[:MAX_OWNER_CHARS] or None
        with self._txn() as conn:
            upd = (
                update(entries)
                .where(entries.c.key == key, entries.c.fence > fence)
                .values(seen_alive_at=db_now(), seen_alive_fence=fence, seen_alive_owner=owner)
                .returning(*sql.RETURNED)
            )
            note = Note(
                "seen-alive",
                owner,
                f"the superseded attempt of fence {fence} tried to write: {what}",
            )
            rows = self._write_with_event(conn, sql.with_event(self.dialect, upd), {}, note)
        return bool(rows)

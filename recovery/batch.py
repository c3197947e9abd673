"""The sweep's resume of a whole batch (design.md § "The sweep resumes in batches").

``resume_batch`` does what ``resume_entry`` does for each entry of a batch, in bulk: one read of
the snapshots, one statement and one commit for every compare-and-set, and the re-sends over one
producer (``recovery.publish.Batch``). Each entry keeps its own outcome and its own containment.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from celery_ledger.ledger import (
    ArgumentSnapshot,
    EntryStatus,
    Interrupted,
    LedgerUnavailable,
    Resuming,
    SnapshotCipher,
    SnapshotSealError,
)
from celery_ledger.recovery.backlog import QueueDepths, backoff_lease
from celery_ledger.recovery.handoff import (
    ResumeOutcome,
    UnreadableSnapshot,
    park_unreadable,
    read_snapshot,
)
from celery_ledger.recovery.ports import Publisher, ResumeStore
from celery_ledger.recovery.publish import Batch
from celery_ledger.recovery.resend import send_on
from celery_ledger.recovery.resume import (
    contained,
    log_not_here,
    log_resumed,
    log_unsent,
    resume_entry,
    screen,
    unreadable_reason,
)

#: The sweep's logger (``recovery.resume``).
log = logging.getLogger("celery_ledger.recovery.sweep")

#: Re-sends written per broker round trip where kombu can buffer them (Redis). A flush that
#: fails costs at most this many entries their resume until their lease lapses.
SEND_CHUNK = 100

#: What each entry of a batch came to, by its index in the batch (None: it failed alone).
Outcomes = dict[int, ResumeOutcome | None]


def resume_batch(
    store: ResumeStore,
    app: Publisher,
    batch: Sequence[Interrupted],
    *,
    lease_seconds: float,
    max_resumes: int,
    actor: str = "sweep",
    cipher: SnapshotCipher | None = None,
) -> list[ResumeOutcome | None]:
    """``resume_entry`` for each of ``batch``, in bulk: one read of the snapshots, one
    statement and one commit for every compare-and-set, and the re-sends over one producer.

    Each entry keeps its own outcome, as ``resume_entry`` would give it, and its own
    containment: an entry that raises is logged and gets None, and the others go on. If a
    bulk step fails for a reason other than an unavailable ledger, its entries are resumed
    one at a time instead, so one bad entry never costs the batch its resume.

    Raises:
        LedgerUnavailable: the ledger went away; the next sweep does the rest.
    """
    run = _BatchResume(store, app, batch, lease_seconds, max_resumes, actor, cipher)
    run.resume()
    return [run.outcomes[i] for i in range(len(batch))]


class _BatchResume:
    """One ``resume_batch``: its phases, each filling ``outcomes`` (by index in the batch)."""

    def __init__(
        self,
        store: ResumeStore,
        app: Publisher,
        batch: Sequence[Interrupted],
        lease_seconds: float,
        max_resumes: int,
        actor: str,
        cipher: SnapshotCipher | None,
    ) -> None:
        self.store = store
        self.app = app
        self.batch = batch
        self.lease_seconds = lease_seconds
        self.max_resumes = max_resumes
        self.actor = actor
        self.cipher = cipher
        self.outcomes: Outcomes = {}

    def resume(self) -> None:
        ready = self._screen()
        # Decode before the resume begins (see resume_entry), all snapshots in one read.
        try:
            stored = self.store.snapshots_at([self.batch[i].key for i in ready])
        except LedgerUnavailable:
            raise
        except Exception:
            log.exception("sweep could not read %d snapshots at once; one at a time", len(ready))
            self._one_by_one(ready)
            return
        decoded = self._decode(ready, stored)
        # Every CAS at the fence its snapshot was read at, one statement and one commit per
        # group of the same lease (entries no attempt claimed back off: ``recovery.backlog``).
        groups = _plan(self.store, self.app, self.batch, decoded, self.lease_seconds)
        won = self._begin(groups, decoded)
        if won is None:
            return
        self._defer(groups, won, decoded)
        sends = [(i, snapshot, won.get(self.batch[i].key)) for i, snapshot in decoded.items()]
        with Batch(self.app) as sender:
            for start in range(0, len(sends), SEND_CHUNK):
                _send_chunk(
                    sender,
                    self.batch,
                    sends[start : start + SEND_CHUNK],
                    self.outcomes,
                    self.lease_seconds,
                )

    def _screen(self) -> list[int]:
        """The crash-loop and no-snapshot screen (``resume.screen``), per entry, contained;
        returns the indexes of the entries to resume."""
        ready: list[int] = []
        for i, entry in enumerate(self.batch):
            try:
                screened = screen(self.store, entry, max_resumes=self.max_resumes, actor=self.actor)
            except LedgerUnavailable:
                raise
            except Exception:
                log.exception("sweep could not resume key=%s; the sweep goes on", entry.key)
                self.outcomes[i] = None
                continue
            if screened is None:
                ready.append(i)
            else:
                self.outcomes[i] = screened
        return ready

    def _one_by_one(self, which: Sequence[int]) -> None:
        """``resume_entry`` for each of ``which``: the fallback when a bulk step failed."""
        for i in which:
            self.outcomes[i] = contained(
                self.batch[i].key,
                "resume",
                partial(
                    resume_entry,
                    self.store,
                    self.app,
                    self.batch[i],
                    lease_seconds=self.lease_seconds,
                    max_resumes=self.max_resumes,
                    actor=self.actor,
                    cipher=self.cipher,
                ),
            )

    def _decode(
        self, ready: Sequence[int], stored: dict[str, tuple[int, EntryStatus, str | None]]
    ) -> dict[int, ArgumentSnapshot]:
        """The snapshots of ``ready`` read at their fences; an entry that moved on is a lost
        race, one this process cannot unseal waits for one that can, one no process can read
        is parked (contained)."""
        decoded: dict[int, ArgumentSnapshot] = {}
        for i in ready:
            entry = self.batch[i]
            found = stored.get(entry.key)
            if (
                found is None
                or found[0] != entry.fence
                or found[1] is not EntryStatus.INTERRUPTED
                or found[2] is None
            ):
                self.outcomes[i] = ResumeOutcome.LOST_RACE
                continue
            try:
                decoded[i] = read_snapshot(found[2], self.cipher)
            except SnapshotSealError as exc:
                log_not_here(entry.key, entry.fence, exc)
                self.outcomes[i] = ResumeOutcome.LOST_RACE
            except UnreadableSnapshot as exc:
                self.outcomes[i] = contained(
                    entry.key,
                    "park",
                    partial(
                        park_unreadable,
                        self.store,
                        entry.key,
                        entry.task_id,
                        entry.fence,
                        unreadable_reason(exc),
                        status=EntryStatus.INTERRUPTED,
                        actor=self.actor,
                    ),
                )
        return decoded

    def _begin(
        self, groups: dict[tuple[float, bool], list[int]], decoded: dict[int, ArgumentSnapshot]
    ) -> dict[str, Resuming] | None:
        """The compare-and-sets, one statement per group; the resumes won, or None when a
        statement failed and the rest was resumed one at a time."""
        won: dict[str, Resuming] = {}
        try:
            for (lease, deferred), members in groups.items():
                won.update(
                    self.store.begin_resume_many(
                        [(self.batch[i].key, self.batch[i].fence) for i in members],
                        lease_seconds=lease,
                        actor=self.actor,
                        event="deferred" if deferred else "resuming",
                        detail=f"its queue holds messages; not re-sent for {lease:.0f}s"
                        if deferred
                        else None,
                    )
                )
        except LedgerUnavailable:
            raise
        except Exception:
            log.exception("sweep could not begin %d resumes at once; one at a time", len(decoded))
            self._one_by_one([i for i in decoded if self.batch[i].key not in won])
            return None
        return won

    def _defer(
        self,
        groups: dict[tuple[float, bool], list[int]],
        won: dict[str, Resuming],
        decoded: dict[int, ArgumentSnapshot],
    ) -> None:
        """The deferred groups' outcomes: their leases are taken and nothing is sent (they
        leave ``decoded``)."""
        for (lease, deferred), members in groups.items():
            if not deferred:
                continue
            for i in members:
                entry = self.batch[i]
                taken = entry.key in won
                self.outcomes[i] = ResumeOutcome.DEFERRED if taken else ResumeOutcome.LOST_RACE
                decoded.pop(i)
                if taken:
                    log.info(
                        "deferred key=%s task_id=%s: no worker claimed it yet and its queue "
                        "holds messages; not re-sent for %.0fs",
                        entry.key,
                        entry.task_id,
                        lease,
                    )


def _plan(
    store: ResumeStore,
    app: Publisher,
    batch: Sequence[Interrupted],
    decoded: dict[int, ArgumentSnapshot],
    lease_seconds: float,
) -> dict[tuple[float, bool], list[int]]:
    """The resumes to begin, grouped by (lease, deferred): an entry a worker claimed before
    is re-sent under ``lease_seconds``; one no attempt ever claimed backs off with how long it
    has waited, and is deferred (its lease taken, nothing sent) while its queue holds messages
    (``recovery.backlog``)."""
    groups: dict[tuple[float, bool], list[int]] = {}
    fresh = [i for i in decoded if batch[i].executions == 0 and batch[i].created_at is not None]
    now = store.now() if fresh else 0.0
    depths = QueueDepths(app)
    for i in decoded:
        entry = batch[i]
        if i not in fresh:
            groups.setdefault((lease_seconds, False), []).append(i)
            continue
        assert entry.created_at is not None
        lease = backoff_lease(lease_seconds, now - entry.created_at)
        waiting = depths.of(decoded[i].queue)
        groups.setdefault((lease, bool(waiting)), []).append(i)
    return groups


def _send_chunk(
    sender: Batch,
    batch: Sequence[Interrupted],
    sends: Sequence[tuple[int, ArgumentSnapshot, Resuming | None]],
    outcomes: Outcomes,
    lease_seconds: float,
) -> None:
    """Re-send one chunk of won resumes and record each one's outcome.

    A send that raises is that entry's LOST_RACE (logged; its lease brings it back). Where
    sends are buffered (Redis), none counts as sent before the flush succeeds: a failed flush
    makes every entry of the chunk a LOST_RACE (their re-sends may or may not be on the broker;
    either way the next sweep finds the entry running under the resume marker, or claimed).
    """
    queued: list[tuple[int, Resuming]] = []
    for i, snapshot, won in sends:
        if won is None:
            outcomes[i] = ResumeOutcome.LOST_RACE
            continue
        try:
            send_on(sender, won.task_name, won.task_id, snapshot, deadline_at=won.deadline_at)
        except Exception as exc:  # noqa: BLE001 - this entry alone; the lease brings it back
            log_unsent(batch[i], won, exc, lease_seconds)
            outcomes[i] = ResumeOutcome.LOST_RACE
            continue
        if sender.deferred:
            queued.append((i, won))
        else:  # unbuffered (RabbitMQ confirms each publish): the broker has it already
            _report_resumed(batch, [(i, won)], outcomes)
    try:
        sender.flush()
    except Exception as exc:  # noqa: BLE001 - the chunk's leases bring it back
        for i, won in queued:
            log_unsent(batch[i], won, exc, lease_seconds)
            outcomes[i] = ResumeOutcome.LOST_RACE
        return
    _report_resumed(batch, queued, outcomes)


def _report_resumed(
    batch: Sequence[Interrupted],
    queued: Sequence[tuple[int, Resuming]],
    outcomes: Outcomes,
) -> None:
    for i, won in queued:
        log_resumed(batch[i], won)
        outcomes[i] = ResumeOutcome.RESUMED

"""Named crash points for fault tests (DBOS's debug triggers, for processes).

Enabled only by ``CELERY_LEDGER_CRASH_AT`` (read once into the settings); with it unset a
crash point is one frozenset lookup. Names:

- ``step-started:<step>``   after the step's ``started`` row is durable, before its body
- ``step-ref:<step>``      after ``record_external_ref`` stored the step's provider handle
- ``step-returned:<step>``  after its body returned, before ``completed`` is written (the
  effect happened, the ledger does not know: the window DBOS re-executes)
- ``step-completed:<step>`` after its ``completed`` row is durable
- ``before-settle``         after the body returned, before the settle
- ``after-claim``           after the claim, before the body
- ``after-settle``          after the settle (and the links it recorded: the next chain
  link, the callbacks) committed, before they are published
- ``chord-unlock``          as Celery's ``celery.chord_unlock`` (the chord join of database
  result backends) starts; ``chord-unlock:retry`` as one of its retries (a later poll) starts
- ``after-publish``         after the links were published and marked, before Celery stores
  the result (and counts a chord member) and the message is acked
- ``txn-written:<step>``    inside a transaction step: its block returned, its writes are
  made but nothing is committed (the step's row is the next statement)
- ``children-published:<step>`` after the children a step sent were published, before
  they are marked published (``step-completed:<step>`` is after the commit, before the
  publish)

A point may end with ``@worker`` to kill the whole worker (the pool's parent too) instead of
only the process running the body, or with ``@stop`` to SIGSTOP the process running the body
instead of killing it (a paused attempt, for fencing tests; its marker file holds its pid).
``CELERY_LEDGER_CRASH_ONCE=<file>`` makes each point fire
once: the first process to create the marker file for that point dies, later ones go on.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from celery_ledger.settings import LedgerSettings


def crash_point(settings: LedgerSettings, name: str) -> None:
    """SIGKILL this process (or its worker) if ``name`` is an enabled crash point."""
    if not settings.crash_points:
        return
    whole_worker = f"{name}@worker" in settings.crash_points
    stop = f"{name}@stop" in settings.crash_points
    if not whole_worker and not stop and name not in settings.crash_points:
        return
    if settings.crash_once_file:
        marker = Path(f"{settings.crash_once_file}.{name.replace(':', '_')}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if whole_worker:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

"""The one retry loop for a fenced write the ledger could not take: back off, try again, give up
at a deadline.

Every fenced write an attempt makes (step rows, reconciled verdicts, the external reference,
settle) goes through it (``Attempt``). Retrying is safe because no write lands twice: a step
row is an upsert, and a completion or settle whose reply was lost makes its own repeat a
refusal (the attempt then stops as superseded, and what it wrote stands). Giving up is safe
because the caller leaves the entry running: its lease expires, the sweep interrupts it, and
the resume replays what completed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from celery_ledger.ledger import LedgerUnavailable

T = TypeVar("T")


def retry_while_unavailable(
    write: Callable[[], T],
    *,
    seconds: float,
    first_delay: float,
    max_delay: float,
    on_retry: Callable[[LedgerUnavailable, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Return ``write()``, calling it again while it raises ``LedgerUnavailable``.

    The pause starts at ``first_delay`` and doubles up to ``max_delay``. A retry whose pause
    would end past ``seconds`` from the first call is not made: at most ``seconds`` are spent
    waiting. ``on_retry(exc, delay)`` is called before each pause.

    Raises:
        LedgerUnavailable: the last failure, once the deadline leaves no room for another try.
    """
    deadline = clock() + seconds
    delay = first_delay
    while True:
        try:
            return write()
        except LedgerUnavailable as exc:
            if clock() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
            sleep(delay)
            delay = min(delay * 2, max_delay)

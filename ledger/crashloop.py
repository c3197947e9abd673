"""The crash-loop rule: when an entry that keeps losing its attempts is parked, not run again.

A task whose body kills its process (a segfault in a C extension, an OOM on one input) would
otherwise be resumed forever, taking a pool process down each time. Two paths can find such an
entry: the claim of its next delivery (``HotPath.claim`` counts the attempt it takes over from)
and the sweep that would resume it (``SweepQueries.block_crash_loop``). Both ask
``crash_loop_reason``, so the threshold and the reason an operator reads are decided here only.
"""

from __future__ import annotations

from dataclasses import dataclass


def crash_loop_reason(interruptions: int, max_resumes: int) -> str | None:
    """Why an entry interrupted ``interruptions`` times must be blocked, or None if it may run.

    ``max_resumes`` is ``ledger_max_resumes``: that many interruptions are resumed, one more
    is a crash loop.
    """
    if interruptions <= max_resumes:
        return None
    return f"crash loop: interrupted {interruptions} times (ledger_max_resumes={max_resumes})"


@dataclass(frozen=True)
class CrashLoop:
    """What ``block_crash_loop`` found: an entry the rule says is a crash loop."""

    #: The reason written on the entry (``crash_loop_reason``).
    reason: str
    #: Whether this call parked it; False when another sweeper or a claim moved it first.
    blocked: bool

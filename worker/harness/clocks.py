"""A wall clock off by a fixed number of seconds, in one child process only.

A worker or beat started with ``skewed(30.0)`` in its environment imports
``skewed_clock/sitecustomize.py`` at start-up (Python imports ``sitecustomize`` from
``PYTHONPATH``), which shifts ``time.time`` and ``time.time_ns`` by the offset: a host whose
clock drifted. ``datetime.now`` reads the system clock in C and stays right: replacing the
``datetime`` class breaks pickling (beat's schedule file) and C extensions that check its
size. The monotonic clock is left alone, as NTP leaves it. The ledger must not care: leases
are judged by the database's clock (docs/design.md § "Storage"; ``tests/test_fleet_clocks.py``).
"""

from __future__ import annotations

from pathlib import Path

#: The offset, in seconds (may be negative), read by the ``sitecustomize`` below.
SKEW_ENV = "CELERY_LEDGER_HARNESS_CLOCK_SKEW"
#: The directory to put on ``PYTHONPATH``: it holds only that ``sitecustomize.py``.
SITE_DIR = Path(__file__).resolve().parent / "skewed_clock"


def skewed(seconds: float) -> dict[str, str]:
    """Environment for a child process whose wall clock is ``seconds`` off."""
    return {SKEW_ENV: repr(float(seconds)), "PYTHONPATH": str(SITE_DIR)}

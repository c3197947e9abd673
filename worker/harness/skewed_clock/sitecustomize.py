"""Shift this process's wall clock by ``CELERY_LEDGER_HARNESS_CLOCK_SKEW`` seconds (see
``celery_ledger.harness.clocks``). Imported by Python at start-up; does nothing without it."""

from __future__ import annotations

import os


def _install(offset: float) -> None:
    import time as _time

    real_time, real_time_ns = _time.time, _time.time_ns

    def time() -> float:
        return real_time() + offset

    def time_ns() -> int:
        return real_time_ns() + int(offset * 1e9)

    _time.time = time
    _time.time_ns = time_ns


_skew = os.environ.get("CELERY_LEDGER_HARNESS_CLOCK_SKEW")
if _skew:
    _install(float(_skew))

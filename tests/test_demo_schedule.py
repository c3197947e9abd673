"""The demo's crash schedule (``celery_ledger.harness.demo.DemoRun``) on a slow host, driven by
a simulated clock and a simulated workload: which moment it picks to SIGKILL the worker.

This proves the schedule's logic only; the real workers, kills and counts are in
``tests/test_demo.py``. CI on a slow host once saw the schedule skip both kills: the two pool
processes ran their orders half a gap out of phase, so no poll ever found every order in
flight just past an effect, and the run finished before the 10 s fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from celery_ledger.harness import demo
from celery_ledger.harness.demo_app import EffectsSnapshot, OrderEffects

EFFECTS = ("quote", "reserve", "charge", "receipt")
GAP = 0.25


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeWorker:
    clock: Clock
    pid: int = 100
    kills: list[float] = field(default_factory=list)

    def kill(self) -> None:
        self.kills.append(self.clock.now)

    def is_ready(self) -> bool:
        return True

    def children(self) -> set[int]:
        return {1, 2}

    def kill_child(self, pid: int) -> bool:
        self.kills.append(self.clock.now)
        return True


@dataclass
class Report:
    crashes: list[str] = field(default_factory=list)


class Workload:
    """``orders`` orders on two pool processes, each running its orders back to back: four
    effects ``GAP`` apart, then the next order. The second process runs half a gap behind the
    first, so at no moment are both orders just past an effect."""

    concurrency = 2

    def __init__(self, clock: Clock, orders: int) -> None:
        self.clock = clock
        self.start = clock.now
        self.order_ids = [f"o-{i:04d}" for i in range(orders)]
        self.workers = {"w": FakeWorker(clock)}
        self.report = Report()

    def _timeline(self) -> dict[str, dict[str, float]]:
        at: dict[str, dict[str, float]] = {}
        for i, order_id in enumerate(self.order_ids):
            process, turn = i % 2, i // 2
            begin = self.start + process * GAP / 2 + turn * len(EFFECTS) * GAP
            at[order_id] = {e: begin + n * GAP for n, e in enumerate(EFFECTS)}
        return at

    def finished_at(self) -> float:
        return max(max(times.values()) for times in self._timeline().values())

    def refresh(self) -> EffectsSnapshot:
        orders = {}
        for order_id, times in self._timeline().items():
            done = {e: t for e, t in times.items() if t <= self.clock.now}
            if done:
                orders[order_id] = OrderEffects(
                    counts=dict.fromkeys(done, 1), pids=dict.fromkeys(done, 1), at=done
                )
        return EffectsSnapshot(orders, sum(len(o.at) for o in orders.values()), None)

    def restart(self, name: str) -> None:
        pass

    def mark_progress(self) -> None:
        pass


@pytest.mark.parametrize("orders", [8, 16, 40])
def test_the_worker_is_killed_while_orders_are_in_flight(
    monkeypatch: pytest.MonkeyPatch, orders: int
) -> None:
    clock = Clock()
    monkeypatch.setattr(demo, "time", clock)
    work = Workload(clock, orders)
    run = demo.DemoRun(work, GAP)  # type: ignore[arg-type]
    # A slow host: each poll lands 0.15 s after an effect of the first process, 0.025 s after
    # one of the second (the queries and the other runs' polls take the rest of the period).
    clock.now += 0.15
    for _ in range(400):
        if run.tick():
            break
        clock.sleep(GAP)
    crashes: list[Any] = work.report.crashes
    assert crashes and crashes[0].startswith("SIGKILL whole worker"), crashes
    assert work.workers["w"].kills[0] < work.finished_at(), (work.workers["w"].kills, crashes)
    assert crashes[-1].startswith("SIGKILL pool process"), crashes

"""Tasks for the process tests of durable time (design.md § "Durable time"), registered on
``tests_app``'s app.

A worker loads them with ``celery -A tests_app worker -I time_app`` (``TIME_TASKS``); a test's
producer registers the same names on its own ledger app (``register``), since only a
``LedgerTask`` class can hold a long countdown in the ledger. Every effect goes through
``tests_app.effect`` (one row per call).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from celery_ledger import LedgerTask, Reconciled, SignalTimeout
from helpers import effect_counts
from tests_app import app, effect

#: Worker option that imports this module.
TIME_TASKS = ["-I", "time_app"]


def _ran(step: Any) -> Reconciled:
    """The effects table is the provider: a ``run`` row for the tag proves the step ran."""
    tag = step.args[0]
    if effect_counts(os.environ["TEST_EFFECTS_URL"], tag).get((tag, "run")):
        return Reconciled.completed(f"run:{tag}", note="effect row found")
    return Reconciled.not_executed("no effect row")


def _charged(step: Any) -> Reconciled:
    tag = step.args[0]
    if effect_counts(os.environ["TEST_EFFECTS_URL"], tag).get((tag, "charge")):
        return Reconciled.completed(f"charge:{tag}", note="effect row found")
    return Reconciled.not_executed("no effect row")


def register(target: Any) -> dict[str, Any]:
    """Register the durable-time test tasks on ``target``; returns them by short name."""

    # A SIGKILL between the step's start and its completion leaves it ambiguous: the
    # reconciler asks the effects table, so the test can demand exactly once.
    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.once", reconciler=_ran)
    def once(self: LedgerTask, tag: str, pause: float = 0.0) -> str:
        done = self.step("run", effect, tag, "run")
        time.sleep(pause)
        return done

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.sleeper")
    def sleeper(self: LedgerTask, tag: str, seconds: float) -> list[str]:
        before = self.step("before", effect, tag, "before")
        self.sleep(seconds)
        after = self.step("after", effect, tag, "after")
        return [before, after]

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.waiter")
    def waiter(self: LedgerTask, tag: str, timeout: float) -> list[Any]:
        """Step ``before``, wait for signal ``approved``, step ``after`` (design.md §
        "Durable signals")."""
        before = self.step("before", effect, tag, "before")
        payload = self.wait_for("approved", timeout=timeout)
        return [before, payload, self.step("after", effect, tag, "after")]

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.waits_twice")
    def waits_twice(self: LedgerTask, tag: str, marker: str, second_timeout: float) -> list[Any]:
        """Wait (bounded) for ``marker`` inside step ``s0`` (a signal sent meanwhile comes
        before the wait), then wait for ``go`` twice: the second needs a signal of its own."""

        def gate() -> str:
            deadline = time.monotonic() + 60.0
            while not Path(marker).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            return effect(tag, "s0")

        first = self.step("s0", gate)
        got = self.wait_for("go", timeout=60.0)
        try:
            again = self.wait_for("go", timeout=second_timeout)
        except SignalTimeout:
            again = "timeout"
        return [first, got, again, self.step("s1", effect, tag, "s1")]

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.gated")
    def gated(self: LedgerTask, tag: str, marker: str, limit: float = 60.0) -> list[str]:
        """Step ``s0``, then wait (bounded) for ``marker`` to exist, then step ``s1``."""
        first = self.step("s0", effect, tag, "s0")
        deadline = time.monotonic() + limit
        while not Path(marker).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return [first, self.step("s1", effect, tag, "s1")]

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.retry_far", max_retries=2)
    def retry_far(self: LedgerTask, tag: str, countdown: float) -> list[str]:
        charged = self.step("charge", effect, tag, "charge")
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return [charged, self.step("email", effect, tag, "email")]

    # The provider forgets a key at once: any ambiguous charge is past its window.
    @target.task(
        shared=False,
        base=LedgerTask,
        bind=True,
        name="time_app.keyed_charge",
        side_effect="keyed",
        provider_key_ttl=0.001,
        reconciler=_charged,
    )
    def keyed_charge(self: LedgerTask, tag: str) -> list[str]:
        return [
            self.step("charge", effect, tag, "charge"),
            self.step("receipt", effect, tag, "receipt"),
        ]

    # Records no steps, so the body is the keyed effect; its provider forgets a key after a
    # second. ``pause`` after the effect puts a crash at ``before-settle`` past that window.
    @target.task(
        shared=False,
        base=LedgerTask,
        bind=True,
        name="time_app.keyed_bare",
        side_effect="keyed",
        provider_key_ttl=1.0,
    )
    def keyed_bare(self: LedgerTask, tag: str, pause: float = 0.0) -> str:
        done = effect(tag, "bare")
        time.sleep(pause)
        return done

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.fails")
    def fails(self: LedgerTask, tag: str) -> None:
        self.step("run", effect, tag, "run")
        raise ValueError(f"{tag} failed")

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.bare")
    def bare(self: LedgerTask, tag: str) -> str:
        """Records no steps: the body is the effect."""
        return effect(tag, "bare")

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.bare_retry_far")
    def bare_retry_far(self: LedgerTask, tag: str, countdown: float) -> str:
        """Records no steps (its body is the effect, ``non_idempotent``): runs, retries once
        with ``countdown`` (held by the ledger when long), runs again and returns."""
        done = effect(tag, "body")
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return done

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.quiet_retry")
    def quiet_retry(self: LedgerTask, tag: str, countdown: float, raise_it: bool = False) -> str:
        """``retry(throw=False)``: Celery publishes the retry and the body goes on (or, with
        ``raise_it``, raises the ``Retry`` it returned)."""
        retry = self.retry(countdown=countdown, throw=False)
        if raise_it:
            raise retry
        return effect(tag, "body")

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.retry_soon")
    def retry_soon(self: LedgerTask, tag: str, countdown: float) -> str:
        """Retries once with a short ``countdown`` (published as Celery does), then returns."""
        done = effect(tag, "body")
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return done

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.soon", deadline=1.0)
    def soon(self: LedgerTask, tag: str) -> str:
        """Must start its effect within a second of being published (``deadline``)."""
        return self.step("run", effect, tag, "run")

    @target.task(shared=False, base=LedgerTask, bind=True, name="time_app.sleep_naive")
    def sleep_naive(self: LedgerTask, tag: str, seconds: float) -> str:
        """``wait_until`` a naive datetime: UTC, as Celery reads a naive ``eta``."""
        utc_wall = datetime.now(timezone.utc).replace(tzinfo=None)
        self.wait_until(utc_wall + timedelta(seconds=seconds))
        return self.step("run", effect, tag, "run")

    return {
        "sleep_naive": sleep_naive,
        "soon": soon,
        "bare": bare,
        "bare_retry_far": bare_retry_far,
        "quiet_retry": quiet_retry,
        "retry_soon": retry_soon,
        "keyed_charge": keyed_charge,
        "keyed_bare": keyed_bare,
        "fails": fails,
        "once": once,
        "sleeper": sleeper,
        "gated": gated,
        "retry_far": retry_far,
    }


TASKS = register(app)

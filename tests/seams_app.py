"""Tasks for the seams tests (design.md § "One envelope, one admission gate"), registered on
``tests_app``'s app.

A worker loads them with ``celery -A tests_app worker -I seams_app`` (``SEAMS_TASKS``); a test's
producer registers the same names on its own ledger app (``register``), since only a
``LedgerTask`` class records a publish intent or holds a countdown. Every effect goes through
``tests_app.effect`` (one row per call).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery_ledger import LedgerTask, Reconciled
from helpers import effect_counts
from tests_app import app, effect

#: Worker option that imports this module.
SEAMS_TASKS = ["-I", "seams_app"]


def _provider_charged(step: Any) -> Reconciled:
    """Asks the provider (the effects table) whether the charge of ``step``'s order happened."""
    tag = step.args[0]
    if effect_counts(os.environ["TEST_EFFECTS_URL"], tag).get((tag, "charge")):
        return Reconciled.completed(f"charge:{tag}", note="the provider shows the charge")
    return Reconciled.not_executed("the provider shows no charge")


def register(target: Any) -> dict[str, Any]:
    """Register the seams tasks on ``target``; returns them by short name."""

    @target.task(shared=False, base=LedgerTask, bind=True, name="seams_app.echo")
    def echo(self: LedgerTask, tag: str) -> dict[str, Any]:
        """Its effect, then what the message it was delivered in carried."""
        effect(tag, "echo")
        req = self.request
        return {
            "tenant": (req.headers or {}).get("tenant"),
            "priority": (req.delivery_info or {}).get("priority"),
            "timelimit": list(req.timelimit or ()),
            "retries": req.retries,
            "expires": None if req.expires is None else str(req.expires),
        }

    @target.task(shared=False, base=LedgerTask, bind=True, name="seams_app.retry_gated")
    def retry_gated(self: LedgerTask, tag: str, marker: str, limit: float = 60.0) -> str:
        """Stepless. First delivery: wait (bounded) for ``marker``, then retry soon (a
        countdown Celery publishes). The retry's delivery performs the effect."""
        if self.request.retries == 0:
            Path(f"{marker}.started").touch()
            deadline = time.monotonic() + limit
            while not Path(marker).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise self.retry(countdown=0.5)
        return effect(tag, "run")

    @target.task(shared=False, base=LedgerTask, bind=True, name="seams_app.bare")
    def bare(self: LedgerTask, tag: str) -> str:
        """Records no steps: the body is the effect."""
        return effect(tag, "bare")

    @target.task(shared=False, base=LedgerTask, bind=True, name="seams_app.sleepy")
    def sleepy(self: LedgerTask, tag: str, seconds: float) -> str:
        """Stepless: the effect, then a long sleep that keeps its pool process busy."""
        effect(tag, "sleepy")
        time.sleep(seconds)
        return tag

    @target.task(
        shared=False,
        base=LedgerTask,
        bind=True,
        name="seams_app.paused_charge",
        key_from=("order_id",),
        reconciler=_provider_charged,
    )
    def paused_charge(self: LedgerTask, order_id: str, seconds: float) -> str:
        """One effect step whose provider call takes ``seconds``: a pause inside it leaves
        the call in flight, and the reconciler asks the provider."""

        def charge() -> str:
            time.sleep(seconds)
            return effect(order_id, "charge")

        return self.step("charge", charge)

    @target.task(
        shared=False,
        base=LedgerTask,
        bind=True,
        name="seams_app.stepless_charge",
        key_from=("order_id",),
        reconciler=_provider_charged,
    )
    def stepless_charge(self: LedgerTask, order_id: str, marker: str) -> str:
        """Records no steps: the body is the charge. The first run waits (bounded) for
        ``marker`` before it charges, so a test can kill its worker with nothing charged."""
        if not Path(f"{marker}.ran").exists():
            Path(f"{marker}.ran").touch()
            deadline = time.monotonic() + 120.0
            while not Path(marker).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return effect(order_id, "charge")

    return {
        "echo": echo,
        "retry_gated": retry_gated,
        "bare": bare,
        "sleepy": sleepy,
        "paused_charge": paused_charge,
        "stepless_charge": stepless_charge,
    }


TASKS = register(app)

"""Tasks for the failing-first tests of the hardening faults (guarantees.md
§ "The hardening faults"), registered on ``tests_app``'s app.

A worker loads them with ``celery -A tests_app worker -I faults_app`` (``FAULT_TASKS`` below is
that option). Every effect goes through ``tests_app.effect``: one row in ``test_effects`` per
call, so a duplicate shows up as a count of 2.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery_ledger import LedgerTask, Reconciled
from tests_app import app, effect

#: Worker option that imports this module.
FAULT_TASKS = ["-I", "faults_app"]


# -- fault 6: step identity drift ------------------------------------------------------------


def charge_at(order_id: str, ts: float) -> dict[str, Any]:
    """A charge whose input carries a timestamp (a value read outside any step)."""
    effect(order_id, "charge")
    return {"order_id": order_id, "ts": ts}


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.drift_charge")
def drift_charge(self: LedgerTask, order_id: str, declared: bool = False) -> dict[str, Any]:
    ts = time.time()  # read outside any step: a different value on every attempt
    # The proposed declaration (guarantees.md § "The hardening faults", fault 6): the arguments of
    # ``charge_at`` that identify the step; the others (``ts``) may change between attempts.
    options: dict[str, Any] = {"identify": ("order_id",)} if declared else {}
    charged = self.step("charge", charge_at, order_id, ts, **options)
    receipt = self.step("receipt", effect, order_id, "receipt")
    return {"charge": charged, "receipt": receipt}


def ship(order_id: str, item: str) -> str:
    effect(f"{order_id}:{item}", "ship")
    return f"shipped:{item}"


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.ship_items")
def ship_items(
    self: LedgerTask, order_id: str, items: list[str], marker: str, declared: bool = False
) -> list[str]:
    """Ships each item in a step. The items come from outside the steps: the first attempt
    sees them in the given order, every later attempt in reverse (``marker`` tells them apart)."""
    flip = Path(marker)
    ordered = list(reversed(items)) if flip.exists() else list(items)
    flip.touch()
    options: dict[str, Any] = {"identify": ("item",)} if declared else {}
    return [self.step("ship", ship, order_id, item, **options) for item in ordered]


# -- fault 3: a retry whose message is lost --------------------------------------------------


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.retry_later", max_retries=3)
def retry_later(self: LedgerTask, tag: str, countdown: float) -> list[str]:
    charged = self.step("charge", effect, tag, "charge")
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return [charged, self.step("email", effect, tag, "email")]


# -- fault 8: record_external_ref in a step that has no intent row ----------------------------


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="faults_app.ref_idempotent",
    side_effect="idempotent",
)
def ref_idempotent(self: LedgerTask, tag: str) -> str:
    def call() -> str:
        self.record_external_ref(f"ref-{tag}")
        return effect(tag, "call")

    return str(self.step("call", call))


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.ref_read_step")
def ref_read_step(self: LedgerTask, tag: str) -> str:
    def look() -> str:
        self.record_external_ref(f"ref-{tag}")
        return effect(tag, "look")

    return str(self.step("look", look, effect=False))


# -- fault 11: SystemExit / KeyboardInterrupt raised by the body ------------------------------


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.exit_once")
def exit_once(self: LedgerTask, tag: str, how: str, marker: str) -> list[str]:
    prepared = self.step("prepare", effect, tag, "prepare")
    if not os.path.exists(marker):
        Path(marker).touch()
        if how == "SystemExit":
            raise SystemExit(3)
        raise KeyboardInterrupt()
    return [prepared, self.step("finish", effect, tag, "finish")]


# -- hostile inputs (faults 12, 13, 14) and the nested step (fault 15) ------------------------


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.echo")
def echo(self: LedgerTask, tag: str, value: Any) -> Any:
    effect(f"{tag}:{value}" if isinstance(value, int) else tag, "body")
    return value


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.retry_new_args", max_retries=3)
def retry_new_args(self: LedgerTask, tag: str, n: int) -> str:
    """A retry that legitimately changes the arguments under one task id."""
    if self.request.retries == 0:
        raise self.retry(args=(tag, n + 1), countdown=0.2)
    return str(self.step("charge", effect, f"{tag}:{n}", "charge"))


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.named_step")
def named_step(self: LedgerTask, tag: str, name: str) -> str:
    return str(self.step(name, effect, tag, "named"))


@app.task(shared=False, base=LedgerTask, bind=True, name="faults_app.nested_steps")
def nested_steps(self: LedgerTask, tag: str) -> str:
    return str(self.step("outer", lambda: self.step("inner", effect, tag, "inner")))


# -- guarantees that had no test (docs/guarantees.md) ----------------------------------------


def _never_charged(step: Any) -> Reconciled:
    return Reconciled.not_executed("provider has no such charge")


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="faults_app.irreversible_charge",
    side_effect="irreversible",
    reconciler=_never_charged,
)
def irreversible_charge(self: LedgerTask, order_id: str) -> str:
    return str(self.step("charge", effect, order_id, "charge"))


def refuse_connection(order_id: str) -> str:
    raise ConnectionRefusedError(f"provider refused the connection for {order_id}")


@app.task(
    shared=False,
    base=LedgerTask,
    bind=True,
    name="faults_app.declared_refusal",
    not_executed_on=(ConnectionRefusedError,),
)
def declared_refusal(self: LedgerTask, order_id: str) -> str:
    return str(self.step("charge", refuse_connection, order_id))

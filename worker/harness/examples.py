"""The README's example app: ``celery -A celery_ledger.harness.examples worker -B``.

The embedded default app (``create_app()``) with the example tasks registered; the default app
``celery_ledger.app`` itself registers none.

``place_order`` is the README's example: three effect steps whose effects are appended to a
plain table without unique constraints (``effects``), so a duplicate would show as two rows.
The effects table lives beside the ledger (same database URL) to keep the example server-less.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, create_engine, insert

from celery_ledger.task import LedgerTask

effects_metadata = MetaData()
effects = Table(
    "example_effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(64), nullable=False),
    Column("effect", String(32), nullable=False),
    Column("at", Float, nullable=False),
)

_engines: dict[str, Any] = {}


def effects_engine(url: str) -> Any:
    """One engine per process for the effects table (created on first use)."""
    import os

    from celery_ledger.ledger.engine import make_engine

    k = f"{os.getpid()}:{url}"
    if k not in _engines:
        engine = make_engine(url) if "sqlite" in url or "postgres" in url else create_engine(url)
        effects_metadata.create_all(engine)
        _engines[k] = engine
    return _engines[k]


def record_effect(url: str, order_id: str, effect: str) -> str:
    with effects_engine(url).begin() as conn:
        conn.execute(insert(effects).values(order_id=order_id, effect=effect, at=time.time()))
    return f"{effect}:{order_id}"


def register(app: Celery) -> None:
    from celery_ledger.runtime import settings_for

    @app.task(
        base=LedgerTask,
        bind=True,
        name="celery_ledger.examples.place_order",
        key_from=("order_id",),
    )
    def place_order(
        self: LedgerTask, order_id: str, amount: int, work_seconds: float = 0.0
    ) -> dict[str, Any]:
        url = settings_for(self.app).url
        reservation = self.step("reserve", record_effect, url, order_id, "reserve")
        time.sleep(work_seconds)
        charge = self.step("charge", record_effect, url, order_id, "charge")
        receipt = self.step("receipt", record_effect, url, order_id, "receipt")
        return {"order_id": order_id, "amount": amount, "steps": [reservation, charge, receipt]}


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``app`` (and ``celery``): built on first access, never at import time."""
    global _app
    if name in ("app", "celery"):
        if _app is None:
            from celery_ledger.app import create_app

            _app = create_app()
            register(_app)
        return _app
    raise AttributeError(name)

"""``celery_ledger.announce``: an operator action's event never holds up or fails the action."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery
from test_metrics import free_port

from celery_ledger.announce import announce


@pytest.mark.timeout(60)
def test_announce_with_the_broker_down_returns_and_says_so_at_debug(
    caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    # Nothing listens on this port: without a bound, kombu would retry the connection forever.
    app = Celery("announce-down", broker=f"redis://127.0.0.1:{free_port()}/0")
    app.conf.ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    with caplog.at_level(logging.DEBUG, logger="celery_ledger.announce"):
        announce(app, "released", task_id="t-1", key="k" * 64, fence=2, verified="completed")
    assert "could not send task-ledger-released" in caplog.text


def test_announce_is_off_when_events_are_switched_off(tmp_path: Any) -> None:
    app = Celery("announce-off", broker=f"redis://127.0.0.1:{free_port()}/0")
    app.conf.ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    app.conf.ledger_send_events = False
    sent: list[Any] = []
    app.connection_for_write = lambda *a, **k: sent.append(a)  # type: ignore[method-assign]
    announce(app, "released", task_id="t-1", key="k" * 64, fence=2)
    assert sent == []

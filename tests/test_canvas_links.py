"""What a finished delivery hands to the outbox (``celery_ledger.canvas.links_of``) and what it
leaves to Celery: code paths in one process, no worker (tests/test_canvas.py has the workers)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, group, signature
from kombu.utils.json import loads

from celery_ledger import canvas
from celery_ledger.ledger import LINKS_STEP, LedgerUnavailable, child_task_id


@pytest.fixture
def app() -> Celery:
    app = Celery("links", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.ledger_url = "sqlite://"
    return app


def request(**fields: Any) -> SimpleNamespace:
    base = {"id": "t-1", "root_id": "root-1", "chain": None, "callbacks": None}
    return SimpleNamespace(**{**base, **fields})


def task(app: Celery) -> SimpleNamespace:
    return SimpleNamespace(app=app, name="proj.first")


def payload(child: Any) -> dict[str, Any]:
    return loads(child.payload)


def test_next_chain_link_keeps_its_frozen_id_and_the_rest_of_the_chain(app: Celery) -> None:
    second = signature("proj.second", args=(2,), app=app)
    second.freeze("id-2")
    third = signature("proj.third", args=(3,), app=app)
    third.freeze("id-3")
    req = request(chain=[dict(third), dict(second)])  # Celery keeps the chain reversed
    links = canvas.links_of(task(app), req, "k" * 64, [1])
    assert [c.child_id for c in links.children] == ["id-2"]
    sent = payload(links.children[0])
    assert sent["args"] == [[1], 2]  # the result first, as the tracer would
    assert [(s["task"], s["options"]["task_id"]) for s in sent["options"]["chain"]] == [
        ("proj.third", "id-3")
    ]
    assert sent["options"]["parent_id"] == "t-1" and sent["options"]["root_id"] == "root-1"
    assert "task_id" not in sent["options"]
    links.hand_over(req)
    assert req.chain is None


def test_immutable_callbacks_and_callbacks_without_an_id(app: Celery) -> None:
    key = "k" * 64
    req = request(
        callbacks=[
            dict(signature("proj.notify", args=("x",), immutable=True, app=app)),
            dict(signature("proj.audit", app=app)),
        ]
    )
    links = canvas.links_of(task(app), req, key, 7)
    assert [c.child_id for c in links.children] == [
        child_task_id(key, LINKS_STEP, 0, 0),
        child_task_id(key, LINKS_STEP, 0, 1),
    ]
    assert payload(links.children[0])["args"] == ["x"]
    assert payload(links.children[1])["args"] == [7]
    links.hand_over(req)
    assert req.callbacks is None


def test_a_group_as_next_step_or_callback_stays_celerys(app: Celery) -> None:
    members = group(signature("proj.m", args=(n,), app=app) for n in range(2))
    req = request(chain=[dict(members)], callbacks=[dict(members)])
    links = canvas.links_of(task(app), req, "k" * 64, 1)
    assert links.children == [] and links.chain is False
    links.hand_over(req)
    assert req.chain == [dict(members)] and req.callbacks == [dict(members)]


class DownStore:
    def recorded_links(self, key: str) -> dict[str, bool]:
        raise LedgerUnavailable("ledger database unavailable: test")


def test_a_return_that_cannot_read_its_links_touches_nothing(app: Celery) -> None:
    """The RETURN gate's links read fails: the error reaches the task (which re-sends the
    delivery) and the request still carries its chain, so nothing is lost or handed over."""
    second = signature("proj.second", app=app)
    second.freeze("id-2")
    req = request(chain=[dict(second)])
    with pytest.raises(LedgerUnavailable):
        canvas.returned(
            SimpleNamespace(app=app, name="proj.first", request=req), DownStore(), "k" * 64, 1, [1]
        )  # type: ignore[arg-type]
    assert req.chain == [dict(second)]

"""guarantees.md § "Bad input", item 14: a lone surrogate (``"\\ud800"``) in a ledgered task's
arguments.

JSON carries it (``"\\ud800"``), but it is not text: UTF-8 cannot encode it, so the ledger
cannot hash the arguments. It gave a ``UnicodeEncodeError`` traceback. At send it is refused
with an ``IdentityError`` in the ledger's words, before anything is published or recorded; a
worker that receives one by name (a plain client) fails that task with the same words, and
goes on consuming.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from celery.signals import before_task_publish

from celery_ledger import LedgerTask, create_app
from celery_ledger.ledger import IdentityError
from helpers import effect_counts
from procs import processes, test_env
from test_delivery import client_app

pytestmark = pytest.mark.processes

LONE = "A-\ud800"


@pytest.mark.parametrize("intents", [False, True])
@pytest.mark.parametrize(
    "call",
    [
        {"args": (LONE,)},
        {"kwargs": {"order_id": "A-1", "note": ["x", {"y": LONE}]}},
        {"kwargs": {"order_id": "A-1", "meta": {LONE: 1}}},
    ],
    ids=["positional", "nested", "dict-key"],
)
def test_a_lone_surrogate_is_refused_at_send(tmp_path: Any, intents: bool, call: dict) -> None:
    producer = create_app(
        f"producer-sur-{intents}",
        data_dir=tmp_path / "data",
        broker_url="memory://",
        ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        ledger_publish_intent=intents,
    )

    @producer.task(base=LedgerTask, name="sur.order", shared=False)
    def order(order_id: str, **kwargs: Any) -> None:
        raise AssertionError("the producer never runs the body")

    published: list[Any] = []

    def seen(sender: Any = None, headers: Any = None, **_: Any) -> None:
        published.append((headers or {}).get("id"))

    before_task_publish.connect(seen, weak=False)
    try:
        with pytest.raises(IdentityError, match="surrogate") as info:
            order.apply_async(**call)
        assert "\n" not in str(info.value) and "codec" not in str(info.value)
        assert published == []
    finally:
        before_task_publish.disconnect(seen)


def test_a_worker_receiving_a_lone_surrogate_by_name_fails_it_and_goes_on(
    tmp_path: Any, redis: str, pg_url: str
) -> None:
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    app = client_app(env)
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", concurrency=1)
        for name, kw in (
            ("tests_app.order", {"order_id": LONE, "amount": 1}),
            ("tests_app.slow_effect", {"tag": "sur-" + LONE, "seconds": 0.0}),
        ):
            bad = app.send_task(name, kwargs=kw)
            with pytest.raises(Exception, match="surrogate") as info:
                bad.get(timeout=60)
            assert isinstance(info.value, IdentityError), repr(info.value)
            assert "codec" not in str(info.value), str(info.value)
        good = app.send_task("tests_app.slow_effect", args=("sur-after", 0.0))
        assert good.get(timeout=60) == "done:sur-after"
        assert "UnicodeEncodeError" not in worker.log_text()
    assert effect_counts(pg_url, "sur-after") == {("sur-after", "body"): 1}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

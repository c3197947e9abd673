"""What a finished delivery hands to the outbox (``celery_ledger.canvas.links_of``) and what it
leaves to Celery: code paths in one process, no worker (tests/test_canvas.py has the workers)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, group, signature
from kombu.utils.json import loads

from celery_ledger import canvas, runtime
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
    links = canvas.links_of(task(app), req, "k" * 64, [1], fence=1)
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
    links = canvas.links_of(task(app), req, key, 7, fence=3)
    assert [c.child_id for c in links.children] == [
        child_task_id(key, LINKS_STEP, 3, 0),
        child_task_id(key, LINKS_STEP, 3, 1),
    ]
    # The same on every redelivery that RETURNs that settle, another for another settle.
    again = canvas.links_of(task(app), req, key, 7, fence=3)
    assert [c.child_id for c in again.children] == [c.child_id for c in links.children]
    other = canvas.links_of(task(app), req, key, 7, fence=5)
    assert not {c.child_id for c in other.children} & {c.child_id for c in links.children}
    assert payload(links.children[0])["args"] == ["x"]
    assert payload(links.children[1])["args"] == [7]
    links.hand_over(req)
    assert req.callbacks is None


def test_a_group_as_next_step_or_callback_stays_celerys(app: Celery) -> None:
    members = group(signature("proj.m", args=(n,), app=app) for n in range(2))
    req = request(chain=[dict(members)], callbacks=[dict(members)])
    links = canvas.links_of(task(app), req, "k" * 64, 1, fence=1)
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
        task_ = SimpleNamespace(app=app, name="proj.first", request=req)
        canvas.returned(
            task_, DownStore(), "k" * 64, 1, canvas.links_of(task_, req, "k" * 64, [1], fence=1)
        )  # type: ignore[arg-type]
    assert req.chain == [dict(second)]


# -- the store: a settle that records links, and a group's members (SQLite and PostgreSQL) ----


def claim(
    store: Any, key: str, *, group_id: str | None = None, parent_id: str | None = None
) -> int:
    from celery_ledger.ledger import ClaimRequest, Owner

    c = store.claim(
        ClaimRequest(
            key=key,
            task_name="proj.link",
            task_id=f"tid-{key}",
            args_hash="h",
            snapshot=None,
            side_effect="non_idempotent",
            owner=Owner("node@test", "boot", 1),
            lease_seconds=60.0,
            group_id=group_id,
            parent_id=parent_id,
        )
    )
    return int(c.fence)


def test_settle_with_links_is_one_fenced_write(store: Any) -> None:
    from celery_ledger.ledger import Child, EntryStatus

    fence = claim(store, "k1")
    link = Child("next-1", "proj.link", '{"args": [], "kwargs": {}, "options": {}}', 0)
    # A superseded attempt writes nothing: no settle, no link.
    assert store.settle_with_links("k1", fence + 1, result="1", links=[link]) is False
    assert store.get_entry("k1").status is EntryStatus.RUNNING
    assert store.recorded_links("k1") == {}
    assert store.settle_with_links("k1", fence, result="1", links=[link]) is True
    entry = store.get_entry("k1")
    assert entry.status is EntryStatus.COMPLETED and entry.result == "1"
    assert store.recorded_links("k1") == {"next-1": False}
    assert [m.child_id for m in store.unpublished()] == ["next-1"]
    assert [e.event for e in store.entry_events("k1")][-1] == "settled"
    # Settled once: a second settle is refused and records nothing more.
    other = Child("next-2", "proj.link", link.payload, 1)
    assert store.settle_with_links("k1", fence, result="2", links=[other]) is False
    assert store.recorded_links("k1") == {"next-1": False}
    store.mark_published(["next-1"])
    assert store.recorded_links("k1") == {"next-1": True}
    with pytest.raises(ValueError, match="use settle"):
        store.settle_with_links("k1", fence, result="1", links=[])


def test_members_of_a_group_and_of_a_parent(store: Any) -> None:
    for n in range(3):
        claim(store, f"m{n}", group_id="g-1", parent_id="tid-p")
    claim(store, "other", group_id="g-2")
    assert [m.key for m in store.members("g-1")] == ["m0", "m1", "m2"]
    assert {m.key for m in store.members("tid-p")} == {"m0", "m1", "m2"}
    assert [m.status.value for m in store.members("g-2")] == ["running"]
    assert store.members("nobody") == []


def test_a_failed_settle_records_its_errbacks(store: Any) -> None:
    from celery_ledger.ledger import Child, EntryStatus

    fence = claim(store, "f1")
    errback = Child("eb-1", "proj.on_failure", '{"args": ["tid-f1"], "kwargs": {}}', 0)
    assert store.settle_with_links(
        "f1",
        fence,
        result=None,
        error='{"exc_type": "ValueError"}',
        links=[errback],
        status=EntryStatus.FAILED,
    )
    entry = store.get_entry("f1")
    assert entry.status is EntryStatus.FAILED and entry.error == '{"exc_type": "ValueError"}'
    assert store.recorded_links("f1") == {"eb-1": False}
    with pytest.raises(ValueError, match="completed or failed"):
        store.settle_with_links(
            "f1", fence, result=None, links=[errback], status=EntryStatus.BLOCKED
        )


def test_links_are_sealed_with_the_snapshot_keys(app: Celery) -> None:
    """With ``ledger_snapshot_keys`` a recorded link's arguments (the result it carries) are
    sealed like an argument snapshot, and opened to publish."""
    from cryptography.fernet import Fernet

    from celery_ledger.ledger.sealing import open_snapshot

    app.conf.ledger_snapshot_keys = Fernet.generate_key().decode()
    second = signature("proj.second", app=app)
    second.freeze("id-2")
    links = canvas.links_of(
        task(app), request(chain=[dict(second)]), "k" * 64, "4111-1111", fence=1
    )
    (child,) = links.children
    assert child.payload.startswith("fernet:") and "4111" not in child.payload
    opened = loads(open_snapshot(child.payload, runtime.snapshot_cipher(app)))
    assert opened["args"] == ["4111-1111"]


def test_callbacks_after_a_released_failure_get_rows_of_their_own(app: Celery, store: Any) -> None:
    """fail -> operator release -> complete: the errback was recorded with the failed settle
    and published; the callback recorded with the completed settle is a row of its own, with
    an id of its own, unpublished until the broker took it. A process killed right after the
    settle (``after-settle``) leaves it to the sweep, which only lists unpublished rows."""
    from celery_ledger.ledger import EntryStatus, Verdict

    key = "r1"
    fence = claim(store, key)
    errback = signature("proj.on_failure", app=app)
    failed = canvas.errback_links_of(
        task(app), request(id="tid-r1", errbacks=[dict(errback)]), key, fence=fence
    )
    assert store.settle_with_links(
        key,
        fence,
        result=None,
        error='{"exc_type": "ValueError"}',
        links=failed.children,
        status=EntryStatus.FAILED,
    )
    store.mark_published([c.child_id for c in failed.children])  # the errback went out
    store.release(key, Verdict.NOT_EXECUTED, by="alice", reason="checked: nothing was charged")
    fence = claim(store, key)
    callback = signature("proj.on_success", app=app)
    done = canvas.links_of(
        task(app), request(id="tid-r1", callbacks=[dict(callback)]), key, 7, fence=fence
    )
    assert store.settle_with_links(key, fence, result="7", links=done.children)
    (eb,), (cb,) = failed.children, done.children
    assert cb.child_id != eb.child_id
    assert store.recorded_links(key) == {eb.child_id: True, cb.child_id: False}
    assert [(m.child_id, m.task_name) for m in store.unpublished()] == [
        (cb.child_id, "proj.on_success")
    ]

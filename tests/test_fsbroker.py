"""The embedded broker (``celery_ledger.fsbroker``): a consumer never takes a message that its
producer is still writing, whichever transport wrote it (no server needed).

Each test holds a producer inside its write (the payload's serialization blocks on an event)
and polls the queue meanwhile, as a worker's consumer does. kombu's own filesystem transport
hands the consumer an empty file there and raises ``JSONDecodeError``, which kills a Celery
worker (``test_kombus_own_transport_tears_a_message_in_the_middle_of_its_write`` shows it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kombu import Connection
from kombu.transport import filesystem

from celery_ledger import create_app, fsbroker

QUEUE = "orders"
PAYLOAD = {"body": "order-1", "properties": {"delivery_tag": "t-1"}}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "processed").mkdir()
    return tmp_path


def channel(folder: Path, transport: Any) -> Any:
    conn = Connection(
        "filesystem://",
        transport=transport,
        transport_options={
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
        },
    )
    return conn.default_channel


@contextmanager
def held_put(
    monkeypatch: pytest.MonkeyPatch, module: Any, put: Callable[[], None]
) -> Iterator[None]:
    """Run ``put`` in a thread until it is inside its write (``module.dumps`` blocks), yield,
    then let it finish."""
    entered, release = threading.Event(), threading.Event()
    real = module.dumps

    def slow_dumps(value: Any) -> str:
        entered.set()
        assert release.wait(10), "the test never released the producer"
        return real(value)

    monkeypatch.setattr(module, "dumps", slow_dumps)
    writer = threading.Thread(target=put)
    writer.start()
    try:
        assert entered.wait(10), "the producer never started its write"
        yield
    finally:
        release.set()
        writer.join(10)
    assert not writer.is_alive()


def test_kombus_own_transport_tears_a_message_in_the_middle_of_its_write(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault: kombu's producer has created the file and not written it; kombu's consumer
    takes it and fails to decode it. (If kombu fixes this, this test says so.)"""
    producer = channel(folder, "filesystem")
    consumer = channel(folder, "filesystem")
    with (
        held_put(monkeypatch, filesystem, lambda: producer._put(QUEUE, PAYLOAD)),
        pytest.raises(ValueError),
    ):  # JSONDecodeError
        consumer._get(QUEUE)


def test_a_message_kombus_producer_is_writing_waits_for_the_next_poll(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = channel(folder, "filesystem")
    consumer = channel(folder, fsbroker.Transport)
    with (
        held_put(monkeypatch, filesystem, lambda: producer._put(QUEUE, PAYLOAD)),
        pytest.raises(Empty),
    ):
        consumer._get(QUEUE)
    assert consumer._get(QUEUE) == PAYLOAD
    with pytest.raises(Empty):
        consumer._get(QUEUE)


def test_our_producer_shows_no_message_until_it_is_whole(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even kombu's own consumer (a worker of another app on the same folder) never sees a
    message of ours half written."""
    producer = channel(folder, fsbroker.Transport)
    kombus = channel(folder, "filesystem")
    with (
        held_put(monkeypatch, fsbroker, lambda: producer._put(QUEUE, PAYLOAD)),
        pytest.raises(Empty),
    ):
        kombus._get(QUEUE)
    assert kombus._get(QUEUE) == PAYLOAD
    assert [p.name for p in folder.iterdir() if p.is_file()] == []  # no partial file left


def test_two_consumers_take_a_message_once(folder: Path) -> None:
    producer = channel(folder, fsbroker.Transport)
    first, second = channel(folder, fsbroker.Transport), channel(folder, fsbroker.Transport)
    for n in range(20):
        producer._put(QUEUE, {**PAYLOAD, "body": f"order-{n}"})
    taken: list[Any] = []
    for consumer in [first, second] * 10:
        taken.append(consumer._get(QUEUE)["body"])
    assert sorted(taken) == sorted(f"order-{n}" for n in range(20))
    with pytest.raises(Empty):
        first._get(QUEUE)


def test_the_embedded_default_uses_it(tmp_path: Path) -> None:
    app = create_app("fsbroker-test", data_dir=tmp_path)
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, fsbroker.Transport)
    other = create_app("fsbroker-redis", data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0")
    assert other.conf.broker_transport is None

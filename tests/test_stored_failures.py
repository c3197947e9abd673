"""Stored failures: one format, one writer, and rows written before the errors moved.

A settled entry keeps its failure in Celery's JSON form of an exception (``exc_type``,
``exc_message``, ``exc_module``); every later delivery of its key raises it again (gate
RETURN). ``TaskCancelled``, ``TaskExpired`` and ``KeyPruned`` are the ledger's own errors
(``celery_ledger.ledger.errors``); rows stored before they moved name ``celery_ledger.timing``
and must still raise them.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from seams_app import SEAMS_TASKS, register

from celery_ledger import create_app
from celery_ledger.codec import decode_failure
from celery_ledger.ledger import ClaimRequest, EntryStatus, LedgerStore, Owner
from helpers import key_of
from procs import processes, test_env

#: The module every cancelled, expired or pruned failure named before the errors moved.
OLD_MODULE = "celery_ledger.timing"


def old_row(exc_type: str, message: str) -> str:
    """A failure as the ledger stored it before the move (``ledger/admission.py``'s form)."""
    return json.dumps({"exc_type": exc_type, "exc_message": [message], "exc_module": OLD_MODULE})


@pytest.fixture
def app(tmp_path: Path) -> Any:
    return create_app("stored-failures", data_dir=tmp_path)


@pytest.mark.parametrize("name", ["TaskCancelled", "TaskExpired", "KeyPruned"])
def test_a_row_naming_the_old_module_raises_the_ledgers_class(app: Any, name: str) -> None:
    """The path a RETURN takes (``codec.decode_failure``, through Celery's
    ``backend.exception_to_python``) gives the class ``celery_ledger`` exports."""
    import celery_ledger

    cls = getattr(celery_ledger, name)
    assert cls.__module__ == "celery_ledger.ledger.errors"
    task = register(app)["bare"]
    raised = decode_failure(task.backend, old_row(name, "stored before the move"))
    assert type(raised) is cls, type(raised)
    assert str(raised) == "stored before the move"


@pytest.mark.parametrize("name", ["TaskCancelled", "TaskExpired", "KeyPruned"])
def test_the_ledgers_failures_name_the_ledgers_module(name: str) -> None:
    """What the ledger stores now points at the ledger, not at a runtime module."""
    from celery_ledger.ledger.admission import PRUNED_FAILURE, cancelled_failure, expired_failure

    stored = {
        "TaskCancelled": cancelled_failure("why"),
        "TaskExpired": expired_failure("why"),
        "KeyPruned": PRUNED_FAILURE,
    }[name]
    data = json.loads(stored)
    assert (data["exc_type"], data["exc_module"]) == (name, "celery_ledger.ledger.errors")


def test_the_one_writer_writes_celerys_form(app: Any) -> None:
    """``stored_failure`` writes what Celery's ``prepare_exception(exc, "json")`` makes, so
    that ``exception_to_python`` reads it back; over its limit it keeps the type and a short
    message."""
    from celery_ledger.ledger.errors import stored_failure

    exc = ValueError("card declined", 402)
    assert json.loads(stored_failure(exc, limit=1024)) == json.loads(
        json.dumps(app.backend.prepare_exception(exc, "json"))
    )
    big = ValueError("x" * 5000)
    data = json.loads(stored_failure(big, limit=4096))
    assert data["exc_type"] == "ValueError" and len(data["exc_message"][0]) <= 2000, data


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.processes
def test_a_client_sees_the_new_class_for_a_row_stored_with_the_old_module(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    """A real worker RETURNs an entry settled ``cancelled`` before the move (its failure names
    ``celery_ledger.timing``): the caller's ``AsyncResult.get()`` raises
    ``celery_ledger.TaskCancelled`` itself, and the body never ran."""
    import celery_ledger
    from celery_ledger.codec import arguments_hash

    env = test_env(tmp_path, broker=redis, ledger_url=pg_url)
    producer = create_app(
        f"producer-{env['TEST_ID']}",
        data_dir=tmp_path / "producer",
        broker_url=env["CELERY_BROKER_URL"],
        result_backend=env["CELERY_RESULT_BACKEND"],
        ledger_url=env["CELERY_LEDGER_URL"],
        task_default_queue=env["TEST_QUEUE"],
    )
    tasks = register(producer)
    task_id = str(uuid.uuid4())
    key = key_of("seams_app.bare", task_id)
    store = LedgerStore(pg_url)
    try:
        claim = store.claim(
            ClaimRequest(
                key=key,
                task_name="seams_app.bare",
                task_id=task_id,
                args_hash=arguments_hash([["old-row"], {}]),
                snapshot=None,
                side_effect="non_idempotent",
                owner=Owner(node="test", boot="b", pid=1),
                lease_seconds=30.0,
            )
        )
        assert store.settle(
            key,
            claim.fence,
            EntryStatus.CANCELLED,
            error=old_row("TaskCancelled", "cancelled by ops: before the move"),
        )
        with processes(tmp_path, env) as procs:
            procs.worker("w1", concurrency=1, extra=SEAMS_TASKS)
            result = tasks["bare"].apply_async(("old-row",), task_id=task_id)
            with pytest.raises(celery_ledger.TaskCancelled) as raised:
                result.get(timeout=60)
        assert "before the move" in str(raised.value)
        assert store.get_entry(key).status is EntryStatus.CANCELLED
    finally:
        store.dispose()

"""Encryption at rest for argument snapshots: ``ledger_snapshot_keys`` (docs/design.md
§ "Secrets out of sight, and snapshots sealed at rest").

Unit cases of the cipher and the settings; ``doctor``'s warning; and real processes: a worker
with a key stores ``page_app.pay``'s snapshot sealed (the card number is nowhere in the ledger
database), dies whole after ``reserve``, and the CLI's sweep resumes the entry from the sealed
snapshot, in a process that holds the key, to completion.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from celery_ledger import runtime
from celery_ledger.cli.main import main
from celery_ledger.ledger import SnapshotCipher, SnapshotSealError, is_sealed, open_snapshot
from celery_ledger.settings import LedgerSettings

pytest.importorskip("cryptography")
from cryptography.fernet import Fernet

CARD = "4111111111111111"


def test_seal_open_and_rotate() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    plain = json.dumps({"args": [], "kwargs": {"card_number": CARD}})
    sealed_old = SnapshotCipher([old]).seal(plain)
    assert is_sealed(sealed_old) and CARD not in sealed_old
    rotated = SnapshotCipher([new, old])
    assert rotated.open(sealed_old) == plain, "old snapshots open after rotation"
    resealed = rotated.reseal(sealed_old)
    assert SnapshotCipher([new]).open(resealed) == plain, "resealed under the new key"
    with pytest.raises(SnapshotSealError, match="not in ledger_snapshot_keys"):
        SnapshotCipher([new]).open(sealed_old)
    # plain snapshots (written before a key was set) are read as they are
    assert rotated.open(plain) == plain and open_snapshot(plain, None) == plain
    with pytest.raises(SnapshotSealError, match="no ledger_snapshot_keys"):
        open_snapshot(sealed_old, None)


def test_settings_refuse_a_bad_key_without_echoing_it_and_keep_keys_out_of_repr() -> None:
    good = Fernet.generate_key().decode()
    with pytest.raises(ValueError, match="key 2 of 2 is not a Fernet key") as info:
        LedgerSettings.from_mapping(
            {}, {"CELERY_LEDGER_URL": "sqlite://", "CELERY_LEDGER_SNAPSHOT_KEYS": f"{good},hunter2"}
        )
    assert "hunter2" not in str(info.value) and good not in str(info.value)
    settings = LedgerSettings.from_mapping(
        {"ledger_snapshot_keys": [good]}, {"CELERY_LEDGER_URL": "sqlite://"}
    )
    assert settings.snapshot_keys == (good,)
    assert good not in repr(settings)


@pytest.fixture
def doctor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    monkeypatch.setenv("CELERY_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("CELERY_LEDGER_SNAPSHOT_KEYS", raising=False)
    import page_app

    runtime.reset(page_app.app)  # its settings are read again, from this environment

    def run() -> str:
        result = CliRunner().invoke(main, ["-A", "page_app", "doctor", "--json"])
        checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
        return checks["secrets"]

    yield run
    runtime.reset(page_app.app)  # not this test's environment for the next test


def test_doctor_warns_when_secrets_are_declared_and_no_key_is_set(
    doctor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = doctor()
    assert check["status"] == "WARN" and "card_number" in check["status"] + check["reason"]
    assert "ledger_snapshot_keys" in check["reason"]
    import page_app

    monkeypatch.setenv("CELERY_LEDGER_SNAPSHOT_KEYS", Fernet.generate_key().decode())
    runtime.reset(page_app.app)
    assert doctor()["status"] == "PASS"


@pytest.mark.processes
@pytest.mark.redis
@pytest.mark.postgres
def test_a_sealed_snapshot_is_resumed_by_a_process_with_the_key(
    tmp_path: Path, redis: str, pg_url: str
) -> None:
    from celery import Celery

    from celery_ledger.harness.processes import ProcessGroup
    from celery_ledger.ledger import EntryStatus, LedgerStore, entry_key
    from procs import TESTS, test_env, wait_for

    key_text = Fernet.generate_key().decode()
    env = test_env(tmp_path, broker=redis, ledger_url=pg_url, CELERY_LEDGER_SNAPSHOT_KEYS=key_text)
    client = Celery("client", broker=redis, backend=redis)
    key = entry_key("page_app.pay", {"order_id": "s-1"})
    store = LedgerStore(pg_url)
    store.now()
    group = ProcessGroup(tmp_path, app="page_app", env=env, cwd=TESTS, pythonpath=[TESTS])
    try:
        with group:

            def worker(name: str, **extra: str) -> Any:
                return group.worker(
                    name,
                    queue=env["TEST_QUEUE"],
                    node=f"{name}-{env['TEST_ID']}@%h",
                    concurrency=1,
                    env=extra,
                ).wait_ready(90)

            w1 = worker(
                "w1",
                CELERY_LEDGER_CRASH_AT="step-completed:reserve@worker",
                CELERY_LEDGER_CRASH_ONCE=str(tmp_path / "crash"),
                CELERY_LEDGER_LEASE_SECONDS="2",
            )
            sent = client.send_task(
                "page_app.pay",
                kwargs={"order_id": "s-1", "amount": 3, "card_number": CARD},
                queue=env["TEST_QUEUE"],
            )
            wait_for(lambda: w1.proc.poll() is not None, timeout=90, what="w1 killed whole")
            entry = store.get_entry(key)
            assert is_sealed(entry.snapshot), entry.snapshot[:40]
            with store.engine.connect() as conn:
                for table in ("ledger_entries", "ledger_steps", "ledger_events"):
                    dump = " ".join(str(r) for r in conn.execute(text(f"SELECT * FROM {table}")))
                    assert CARD not in dump, table

            def sweep(*extra_env: tuple[str, str]) -> Any:
                proc = group.celery(
                    f"sweep-{len(group.started)}", ["ledger", "sweep"], env=dict(extra_env)
                )
                wait_for(lambda: proc.proc.poll() is not None, timeout=60, what="ledger sweep")
                return proc

            wait_for(
                lambda: store.interrupt_expired(actor="sweep"),
                timeout=30,
                interval=0.5,
                what="w1's lease to run out",
            )
            # A sweep without the key leaves the entry interrupted (for one that has it).
            blind = sweep(("CELERY_LEDGER_SNAPSHOT_KEYS", ""))
            assert blind.proc.returncode == 0, blind.log_tail()
            assert store.get_entry(key).status is EntryStatus.INTERRUPTED
            worker("w2")
            done = sweep()
            assert done.proc.returncode == 0, done.log_tail()
            assert sent.get(timeout=90)["order_id"] == "s-1"
            assert store.get_entry(key).status is EntryStatus.COMPLETED
            shown = group.celery("show", ["ledger", "show", key])
            wait_for(lambda: shown.proc.poll() is not None, timeout=60, what="ledger show")
            assert CARD not in shown.log_text()
            assert "order_id" in shown.log_text()
    finally:
        store.dispose()


# -- reseal: the rotation -----------------------------------------------------------------------


@pytest.fixture
def ledger_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ledger_url: str) -> Any:
    monkeypatch.setenv("CELERY_LEDGER_URL", ledger_url)
    monkeypatch.setenv("CELERY_LEDGER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("CELERY_LEDGER_SNAPSHOT_KEYS", raising=False)

    def invoke(*args: str, keys: str = "", code: int = 0) -> Any:
        result = CliRunner().invoke(
            main, list(args), env={"CELERY_LEDGER_SNAPSHOT_KEYS": keys} if keys else None
        )
        assert result.exit_code == code, (result.exit_code, result.output)
        return result

    return invoke


def test_reseal_seals_plain_snapshots_and_rotates_to_the_first_key(
    ledger_cli: Any, ledger_url: str
) -> None:
    from test_cli import claim

    from celery_ledger.ledger import LedgerStore

    store = LedgerStore(ledger_url)
    try:
        keys = [claim(store).key for _ in range(3)]
        plain = {k: store.get_entry(k).snapshot for k in keys}
        old, new, stray = (Fernet.generate_key().decode() for _ in range(3))
        err = ledger_cli("reseal", code=1)
        assert "ledger_snapshot_keys is not set" in err.output and "Traceback" not in err.output
        assert "resealed 3" in ledger_cli("reseal", "--batch", "2", keys=old).output
        for k in keys:
            sealed = store.get_entry(k).snapshot
            assert is_sealed(sealed) and SnapshotCipher([old]).open(sealed) == plain[k]
        # An entry sealed with a key nobody has any more is left alone, and said so.
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE ledger_entries SET snapshot = :s WHERE key = :k"),
                {"s": SnapshotCipher([stray]).seal(plain[keys[0]]), "k": keys[0]},
            )
        out = ledger_cli("reseal", keys=f"{new},{old}", code=1).output
        assert "resealed 2" in out and "1 snapshot(s) could not be opened" in out
        for k in keys[1:]:
            assert SnapshotCipher([new]).open(store.get_entry(k).snapshot) == plain[k]
    finally:
        store.dispose()

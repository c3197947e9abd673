"""A worker refuses to start with ledger settings it cannot use (guarantees.md § "Bad input", item
11).

With a garbage ``ledger_snapshot_keys`` a worker used to start and fail every task with
``SnapshotSealError``; five minutes later the sweep re-ran them on a healthy worker (the
caller saw FAILURE, then SUCCESS). Now the worker exits non-zero before it consumes anything,
with one line naming the setting. Real ``celery worker`` processes over Redis.
"""

from __future__ import annotations

import math

import pytest

from celery_ledger.settings import LedgerSettings
from procs import processes, test_env, wait_for

pytestmark = pytest.mark.processes

#: How long a worker that refuses its settings may take to exit (it imports Celery first).
EXIT_TIMEOUT = 30.0


@pytest.mark.parametrize(
    ("variable", "value", "setting"),
    [
        ("CELERY_LEDGER_SNAPSHOT_KEYS", "garbage", "ledger_snapshot_keys"),
        ("CELERY_LEDGER_LEASE_SECONDS", "nan", "ledger_lease_seconds"),
        ("CELERY_LEDGER_MAX_RESULT_BYTES", "lots", "ledger_max_result_bytes"),
        ("CELERY_LEDGER_URL", "postgresql://[::1", "ledger_url"),
        ("CELERY_LEDGER_URL", "nonsense://ledger", "ledger_url"),
    ],
)
def test_a_worker_refuses_to_start_with_a_setting_it_cannot_use(
    tmp_path, redis, pg_url, variable: str, value: str, setting: str
) -> None:
    env = {**test_env(tmp_path, broker=redis, ledger_url=pg_url), variable: value}
    with processes(tmp_path, env) as procs:
        worker = procs.worker("w1", ready=False)
        wait_for(lambda: not worker.alive, timeout=EXIT_TIMEOUT, what="the worker to exit")
        assert worker.proc is not None and worker.proc.returncode != 0
        log = worker.log_text()
    assert "ready." not in log, log
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if setting in line]
    assert len(lines) == 1, log
    assert lines[0].startswith("celery-ledger: cannot start the worker"), lines[0]


@pytest.mark.parametrize(
    "name",
    [
        "lease_seconds",
        "sweep_interval",
        "death_grace_seconds",
        "retry_grace_seconds",
        "settle_retry_seconds",
        "reconcile_timeout",
        "hold_threshold_seconds",
    ],
)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_a_time_setting_that_is_no_finite_number_is_refused(name: str, raw: str) -> None:
    assert not math.isfinite(float(raw))
    with pytest.raises(ValueError, match=f"ledger_{name} must be a finite number"):
        LedgerSettings.from_mapping({"ledger_url": "sqlite://", f"ledger_{name}": raw}, env={})

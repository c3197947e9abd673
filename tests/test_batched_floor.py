"""``benchmarks/batched_floor.py`` at a tiny size: every mode reports its three figures, and its
accounting of commits is right (docs/benchmarks.md § "The amortized floor").

A check of the benchmark, never of a timing: a batch of 32 commits one claim, one lease
renewal and one settle, 3/32 of a commit per task by construction, so a figure at or above 0.2
means the measurement counts what it should not (or the batches are not batches).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODES = ("per task", "per task, lazy", "batched 1", "batched 8", "batched 32", "batched 128")


@pytest.mark.postgres
def test_batched_floor_counts_commits_per_batch(pg_url: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "batched_floor.py"),
            "--tasks",
            "64",
            "--rounds",
            "1",
            "--json",
            "--url",
            pg_url.replace("+psycopg", ""),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert (out["tasks"], out["rounds"]) == (64, 1)
    figures = out["per_task"]
    assert tuple(figures) == MODES
    for mode, row in figures.items():
        assert set(row) == {"wall_ms", "commits", "wal_bytes"}, mode
        assert row["wall_ms"] > 0 and row["wal_bytes"] > 0, (mode, row)
    # Two statements a task, each its own commit; three statements a batch.
    for mode in ("per task", "per task, lazy"):
        assert 1.9 <= figures[mode]["commits"] <= 2.2, figures
    assert 0 < figures["batched 32"]["commits"] < 0.2, figures
    assert figures["batched 128"]["commits"] < figures["batched 8"]["commits"], figures

"""The benchmark runner's smoke run: every expected figure is present and numeric.

Runs ``benchmarks/run.py --quick --no-write`` as a subprocess against this test's own Redis
database. It checks the shape of the output, never a timing: benchmarks are measurements.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servers import PG_ADMIN_URL

REPO = Path(__file__).resolve().parent.parent

#: (benchmark, metric prefix) of every row the quick run must produce.
EXPECTED = [
    ("throughput", "plain celery (acks_late)"),
    ("throughput", "LedgerTask (PostgreSQL)"),
    ("throughput", "ratio ledger/plain"),
    ("throughput", "two-commit floor (bare psycopg)"),
    ("throughput", "ratio floor/plain"),
    ("throughput", "ratio ledger/floor"),
    ("throughput", "statements per task"),
    ("throughput", "round trips per task"),
    ("throughput", "pg transactions per task"),
    *[
        ("steps", f"{what} ({db})")
        for db in ("PostgreSQL", "SQLite")
        for what in (
            "idempotent step overhead",
            "idempotent step writes",
            "effect step overhead",
            "effect step writes",
            "resume 100 steps",
            "resume replay-row queries",
        )
    ],
    *[
        ("sweep", f"{what}")
        for what in (
            "no-op sweep, 1,000 settled (PostgreSQL)",
            "no-op sweep, 10,000 settled (PostgreSQL)",
            "no-op sweep, 10,000 settled (SQLite)",
            "sweep 100 expired, 1,000 settled (PostgreSQL)",
            "sweep 100 expired, 10,000 settled (PostgreSQL)",
            "sweep 10 expired, 10,000 settled (SQLite)",
            "stale queries 100 expired, 10,000 settled (SQLite)",
        )
    ],
    ("memory", "RSS per pool process, plain"),
    ("memory", "RSS per pool process, ledger"),
    ("memory", "PSS ratio ledger/plain"),
    ("memory", "USS ratio ledger/plain"),
    ("memory", "RSS ratio floor/plain"),
    ("scrape", "stats() uncached"),
    ("scrape", "scrape from the cache"),
]


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.processes
def test_quick_run_reports_every_figure(redis: str, pg_url: str, tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "CELERY_LEDGER_BENCH_PG": PG_ADMIN_URL, "CELERY_LEDGER_BENCH_REDIS": redis}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "run.py"),
            "--quick",
            "--no-write",
            "--broker",
            redis,
            "--json",
            str(out_json),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, f"runner failed:\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"

    data = json.loads(out_json.read_text())
    assert data["mode"] == "quick" and data["failed"] == []
    rows = {(r["bench"], r["metric"]): r for r in data["rows"]}
    for bench, metric in EXPECTED:
        row = rows.get((bench, metric))
        assert row is not None, f"no row {bench} / {metric}; got {sorted(rows)}"
        assert isinstance(row["value"], (int, float)) and math.isfinite(row["value"]), row
        assert row["value"] >= 0, row
        # the printed table carries the same rows
        assert any(
            line.startswith(bench) and metric in line for line in proc.stdout.splitlines()
        ), f"{metric} missing from the table"
    # Counts are exact, not timings: the hot path's statement budget is part of the output.
    assert rows[("steps", "idempotent step writes (PostgreSQL)")]["value"] > 0
    assert rows[("steps", "resume replay-row queries (SQLite)")]["value"] >= 1


def run_table(script: str, *args: str, redis: str | None = None) -> dict[str, float]:
    """Run ``benchmarks/<script>`` (tiny sizes) on this machine's PostgreSQL (and ``redis``)
    and return its printed table as metric -> value; the run must succeed."""
    env = {**os.environ, "CELERY_LEDGER_BENCH_PG": PG_ADMIN_URL}
    if redis is not None:
        env["CELERY_LEDGER_BENCH_REDIS"] = redis
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    bench = script.removesuffix(".py")
    values = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if cells[0] == bench:
            values[cells[1]] = float(cells[2].replace(",", ""))
    return values


@pytest.mark.postgres
def test_layers_reports_each_layer_and_the_splits(pg_url: str) -> None:
    """``benchmarks/layers.py`` runs every layer for real (the traced LedgerTask claims and
    settles in a scratch database; a failed trace stops it) and prints each figure."""
    values = run_table("layers.py", "--tasks", "30", "--rounds", "1")
    layers = ("plain", "floor", "schema floor", "store: claim + settle", "LedgerTask")
    for layer in (*layers, "store, default class", "LedgerTask, default class"):
        for what in ("CPU", "wall"):
            assert values[f"{layer}: {what} per task"] > 0, (layer, what, values)
    for split in (
        "the schema's statements over the floor's",
        "the store's Python over the schema floor",
        "the task layer over the store",
        "the task layer over the store, default class",
        "the default class over idempotent (whole task)",
    ):
        assert math.isfinite(values[split]), (split, values)


@pytest.mark.postgres
def test_schema_cost_runs_every_case_at_every_stage(pg_url: str) -> None:
    """``benchmarks/schema_cost.py`` runs the ledger's compiled statements against its migrated
    schema at each stage (a statement or an index name the schema no longer has fails it)."""
    values = run_table("schema_cost.py", "--tasks", "20", "--rounds", "1")
    for stage in ("every index", "five hot-path indexes dropped", "every secondary index dropped"):
        for case in ("floor", "schema", "schema, no event"):
            assert values[f"{case}, {stage}"] > 0, (case, stage, values)


@pytest.mark.postgres
def test_schema_cost_compares_the_events_primary_keys(pg_url: str) -> None:
    """``schema_cost.py --events-pk`` rebuilds the events' primary key on ``(key, id)`` in one
    scratch database (a constraint or index name the schema no longer has fails it) and runs
    the ledger's statements on both layouts."""
    values = run_table("schema_cost.py", "--events-pk", "--tasks", "20", "--rounds", "2")
    for layout in ("primary key id, index (key, id)", "primary key (key, id)"):
        assert values[f"schema, events {layout}"] > 0, (layout, values)
    assert math.isfinite(values["events primary key (key, id) saves"]), values


@pytest.mark.postgres
def test_schema_cost_compares_a_narrow_hot_row(pg_url: str) -> None:
    """``schema_cost.py --narrow-row`` rebuilds the entries table without the columns a claim
    and a settle never write (a column the schema no longer has fails it, and so does a claim
    or settle that writes one of them) and runs the ledger's statements on both tables."""
    values = run_table("schema_cost.py", "--narrow-row", "--tasks", "20", "--rounds", "2")
    for layout in ("entries as migrated", "entries without the rare columns"):
        assert values[f"schema, {layout}"] > 0, (layout, values)
    assert math.isfinite(values["a narrow hot row saves"]), values


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.processes
def test_matrix_runs_the_round_trip_floors(redis: str, pg_url: str) -> None:
    """``throughput.py --matrix`` drains the floors with each settle sent without waiting
    (pipeline mode, through psycopg's private steps) and folded into the next claim (the
    ledger's own statements folded into one too), and the schema floor without its audit
    events, with real
    workers (a task whose write fails fails the drain), and reports each process group's CPU."""
    variants = (
        "floor-async-pipelined",
        "floor-async-combined",
        "floor-ledger-sql-async-pipelined",
        "floor-ledger-sql-async-combined",
        "floor-ledger-sql-async-no-events",
    )
    values = run_table(
        "throughput.py",
        *("--matrix", "--tasks", "20", "--rounds", "1"),
        *("--variants", ",".join(("floor-async", "floor-ledger-sql-async", *variants))),
        redis=redis,
    )
    for variant in variants:
        assert values[variant] > 0, (variant, values)
        for group in ("parent", "pool", "postgres", "redis"):
            assert math.isfinite(values[f"CPU per task, {variant}: {group}"]), (variant, values)
    assert math.isfinite(values["floor-async-combined / floor-async"]), values
    no_events = "floor-ledger-sql-async-no-events / floor-ledger-sql-async"
    assert math.isfinite(values[no_events]), values


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.processes
def test_soak_samples_the_pool_the_ledger_and_beat(redis: str, pg_url: str) -> None:
    """``benchmarks/soak.py`` at a tiny size, with a real worker and beat: every figure of its
    summary is there (memory per pool process, the tables, beat's Redis side, claim p99)."""
    values = run_table(
        "soak.py",
        *("--tasks", "300", "--sample-every", "100", "--retention", "1"),
        *("--sweep-interval", "1", "--beat-every", "1"),
        redis=redis,
    )
    for kind in ("RSS", "PSS", "USS"):
        assert any(m.startswith(f"{kind} growth ") for m in values), values
    for metric in (
        "beat RSS",
        "beat Redis subscribed, max",
        "ledger_entries heap first/max/last",
        "ledger_entries dead tuples, max",
        "entries HOT updates",
        "claim p99, first sample after warm-up",
        "throughput",
    ):
        assert math.isfinite(values[metric]), (metric, values)

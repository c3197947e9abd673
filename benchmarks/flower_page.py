"""What the Ledger page in Flower costs with 1,000,000 entries on PostgreSQL.

    python benchmarks/flower_page.py                       # scratch database, dropped after
    python benchmarks/flower_page.py --entries 100000 --repeat 10
    python benchmarks/flower_page.py --url postgresql://postgres@127.0.0.1/filled --explain

Fills a scratch ledger with SQL (``generate_series``; each key is the SHA-256 of the task
name and task id, as ``entry_key`` makes it): entries over ten task names, mostly
completed as a real ledger is, with a stuck tail (per 10,000 entries: 20 running, half of
them past their lease, 2 interrupted, 3 blocked, 5 retrying, 100 failed), three replay rows
and two audit events per entry. Then it starts a real ``celery flower`` process with the
shipped ``flowerconfig.py`` and basic auth, and times each page over HTTP from here (the
time a browser waits for the HTML, median and 95th percentile of ``--repeat`` requests):

- the overview, first view after Flower started (it waits for ``stats()``, once);
- the overview afterwards (totals served from the page's cache, refreshed in the background);
- the stuck list: first page, the 10th page (keyset cursor), and filtered by kind, task, age;
- an entry page (a blocked entry, its steps and events);
- the link from Flower's task page, by primary key (the task's name given) and by task id.

It also runs each page's statements in this process through the page's own code, records
them, and counts sequential scans of the ledger's tables in their ``EXPLAIN ANALYZE`` plans:
the per-view reads of the overview, the stuck list and the entry page must have none.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from celery import Celery  # noqa: E402
from common import PG_ADMIN, Row, exit_on_sigterm, format_rows, pg_database  # noqa: E402
from sqlalchemy import event, text  # noqa: E402

from celery_ledger.flower import queries as q  # noqa: E402
from celery_ledger.flower import views  # noqa: E402
from celery_ledger.flower.context import LedgerPage  # noqa: E402
from celery_ledger.ledger import LedgerStore  # noqa: E402

USER = "bench:bench"
TARGET_MS = 100.0

FILL_ENTRIES = """
INSERT INTO ledger_entries (key, task_name, task_id, status, fence, side_effect, args_hash,
  snapshot, owner, owner_boot, owner_pid, lease_until, result, reason, executions,
  interruptions, created_at, updated_at, settled_at)
SELECT encode(sha256(convert_to('["' || task || '","tid-' || i || '"]', 'UTF8')), 'hex'),
  task, 'tid-' || i, st, 1,
  'non_idempotent', 'task-id',
  '{"args": [], "kwargs": {"order_id": "o-' || i || '", "card_number": "4111111111111111"},'
    || ' "queue": "celery", "ledger_key": null}',
  CASE WHEN st = 'running' THEN 'celery@bench' END, 'boot', 4242,
  CASE WHEN st = 'running' THEN now_s + CASE WHEN i % 2 = 0 THEN -60 ELSE 60 END END,
  CASE WHEN st = 'completed' THEN '{"ok": true}' END,
  CASE WHEN st = 'blocked' THEN 'step ''charge'' may have executed (external ref: ch_' || i
         || '); reconcile or release'
       WHEN st = 'interrupted' THEN 'pool process lost' END,
  1, CASE WHEN st = 'interrupted' THEN 1 ELSE 0 END,
  now_s - i, now_s - i, CASE WHEN st IN ('completed', 'failed') THEN now_s - i END
FROM (
  SELECT i, extract(epoch FROM now())::float8 AS now_s, 'shop.task_' || (i % 10) AS task,
    CASE WHEN i % 10000 < 20 THEN 'running' WHEN i % 10000 < 22 THEN 'interrupted'
         WHEN i % 10000 < 25 THEN 'blocked' WHEN i % 10000 < 30 THEN 'retrying'
         WHEN i % 10000 < 130 THEN 'failed' ELSE 'completed' END AS st
  FROM generate_series(1, :n) AS i
) AS g
"""
FILL_STEPS = """
INSERT INTO ledger_steps (key, name, input_hash, occurrence, seq, status, output, external_ref,
  fence, attempts, authorized, started_at, completed_at)
SELECT e.key, 'step' || s, 'h', 0, s,
  CASE WHEN e.status = 'blocked' AND s = 2 THEN 'started' ELSE 'completed' END,
  CASE WHEN e.status = 'blocked' AND s = 2 THEN NULL ELSE '"out"' END,
  CASE WHEN s = 2 THEN 'ch_' || e.task_id END,
  1, 1, 0, e.created_at, CASE WHEN e.status = 'blocked' AND s = 2 THEN NULL ELSE e.created_at END
FROM ledger_entries e, generate_series(0, 2) AS s
"""
FILL_EVENTS = """
INSERT INTO ledger_events (key, task_id, fence, event, status, actor, detail, at)
SELECT e.key, e.task_id, 1, ev, CASE WHEN ev = 'claimed' THEN 'running' ELSE e.status END,
  'celery@bench', NULL, e.created_at
FROM ledger_entries e, unnest(ARRAY['claimed', 'settled']) AS ev
"""


def fill(store: LedgerStore, n: int) -> None:
    with store.engine.begin() as conn:
        existing = conn.execute(text("SELECT count(*) FROM ledger_entries")).scalar_one()
        if existing:
            print(f"ledger already holds {existing:,} entries: not filled again")
            return
        for what, sql in (
            ("entries", FILL_ENTRIES),
            ("steps", FILL_STEPS),
            ("events", FILL_EVENTS),
        ):
            started = time.perf_counter()
            conn.execute(text(sql), {"n": n})
            print(f"  filled {what} in {time.perf_counter() - started:.1f}s", flush=True)
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("ledger_entries", "ledger_steps", "ledger_events"):
            conn.execute(text(f"VACUUM ANALYZE {table}"))


# -- Flower, a real process --------------------------------------------------------------------


@contextlib.contextmanager
def flower(url: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryDirectory(prefix="cl_bench_flower_") as tmp:
        env = {
            **os.environ,
            "CELERY_LEDGER_URL": url,
            "CELERY_LEDGER_DATA_DIR": tmp,  # the embedded default broker: no server needed
        }
        log = open(Path(tmp) / "flower.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "celery_ledger.app",
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
                f"--conf={REPO / 'worker' / 'flowerconfig.py'}",
                f"--basic-auth={USER}",
            ],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            while get(port, "/healthcheck")[0] != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"flower did not start:\n{(Path(tmp) / 'flower.log').read_text()}"
                    )
                time.sleep(0.2)
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()


def get(port: int, path: str) -> tuple[int, str, str | None]:
    """(status, body, Location) of one GET with basic auth, redirects not followed."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(USER.encode()).decode())
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), resp.headers.get("Location")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace"), exc.headers.get("Location")
    except OSError:
        return 0, "", None


def timed_get(port: int, path: str, repeat: int, expect: int = 200) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        status, body, _ = get(port, path)
        out.append((time.perf_counter() - started) * 1000)
        if status != expect:
            raise SystemExit(f"GET {path}: {status}, expected {expect}:\n{body[:2000]}")
    return out


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


# -- plans -------------------------------------------------------------------------------------


def record_statements(store: LedgerStore, fn: Callable[[], Any]) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    def listener(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, params))

    event.listen(store.engine, "before_cursor_execute", listener)
    try:
        fn()
    finally:
        event.remove(store.engine, "before_cursor_execute", listener)
    return seen


def plans(store: LedgerStore, statements: list[tuple[str, Any]]) -> list[list[str]]:
    out = []
    with store.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        with raw.cursor() as cur:
            for statement, params in statements:
                cur.execute("EXPLAIN (ANALYZE, COSTS OFF) " + statement, params)
                out.append([r[0] for r in cur.fetchall()])
    return out


def seq_scans(plan_lines: list[str]) -> list[str]:
    return [
        line.strip()
        for line in plan_lines
        if re.search(r"Seq Scan on ledger_(entries|steps|events)", line)
    ]


# -- the run -----------------------------------------------------------------------------------


def run(url: str, args: argparse.Namespace) -> list[Row]:
    store = LedgerStore(url)
    started = time.perf_counter()
    fill(store, args.entries)
    total = int(store.stats().entries)
    print(f"ledger: {total:,} entries ({time.perf_counter() - started:.1f}s to fill and analyze)")
    rows: list[Row] = []
    note = f"{total:,} entries (PostgreSQL)"

    def add(metric: str, values: list[float], target: str = f"< {TARGET_MS:.0f}") -> None:
        med = statistics.median(values)
        rows.append(Row("flower_page", f"{metric} median", med, "ms", target, note))
        rows.append(Row("flower_page", f"{metric} p95", p95(values), "ms", "", note))
        print(f"  {metric}: median {med:.1f} ms, p95 {p95(values):.1f} ms ({len(values)} GETs)")

    with q.reading(store) as conn:
        blocked = conn.execute(
            text(
                "SELECT key, task_id, task_name FROM ledger_entries "
                "WHERE status = 'blocked' LIMIT 1"
            )
        ).one()
    # stats() uncached, for comparison: the query the page keeps off its requests.
    cold = []
    for _ in range(3):
        t0 = time.perf_counter()
        store.stats()
        cold.append((time.perf_counter() - t0) * 1000)
    rows.append(
        Row(
            "flower_page",
            "stats() uncached (not per view)",
            statistics.median(cold),
            "ms",
            "",
            note,
        )
    )
    print(f"  stats() uncached: median {statistics.median(cold):.0f} ms")

    port = args.port
    with flower(url, port):
        first = timed_get(port, "/ledger", 1)
        rows.append(
            Row("flower_page", "overview, first view (waits for stats())", first[0], "ms", "", note)
        )
        print(f"  overview, first view: {first[0]:.0f} ms")
        add("overview (totals cached)", timed_get(port, "/ledger", args.repeat))
        add("stuck list, first page", timed_get(port, "/ledger/stuck", args.repeat))
        path, page_no = "/ledger/stuck", 1
        while page_no < 10:
            _, body, _ = get(port, path)
            found = re.search(r'href="([^"]+)" id="page-next"', body)
            if not found:
                break
            path, page_no = found.group(1).replace("&amp;", "&"), page_no + 1
        add(f"stuck list, page {page_no}", timed_get(port, path, args.repeat))
        add(
            "stuck list, filtered (kind, task, age)",
            timed_get(
                port,
                "/ledger/stuck?kind=blocked&kind=interrupted&task=shop.task_3&age=1h",
                args.repeat,
            ),
        )
        add("entry page (blocked)", timed_get(port, f"/ledger/entry/{blocked.key}", args.repeat))
        add(
            "task link, by key (name given)",
            timed_get(
                port, f"/ledger/task/{blocked.task_id}?name={blocked.task_name}", args.repeat, 302
            ),
            target="",
        )
        add(
            "task link, by task id (no index: a scan)",
            timed_get(port, f"/ledger/task/{blocked.task_id}", max(3, args.repeat // 5), 302),
            target="",
        )
        add(
            "find box, key prefix",
            timed_get(port, f"/ledger/find?q={blocked.key[:12]}", max(3, args.repeat // 5), 302),
            target="",
        )

    # The statements each view runs, and their plans.
    capp = Celery("bench", broker="memory://")
    capp.conf.ledger_url = url
    page = LedgerPage(capp, cli_prefix="celery-ledger")
    page.aggregates.refresh()
    cursor = views.stuck(page, q.StuckFilter(), limit=450, after=None, before=None)["next"]
    checks: dict[str, Callable[[], Any]] = {
        "overview": lambda: views.overview(page, page.aggregates.current()),
        "stuck list, first page": lambda: views.stuck(
            page, q.StuckFilter(), limit=50, after=None, before=None
        ),
        "stuck list, later page": lambda: views.stuck(
            page, q.StuckFilter(), limit=50, after=cursor, before=None
        ),
        "stuck list, filtered": lambda: views.stuck(
            page,
            q.StuckFilter(kinds=("blocked", "interrupted"), task="shop.task_3", min_age=3600),
            limit=50,
            after=None,
            before=None,
        ),
        "entry page": lambda: views.entry(page, blocked.key),
    }
    print("plans (sequential scans of ledger tables per view; expected none):")
    for name, fn in checks.items():
        statements = record_statements(page.store, fn)
        found = plans(page.store, statements)
        scans = [s for p in found for s in seq_scans(p)]
        rows.append(
            Row(
                "flower_page",
                f"seq scans, {name}",
                len(scans),
                "",
                "0",
                f"{len(statements)} statements",
            )
        )
        print(
            f"  {name}: {len(statements)} statements, {len(scans)} sequential scans {scans or ''}"
        )
        if args.explain:
            for (statement, _), plan in zip(statements, found, strict=True):
                print("    " + " ".join(statement.split())[:200])
                for line in plan:
                    if "Scan" in line or "Execution Time" in line:
                        print("      " + line.strip())
    page.store.dispose()
    store.dispose()
    return rows


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--port", type=int, default=0, help="Flower's port (default: a free one)")
    parser.add_argument("--url", help="use (and fill, if empty) this PostgreSQL database")
    parser.add_argument("--pg-admin", default=PG_ADMIN)
    parser.add_argument("--explain", action="store_true", help="print each statement's plan")
    args = parser.parse_args()
    if not args.port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    if args.url:
        rows = run(args.url, args)
    else:
        with pg_database(args.pg_admin) as url:
            rows = run(url, args)
    print()
    print(format_rows(rows))


if __name__ == "__main__":
    main()

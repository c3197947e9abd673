"""Operator commands: list, show, release, resume, sweep, stats, doctor, migrate.

Every command gets a ``worker.cli.LedgerContext`` as ``ctx.obj`` and is installed twice (the
``celery-ledger`` console script and ``celery -A proj ledger``). Rules every command keeps:

- bad input is one line on stderr and exit status 1, and nothing is written: every check
  (arguments, JSON, operator token, the entry's state) runs before the one write;
- human output is a table in click's own formatting, coloured only on a TTY (``click.echo``
  strips styles otherwise; ``NO_COLOR`` or ``celery --no-color`` turns them off too);
- ``--json`` prints one JSON document whose fields are listed in ``docs/operations.md`` and only
  ever grow.

``doctor`` is read-only and never opens the store (the store would refuse an old schema before
doctor could say so); ``migrate`` is the only command that creates or changes the schema.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hmac
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import click
from click.core import ParameterSource
from kombu.utils.json import loads
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from ledger import (
    RESUME_OWNER,
    Entry,
    EntryNotFound,
    EntryStatus,
    Interrupted,
    LedgerError,
    LedgerStore,
    SchemaError,
    SchemaTooNew,
    SideEffect,
    StepStatus,
    Verdict,
)
from ledger.engine import is_sqlite, make_engine, normalize_url
from ledger.migrate import current_revision, ensure_schema, head_revision, pending_revisions
from recovery import resume_entry, run_sweep
from worker.codec import encode

_STATUS_COLOURS = {"running": "cyan", "completed": "green", "failed": "magenta",
                   "retrying": "yellow", "interrupted": "yellow", "blocked": "red"}
_CHECK_COLOURS = {"PASS": "green", "WARN": "yellow", "FAIL": "red"}
#: Brokers that hand an unacked message to another consumer after ``visibility_timeout``.
_VISIBILITY_BROKERS = ("redis", "rediss", "sentinel", "sqs")
_VISIBILITY_DEFAULT = 3600.0  # kombu's default for Redis and SQS


# -- plumbing ---------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every expected failure into a one-line ``Error: ...`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except SchemaError as exc:
            raise click.ClickException(_explain_schema(click.get_current_context(), exc)) from exc
        except (LedgerError, sa_exc.SQLAlchemyError, ValueError, OSError) as exc:
            raise click.ClickException(_one_line(exc)) from exc

    return wrapper


def _explain_schema(ctx: click.Context, exc: SchemaError) -> str:
    """The store says "not at head"; say whether that is old (migrate) or newer (upgrade us)."""
    if isinstance(exc, SchemaTooNew):
        return _one_line(exc)
    try:
        engine = make_engine(ctx.obj.url)
        try:
            with engine.connect() as conn:
                pending_revisions(conn)
        finally:
            engine.dispose()
    except SchemaTooNew as newer:
        return _one_line(newer)
    except Exception:  # noqa: BLE001 - the original message is still right
        pass
    return _one_line(exc)


def _require_existing(url: str) -> None:
    """Refuse a SQLite path that does not exist: opening it would create an empty ledger."""
    if not is_sqlite(url):
        return
    path = make_url(normalize_url(url)).database
    if not path or path == ":memory:":
        raise click.ClickException(f"{url} is an in-memory SQLite database: no ledger to operate")
    if not os.path.exists(path):
        raise click.ClickException(f"no ledger database at {path} (wrong --url? or run "
                                   "`celery-ledger migrate` to create one)")


def _store(ctx: click.Context) -> LedgerStore:
    lctx = ctx.obj
    _require_existing(lctx.url)
    store: LedgerStore = lctx.store
    ctx.call_on_close(store.dispose)
    return store


def _app(ctx: click.Context) -> Any:
    try:
        return ctx.obj.app
    except Exception as exc:  # noqa: BLE001 - an app that does not import is bad input
        raise click.ClickException(f"cannot load the Celery app: {_one_line(exc)}") from exc


def _settings(ctx: click.Context) -> Any:
    from worker.runtime import settings_for

    return settings_for(_app(ctx))


def _prefix(ctx: click.Context) -> str:
    """How this operator invoked us, so that printed commands can be pasted back."""
    root = ctx.find_root()
    if root.info_name == "celery" or "broker" in root.params:
        return f"celery -A {root.params.get('app') or 'proj'} ledger"
    parts = ["celery-ledger"]
    if root.params.get("app_name"):
        parts += ["-A", root.params["app_name"]]
    if root.params.get("url") and root.get_parameter_source("url") is ParameterSource.COMMANDLINE:
        parts += ["--url", make_url(root.params["url"]).render_as_string(hide_password=True)]
    return " ".join(parts)


def _actor() -> str:
    try:
        return f"celery-ledger:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "celery-ledger"


def _echo(ctx: click.Context, text: str = "", *, err: bool = False) -> None:
    root = ctx.find_root()
    plain = bool(os.environ.get("NO_COLOR")) or bool(root.params.get("no_color"))
    click.echo(text, err=err, color=False if plain else None)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _table(ctx: click.Context, header: list[str], rows: list[list[str]],
           colour: Callable[[int, str], str | None] = lambda i, v: None) -> None:
    """Columns padded to their widest cell; colour applied after padding."""
    widths = [max(len(click.unstyle(r[i])) for r in (header, *rows)) for i in range(len(header))]
    widths[-1] = 0  # the last column is never padded: no trailing blanks

    def line(cells: list[str], style: Callable[[int, str], dict[str, Any]]) -> str:
        out = []
        for i, (v, w) in enumerate(zip(cells, widths, strict=True)):
            opts = {k: o for k, o in style(i, v).items() if o}
            out.append(click.style(v.ljust(w), **opts) if opts else v.ljust(w))
        return "  ".join(out).rstrip()

    _echo(ctx, line(header, lambda i, v: {"bold": True}))
    for row in rows:
        _echo(ctx, line(row, lambda i, v: {"fg": colour(i, v)}))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _parse_since(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw[-1:] in units else float(raw)
    except ValueError:
        raise click.ClickException(f"--since {text!r}: give seconds or a duration like 30s, "
                                   "10m, 2h, 1d") from None
    if value < 0:
        raise click.ClickException(f"--since {text!r} must not be negative")
    return value


def _resolve_key(store: LedgerStore, ref: str) -> str:
    """A full key, a key prefix, or a task id, to exactly one key."""
    if not ref.strip():
        raise click.ClickException("give a key, a key prefix or a task id")
    keys = store.find_keys(ref, limit=5)
    if ref in keys:
        return ref
    if not keys:
        raise EntryNotFound(f"no ledger entry matches {ref!r} (a key, a key prefix or a task id)")
    if len(keys) > 1:
        shown = ", ".join(k[:16] for k in keys)
        raise click.ClickException(f"{ref!r} matches several entries ({shown}); give more of "
                                   "the key")
    return keys[0]


# -- what an operator should do next --------------------------------------------------------


@dataclass(frozen=True)
class NextAction:
    #: release | resume | resend | sweep | wait | none
    action: str
    hint: str
    command: str | None = None


def next_action(entry: Entry, now: float, prefix: str) -> NextAction:
    """The one thing that moves this entry on, and the command that does it."""
    key = entry.key
    if entry.status is EntryStatus.BLOCKED:
        return NextAction(
            "release", "release after checking the step",
            f"{prefix} release {key} --verified not-executed|completed --by WHO --reason WHY")
    if entry.status is EntryStatus.INTERRUPTED:
        if entry.snapshot is None:
            return NextAction(
                "resend", f"no argument snapshot: re-send task id {entry.task_id} by hand",
                f"{prefix} release {key} --verified completed --result-json JSON --by WHO "
                "--reason WHY")
        return NextAction("resume", "resume now (or wait for the sweep)",
                          f"{prefix} resume {key}")
    if entry.status is EntryStatus.RUNNING:
        left = None if entry.lease_until is None else entry.lease_until - now
        if left is None or left <= 0:
            return NextAction("sweep", "lease expired: sweep interrupts and resumes it",
                              f"{prefix} sweep")
        if entry.owner == RESUME_OWNER:
            return NextAction("wait", f"re-enqueued, waiting for a worker ({_duration(left)})")
        return NextAction("wait", f"running (lease {_duration(left)} left)")
    if entry.status is EntryStatus.RETRYING:
        return NextAction("wait", "Celery retry pending")
    return NextAction("none", "-")


def entry_view(entry: Entry, now: float, prefix: str) -> dict[str, Any]:
    """One entry as ``list --json`` and ``show --json`` print it."""
    nxt = next_action(entry, now, prefix)
    released = None
    if entry.released_at is not None:
        released = {"by": entry.released_by, "reason": entry.released_reason,
                    "at": entry.released_at, "from_status": entry.released_from}
    return {
        "key": entry.key, "task": entry.task_name, "task_id": entry.task_id,
        "status": entry.status.value, "fence": entry.fence, "owner": entry.owner,
        "side_effect": entry.side_effect,
        "age_seconds": round(now - entry.updated_at, 3),
        "lease_remaining_seconds": (None if entry.lease_until is None
                                    else round(entry.lease_until - now, 3)),
        "created_at": entry.created_at, "updated_at": entry.updated_at,
        "settled_at": entry.settled_at, "executions": entry.executions,
        "interruptions": entry.interruptions, "reason": entry.reason,
        "has_snapshot": entry.snapshot is not None, "released": released,
        "next_action": nxt.action, "hint": nxt.hint, "next_command": nxt.command,
    }


def _status_colour(col: int) -> Callable[[int, str], str | None]:
    return lambda i, v: _STATUS_COLOURS.get(v) if i == col else None


# -- list / show ----------------------------------------------------------------------------


@click.command("list")
@click.option("--stuck", is_flag=True, help="Interrupted, blocked, or running past its lease.")
@click.option("--status", "statuses", multiple=True,
              help="Only these statuses (repeat, or comma-separate).")
@click.option("--task", help="Only this task name.")
@click.option("--since", help="Only entries changed within this long (30s, 10m, 2h, 1d).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def list_cmd(ctx: click.Context, stuck: bool, statuses: tuple[str, ...], task: str | None,
             since: str | None, limit: int, as_json: bool) -> None:
    """Entries, newest change first, with what to do next."""
    wanted = [s.strip() for raw in statuses for s in raw.split(",") if s.strip()]
    known = [s.value for s in EntryStatus]
    bad = [s for s in wanted if s not in known]
    if bad:
        raise click.ClickException(f"unknown status {bad[0]!r}; one of {', '.join(known)}")
    since_seconds = _parse_since(since) if since else None
    store = _store(ctx)
    found = store.list_entries(statuses=wanted or None, task=task, stuck=stuck,
                               since_seconds=since_seconds, limit=limit)
    now = store.now()
    prefix = _prefix(ctx)
    views = [entry_view(e, now, prefix) for e in found]
    if as_json:
        _emit_json({"now": now, "entries": views})
        return
    if not views:
        _echo(ctx, "no entries")
        return
    rows = [[v["key"][:12], v["task"], v["status"], _duration(v["age_seconds"]), str(v["fence"]),
             v["owner"] or "-", v["hint"]] for v in views]
    _table(ctx, ["KEY", "TASK", "STATUS", "AGE", "FENCE", "OWNER", "NEXT"], rows,
           _status_colour(2))


@click.command("show")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def show_cmd(ctx: click.Context, ref: str, as_json: bool) -> None:
    """One entry (REF: key, key prefix or task id): snapshot, steps, events, the fix."""
    store = _store(ctx)
    key = _resolve_key(store, ref)
    entry = store.get_entry(key)
    steps = store.load_steps(key)
    events = store.entry_events(key, limit=1000)
    now = store.now()
    view = entry_view(entry, now, _prefix(ctx))
    view["snapshot"] = loads(entry.snapshot) if entry.snapshot else None
    view["result"] = loads(entry.result) if entry.result else None
    view["error"] = loads(entry.error) if entry.error else None
    view["steps"] = [{
        "name": s.name, "occurrence": s.occurrence, "status": s.status.value,
        "external_ref": s.external_ref, "fence": s.fence, "attempts": s.attempts,
        "authorized": s.authorized, "started_at": s.started_at, "completed_at": s.completed_at,
        "duration_seconds": (None if s.completed_at is None or s.started_at is None
                             else round(s.completed_at - s.started_at, 6)),
        "ambiguous": s.status is StepStatus.STARTED,
    } for s in steps]
    view["events"] = [{"id": e.id, "event": e.event, "status": e.status, "fence": e.fence,
                       "actor": e.actor, "detail": e.detail, "at": e.at, "task_id": e.task_id}
                      for e in events]
    if as_json:
        view["now"] = now
        _emit_json(view)
        return
    fields = [
        ("key", view["key"]), ("task", f"{view['task']}  (task id {view['task_id']})"),
        ("status", view["status"]), ("reason", view["reason"] or "-"),
        ("fence", str(view["fence"])), ("owner", view["owner"] or "-"),
        ("lease", _duration(view["lease_remaining_seconds"]) + " left"
         if view["lease_remaining_seconds"] is not None else "-"),
        ("side effect", view["side_effect"]),
        ("runs", f"{view['executions']} execution(s), {view['interruptions']} interruption(s)"),
        ("created", _when(entry.created_at)), ("updated", _when(entry.updated_at)),
        ("arguments", json.dumps(view["snapshot"], default=str) if view["snapshot"]
         else "no snapshot (cannot be re-enqueued)"),
    ]
    if entry.result is not None:
        fields.append(("result", json.dumps(view["result"], default=str)[:200]))
    if view["released"]:
        r = view["released"]
        fields.append(("released", f"by {r['by']} at {_when(r['at'])} from {r['from_status']}: "
                                   f"{r['reason']}"))
    formatter = click.HelpFormatter(width=120)
    formatter.write_dl(fields, col_max=14)
    _echo(ctx, formatter.getvalue().rstrip())
    _echo(ctx)
    _echo(ctx, click.style("steps", bold=True))
    if steps:
        _table(ctx, ["NAME", "OCC", "STATUS", "EXTERNAL REF", "RUNS", "STARTED", "TOOK"], [
            [s["name"], str(s["occurrence"]), s["status"] + (" (ambiguous)" if s["ambiguous"]
                                                             else ""),
             s["external_ref"] or "-", f"{s['attempts']} ({s['authorized']} authorized)",
             _when(s["started_at"]), f"{s['duration_seconds']:.3f}s"
             if s["duration_seconds"] is not None else "-"]
            for s in view["steps"]], lambda i, v: "red" if i == 2 and "ambiguous" in v else None)
    else:
        _echo(ctx, "  (none recorded)")
    _echo(ctx)
    _echo(ctx, click.style("events", bold=True))
    _table(ctx, ["AT", "EVENT", "STATUS", "FENCE", "ACTOR", "DETAIL"], [
        [_when(e["at"]), e["event"], e["status"] or "-", str(e["fence"]), e["actor"] or "-",
         e["detail"] or ""] for e in view["events"]], _status_colour(2))
    _echo(ctx)
    _echo(ctx, f"next: {view['hint']}")
    if view["next_command"]:
        _echo(ctx, f"  {view['next_command']}")


# -- release / resume / sweep ---------------------------------------------------------------


def _parse_verdict(raw: str | None) -> Verdict:
    value = (raw or "").strip().lower().replace("_", "-")
    if value == "completed":
        return Verdict.COMPLETED
    if value == "not-executed":
        return Verdict.NOT_EXECUTED
    raise click.ClickException(
        f"--verified must be 'completed' or 'not-executed', not {raw!r}" if raw
        else "--verified completed|not-executed is required")


def _parse_result(text: str | None, verdict: Verdict, limit: int) -> str | None:
    if verdict is Verdict.NOT_EXECUTED:
        if text is not None:
            raise click.ClickException("--result-json goes with --verified completed only")
        return None
    if text is None:
        raise click.ClickException("--verified completed needs --result-json (the task's "
                                   "result; 'null' for none)")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        raise click.ClickException(f"--result-json is not valid JSON: {_one_line(exc)}") from None
    return encode(value, limit=limit, what="--result-json")


def _authorize(tokens: frozenset[str], by: str) -> None:
    """When operator tokens are configured, ``--by`` must be one of them."""
    if not tokens:
        return
    # compare_digest on every token: the time taken does not say how close a guess came.
    if not any(hmac.compare_digest(by.encode(), t.encode()) for t in tokens):
        raise click.ClickException("--by does not match any operator token "
                                   "(CELERY_LEDGER_OPERATOR_TOKENS); nothing was released")


@click.command("release")
@click.argument("ref")
@click.option("--verified", "verified_raw", metavar="completed|not-executed",
              help="Your verdict on the ambiguous step.  [required]")
@click.option("--by", help="Who releases (an operator token when tokens are set).  [required]")
@click.option("--reason", help="Why; kept on the entry and in the events.  [required]")
@click.option("--result-json", help="With --verified completed: the task's result, as JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def release_cmd(ctx: click.Context, ref: str, verified_raw: str | None, by: str | None,
                reason: str | None, result_json: str | None, as_json: bool) -> None:
    """Resolve a stuck entry once: it ran (completed) or it did not (not-executed)."""
    verdict = _parse_verdict(verified_raw)
    if not by or not by.strip():
        raise click.ClickException("--by WHO is required: a release is stamped with its author")
    if not reason or not reason.strip():
        raise click.ClickException("--reason WHY is required: a release is stamped with its why")
    settings = _settings(ctx)
    result = _parse_result(result_json, verdict, settings.max_result_bytes)
    _authorize(settings.operator_tokens, by)
    store = _store(ctx)
    key = _resolve_key(store, ref)
    # One-shot, live-lease and completed refusals are decided in the release transaction.
    rel = store.release(key, verdict, by=by, reason=reason, result=result)
    outcome = None
    if rel.to_status is EntryStatus.INTERRUPTED:
        outcome = "no-snapshot"
        if rel.snapshot is not None:
            outcome = resume_entry(
                store, _app(ctx), Interrupted(key, rel.task_name, rel.task_id, rel.fence),
                lease_seconds=settings.lease_seconds, max_resumes=settings.max_resumes,
                actor=by)
    data = {"key": key, "verified": verdict.value, "by": by, "reason": reason,
            "from_status": rel.from_status.value, "to_status": rel.to_status.value,
            "fence": rel.fence, "steps_released": list(rel.steps_released),
            "task": rel.task_name, "task_id": rel.task_id, "resume": outcome}
    if as_json:
        _emit_json(data)
        return
    _echo(ctx, f"released {key} ({rel.task_name}): {rel.from_status.value} -> "
               f"{rel.to_status.value}, fence {rel.fence}, verified {verdict.value} by {by}")
    if rel.steps_released:
        _echo(ctx, f"authorized one more run of: {', '.join(rel.steps_released)}")
    if outcome == "resumed":
        _echo(ctx, f"re-enqueued as task id {rel.task_id}")
    elif outcome == "no-snapshot":
        _echo(ctx, f"no argument snapshot: re-send task id {rel.task_id} by hand; it stays "
                   "interrupted until then")
    elif outcome is not None:
        _echo(ctx, f"not re-enqueued ({outcome}); the sweep will pick it up")


@click.command("resume")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def resume_cmd(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Re-enqueue an interrupted entry now, with its task id and argument snapshot."""
    store = _store(ctx)
    key = _resolve_key(store, ref)
    entry = store.get_entry(key)
    if entry.status is not EntryStatus.INTERRUPTED:
        hint = next_action(entry, store.now(), _prefix(ctx))
        raise click.ClickException(f"{key} is {entry.status.value}, not interrupted; "
                                   f"next: {hint.hint}")
    if entry.snapshot is None:
        raise click.ClickException(f"{key} has no argument snapshot; re-send task id "
                                   f"{entry.task_id} by hand")
    settings = _settings(ctx)
    outcome = resume_entry(
        store, _app(ctx),
        Interrupted(key, entry.task_name, entry.task_id, entry.fence, entry.interruptions),
        lease_seconds=settings.lease_seconds, max_resumes=settings.max_resumes, actor=_actor())
    if as_json:
        _emit_json({"key": key, "task": entry.task_name, "task_id": entry.task_id,
                    "outcome": outcome})
    elif outcome == "resumed":
        _echo(ctx, f"re-enqueued {key} ({entry.task_name}) as task id {entry.task_id}")
    if outcome == "blocked":
        raise click.ClickException(f"{key} was interrupted {entry.interruptions} times "
                                   f"(ledger_max_resumes={settings.max_resumes}): blocked as a "
                                   "crash loop; inspect it and release it")
    if outcome == "lost-race":
        raise click.ClickException(f"{key} was not re-enqueued: another resumer moved it first, "
                                   "or the broker refused the message")


@click.command("sweep")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def sweep_cmd(ctx: click.Context, as_json: bool) -> None:
    """Run one recovery sweep now (what beat's celery-ledger-sweep runs) and report it."""
    store = _store(ctx)
    settings = _settings(ctx)
    # run_sweep with *this* store, not the app's: `--url` may name another ledger than the app.
    report = run_sweep(store, _app(ctx), lease_seconds=settings.lease_seconds,
                       max_resumes=settings.max_resumes, retention_days=settings.retention_days,
                       batch=settings.sweep_batch, actor=_actor())
    if as_json:
        _emit_json(report.as_dict())
        return
    data = report.as_dict()
    keys = data.pop("resumed_keys")
    formatter = click.HelpFormatter()
    formatter.write_dl([(k.replace("_", " "), str(v)) for k, v in data.items()])
    _echo(ctx, formatter.getvalue().rstrip())
    for key in keys:
        _echo(ctx, f"  resumed {key}")


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def stats_cmd(ctx: click.Context, as_json: bool) -> None:
    """Entries by status, blocked, oldest running, duplicate-execution rate (target 0.0)."""
    stats = _store(ctx).stats()
    data = {
        "by_status": stats.by_status, "blocked": stats.by_status.get("blocked", 0),
        "expired_running": stats.expired_running,
        "oldest_running_age_seconds": round(stats.oldest_running_age, 3),
        "interruptions": stats.interruptions, "entries": stats.entries,
        "duplicate_executions": stats.duplicate_executions,
        "duplicate_execution_rate": stats.duplicate_execution_rate,
        "by_task": [{"task": t, "status": s, "count": n}
                    for (t, s), n in sorted(stats.by_task_status.items())],
    }
    if as_json:
        _emit_json(data)
        return
    _table(ctx, ["STATUS", "ENTRIES"], [[s, str(n)] for s, n in stats.by_status.items()],
           _status_colour(0))
    _echo(ctx)
    formatter = click.HelpFormatter()
    formatter.write_dl([
        ("blocked", str(data["blocked"])),
        ("expired leases", str(stats.expired_running)),
        ("oldest running", _duration(stats.oldest_running_age)),
        ("interruptions", str(stats.interruptions)),
        ("entries", str(stats.entries)),
        ("duplicates", str(stats.duplicate_executions)),
        ("duplicate rate", f"{stats.duplicate_execution_rate:.4f} (target 0.0)"),
    ])
    _echo(ctx, formatter.getvalue().rstrip())


# -- doctor -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    reason: str


def _check_schema(url: str) -> Check:
    if is_sqlite(url):
        path = make_url(normalize_url(url)).database
        if path and path != ":memory:" and not os.path.exists(path):
            return Check("schema", "FAIL", f"no ledger database at {path}: run "
                                           "`celery-ledger migrate`")
    try:
        engine = make_engine(url)
    except (ValueError, sa_exc.ArgumentError) as exc:
        return Check("schema", "FAIL", _one_line(exc))
    try:
        with engine.connect() as conn:
            current = current_revision(conn)
            pending = pending_revisions(conn)
    except SchemaTooNew as exc:
        return Check("schema", "FAIL", _one_line(exc))
    except sa_exc.SQLAlchemyError as exc:
        return Check("schema", "FAIL",
                     f"ledger unreachable: {_one_line(getattr(exc, 'orig', None) or exc)}")
    finally:
        engine.dispose()
    if pending:
        return Check("schema", "FAIL", f"schema at {current!r}, {len(pending)} revision(s) "
                                       f"pending ({', '.join(pending)}): run `celery-ledger "
                                       "migrate`")
    return Check("schema", "PASS", f"schema current ({head_revision()})")


def _check_backend(url: str, app: Any, store: LedgerStore | None) -> Check:
    if not is_sqlite(url):
        return Check("backend", "PASS", "PostgreSQL: durable and shared by every node")
    path = make_url(normalize_url(url)).database
    if not path or path == ":memory:":
        return Check("backend", "FAIL", "in-memory SQLite: the ledger dies with the process")
    broker = str(app.conf.broker_url or "")
    if not broker.startswith(("filesystem", "memory")):
        return Check("backend", "WARN", f"SQLite ledger with broker {broker.split(':')[0]}://: "
                                        "workers on other hosts cannot share one SQLite file; "
                                        "use PostgreSQL for several nodes")
    if store is not None:
        hosts = {e.owner.rsplit("@", 1)[-1] for e in store.list_entries(limit=500)
                 if e.owner and e.owner != RESUME_OWNER}
        if len(hosts) > 1:
            return Check("backend", "WARN", f"SQLite ledger written from {len(hosts)} hosts "
                                            f"({', '.join(sorted(hosts))}): use PostgreSQL")
    return Check("backend", "PASS", f"SQLite (WAL) at {path}: durable on this one machine")


def _ledger_tasks(app: Any) -> list[Any]:
    from worker.task import LedgerTask

    return [t for name, t in sorted(app.tasks.items()) if isinstance(t, LedgerTask)]


def _check_visibility(app: Any, settings: Any, tasks: list[Any]) -> Check:
    broker = str(app.conf.broker_url or "")
    scheme = broker.split(":", 1)[0].split("+")[0]
    lease = max([settings.lease_seconds] + [float(t.lease_seconds) for t in tasks
                                             if t.lease_seconds])
    if scheme not in _VISIBILITY_BROKERS:
        if scheme in ("amqp", "amqps", "pyamqp"):
            return Check("visibility", "PASS", "RabbitMQ redelivers only when the consumer dies "
                                               "(mind consumer_timeout for tasks over 30 min)")
        return Check("visibility", "PASS", f"{scheme or 'default'} broker has no visibility "
                                           "timeout")
    options = app.conf.broker_transport_options or {}
    vt = float(options.get("visibility_timeout", _VISIBILITY_DEFAULT))
    if lease > vt:
        return Check("visibility", "WARN", f"lease {lease:.0f}s > visibility_timeout {vt:.0f}s: "
                                           f"{scheme} redelivers a task still holding its lease; "
                                           "the copy meets the WAIT gate and re-queues itself "
                                           "until the lease ends (no duplicate, extra traffic)")
    return Check("visibility", "PASS", f"visibility_timeout {vt:.0f}s >= lease {lease:.0f}s; a "
                                       "task running longer is redelivered and waits on its "
                                       "lease, never runs beside it")


def _check_acks(app: Any, tasks: list[Any]) -> Check:
    early = [t.name for t in tasks if not t.acks_late]
    lost = [t.name for t in tasks if not t.reject_on_worker_lost]
    prefetch = int(app.conf.worker_prefetch_multiplier or 0)
    problems = []
    if early:
        problems.append(f"acks_late off for {', '.join(early)} (a crash loses the message; only "
                        "the sweep finds it)")
    if lost:
        problems.append(f"reject_on_worker_lost off for {', '.join(lost)} (a killed pool process"
                        " waits for the sweep)")
    if prefetch != 1:
        problems.append(f"worker_prefetch_multiplier={prefetch} (prefetched messages wait where a"
                        " crash strands them; 1 recommended)")
    if problems:
        return Check("acks", "WARN", "; ".join(problems))
    return Check("acks", "PASS", f"{len(tasks)} ledger task(s) ack late, requeue on worker loss,"
                                 " prefetch 1")


def _check_beat(app: Any, settings: Any, store: LedgerStore | None) -> Check:
    from worker.app import BEAT_ENTRY

    if BEAT_ENTRY not in (app.conf.beat_schedule or {}):
        return Check("beat", "FAIL", f"no {BEAT_ENTRY!r} in beat_schedule: nothing finds work "
                                     "whose worker died (call worker.install(app))")
    if store is not None:
        now = store.now()
        late = [e for e in store.list_entries(statuses=["running"], stuck=True, limit=100)
                if e.lease_until is not None
                and e.lease_until < now - 2 * settings.sweep_interval]
        if late:
            return Check("beat", "WARN", f"{BEAT_ENTRY} scheduled, but {len(late)} lease(s) "
                                         f"expired over {2 * settings.sweep_interval:.0f}s ago "
                                         "are unswept: is `celery beat` running?")
    return Check("beat", "PASS", f"{BEAT_ENTRY} every {settings.sweep_interval:.0f}s")


def _check_reconcilers(tasks: list[Any]) -> Check:
    risky = (SideEffect.NON_IDEMPOTENT.value, SideEffect.IRREVERSIBLE.value)
    bare = [t.name for t in tasks if t.side_effect in risky and t.reconciler is None]
    if bare:
        return Check("reconcilers", "WARN", f"{len(bare)} non-idempotent task(s) without a "
                                            f"reconciler block on every ambiguous step: "
                                            f"{', '.join(bare)}")
    return Check("reconcilers", "PASS", "every non-idempotent ledger task has a reconciler")


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def doctor_cmd(ctx: click.Context, as_json: bool) -> None:
    """Read-only checks of the ledger and the app's settings; exit 1 on any FAIL."""
    from worker.runtime import settings_for

    app = _app(ctx)
    url = ctx.obj.url
    settings = settings_for(app)
    with contextlib.suppress(Exception):  # doctor reports what it can see
        app.loader.import_default_modules()  # tasks listed in `imports`/`include`
    tasks = _ledger_tasks(app)
    schema = _check_schema(url)
    store = None
    if schema.status == "PASS":
        store = LedgerStore(url, migrate=False)
        ctx.call_on_close(store.dispose)
    checks = [schema, _check_backend(url, app, store), _check_visibility(app, settings, tasks),
              _check_acks(app, tasks), _check_beat(app, settings, store),
              _check_reconcilers(tasks)]
    failed = any(c.status == "FAIL" for c in checks)
    if as_json:
        _emit_json({"app": app.main, "ok": not failed,
                    "checks": [asdict(c) for c in checks]})
    else:
        _table(ctx, ["CHECK", "RESULT", "WHY"], [[c.name, c.status, c.reason] for c in checks],
               lambda i, v: _CHECK_COLOURS.get(v) if i == 1 else None)
    if failed:
        ctx.exit(1)


# -- migrate ----------------------------------------------------------------------------------


@click.command("migrate")
@click.option("--plan", is_flag=True, help="Show pending schema revisions; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see docs/operations.md).")
@click.pass_context
@guarded
def migrate_cmd(ctx: click.Context, plan: bool, as_json: bool) -> None:
    """Create or upgrade the ledger schema (under a lock; safe beside running workers)."""
    url = ctx.obj.url
    if plan:
        _require_existing_or_empty_plan(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = current_revision(conn)
            pending = pending_revisions(conn)
        applied = [] if plan else ensure_schema(engine)
    except sa_exc.OperationalError as exc:
        raise click.ClickException(f"ledger database unavailable: {_one_line(exc.orig or exc)}"
                                   ) from exc
    finally:
        engine.dispose()
    data = {"current": current, "head": head_revision(), "pending": pending,
            "applied": applied, "plan": plan}
    if as_json:
        _emit_json(data)
    elif plan:
        _echo(ctx, f"schema at {current!r}, head {head_revision()!r}: " + (
            f"{len(pending)} pending: {', '.join(pending)}" if pending else "nothing to do"))
    else:
        _echo(ctx, f"applied {', '.join(applied)}; schema at {head_revision()!r}" if applied
              else f"schema already at {head_revision()!r}")


def _require_existing_or_empty_plan(url: str) -> None:
    """``--plan`` changes nothing: a missing SQLite file is reported, not created."""
    if is_sqlite(url):
        path = make_url(normalize_url(url)).database
        if path and path != ":memory:" and not os.path.exists(path):
            raise click.ClickException(f"no ledger database at {path}; `migrate` without --plan "
                                       f"creates it at revision {head_revision()!r}")


COMMANDS = [list_cmd, show_cmd, release_cmd, resume_cmd, sweep_cmd, stats_cmd, doctor_cmd,
            migrate_cmd]

"""What every operator command shares: error handling, output, the store and the app.

Rules every command keeps:

- bad input is one line on stderr and exit status 1, and nothing is written: every check
  (arguments, JSON, operator token, the entry's state) runs before the one write;
- human output is a table in click's own formatting, coloured only on a TTY (``click.echo``
  strips styles otherwise; ``NO_COLOR`` or ``celery --no-color`` turns them off too);
- ``--json`` prints one JSON document whose fields are listed in ``docs/operations.md`` and only
  ever grow.
"""

from __future__ import annotations

import functools
import getpass
import json
import math
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from celery_ledger.ledger import (
    EntryNotFound,
    LedgerError,
    LedgerStore,
    SchemaError,
    SchemaTooNew,
)
from celery_ledger.ledger.engine import is_sqlite, make_engine, parse_url
from celery_ledger.ledger.errors import as_unavailable
from celery_ledger.ledger.migrate import pending_revisions
from celery_ledger.view import one_line, parse_duration

STATUS_COLOURS = {
    "running": "cyan",
    "completed": "green",
    "failed": "magenta",
    "retrying": "yellow",
    "interrupted": "yellow",
    "blocked": "red",
    "scheduled": "blue",
    "sleeping": "blue",
    "cancelled": "magenta",
    "expired": "magenta",
}
CHECK_COLOURS = {"PASS": "green", "WARN": "yellow", "FAIL": "red"}

# -- plumbing ---------------------------------------------------------------------------------


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every expected failure into a one-line ``Error: ...`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except SchemaError as exc:
            raise click.ClickException(explain_schema(click.get_current_context(), exc)) from exc
        except sa_exc.DBAPIError as exc:
            # A database error no store method translated (doctor, migrate): the ledger's one
            # classification, in the driver's words, never SQLAlchemy's wrapper text.
            raise click.ClickException(one_line(as_unavailable(exc) or exc.orig or exc)) from exc
        except (LedgerError, sa_exc.SQLAlchemyError, ValueError, OSError) as exc:
            raise click.ClickException(one_line(exc)) from exc

    return wrapper


def explain_schema(ctx: click.Context, exc: SchemaError) -> str:
    """The store says "not at head"; say whether that is old (migrate) or newer (upgrade us)."""
    if isinstance(exc, SchemaTooNew):
        return one_line(exc)
    try:
        engine = make_engine(ctx.obj.url)
        try:
            with engine.connect() as conn:
                pending_revisions(conn)
        finally:
            engine.dispose()
    except SchemaTooNew as newer:
        return one_line(newer)
    except Exception:  # noqa: BLE001 - the original message is still right
        pass
    return one_line(exc)


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite ledger URL (None: not SQLite, or in memory)."""
    if not is_sqlite(url):
        return None
    path = parse_url(url).database
    return None if not path or path == ":memory:" else path


def sqlite_file_problem(path: str) -> str | None:
    """Why the file at ``path`` is no ledger to operate on: missing, empty, or not a SQLite
    file. None when it is a SQLite file (the schema says the rest).

    Nothing here opens the file with ``open()``: closing any descriptor of a file drops every
    POSIX lock this process holds on it, SQLite's included, and a process that holds ledger
    connections (``celery-ledger`` called in-process) would lose them; another process could
    then delete the WAL those connections still use. The size comes from ``stat``, and the
    header is read by SQLite itself, read-only (it shares this process's descriptors of the
    file instead of closing one, and writes nothing into an empty file).
    """
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return (
            f"no ledger database at {path} (wrong --url? or run `celery-ledger migrate` to "
            "create one)"
        )
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if size == 0:
        return (
            f"{path} is an empty file: no ledger schema yet (empty database); run "
            "`celery-ledger migrate` to create one"
        )
    uri = f"{Path(path).resolve().as_uri()}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc):
            return f"{path} is not a celery-ledger database (not an SQLite file; wrong --url?)"
        return f"cannot read {path}: {exc}"
    return None


def require_existing(url: str) -> None:
    """Refuse a SQLite file that is not there, empty, or not SQLite: opening it would create
    (or write the header of) an empty ledger, or fail in the driver's words."""
    if not is_sqlite(url):
        return
    path = sqlite_path(url)
    if path is None:
        raise click.ClickException(f"{url} is an in-memory SQLite database: no ledger to operate")
    problem = sqlite_file_problem(path)
    if problem is not None:
        raise click.ClickException(problem)


def printable(text: Any, *, limit: int | None = None) -> str:
    """``text`` safe to print on a terminal: control characters and terminal escapes are
    shown escaped (``\\x1b``, ``\\n``), never sent; cut at ``limit`` characters with a note."""
    value = "" if text is None else str(text)
    cut = ""
    if limit is not None and len(value) > limit:
        cut = f"… ({len(value) - limit} more characters)"
        value = value[:limit]
    safe = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value
    )
    return safe + cut


def open_store(ctx: click.Context) -> LedgerStore:
    lctx = ctx.obj
    require_existing(lctx.url)
    store: LedgerStore = lctx.store
    ctx.call_on_close(store.dispose)
    return store


def load_app(ctx: click.Context) -> Any:
    try:
        return ctx.obj.app
    except Exception as exc:
        raise click.ClickException(f"cannot load the Celery app: {one_line(exc)}") from exc


def sending_app(ctx: click.Context) -> Any:
    """The Celery app a command sends a task through (``resume``).

    Raises:
        click.ClickException: no ``-A`` was given and the embedded default's broker folder
            does not exist here: a message sent there would wait for a worker that never
            reads it (the CLI creates no ``./.celery-ledger``).
    """
    from celery_ledger import fsbroker

    app = load_app(ctx)
    folder = None
    if app.conf.broker_transport == fsbroker.TRANSPORT:
        folder = (app.conf.broker_transport_options or {}).get("data_folder_in")
    if folder and not Path(folder).is_dir():
        raise click.ClickException(
            f"no embedded broker at {folder}: give -A with the app whose workers run the "
            "task, or run from its project directory, or set CELERY_LEDGER_DATA_DIR"
        )
    return app


def load_settings(ctx: click.Context) -> Any:
    from celery_ledger.runtime import settings_for

    return settings_for(load_app(ctx))


def command_prefix(ctx: click.Context) -> str:
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


def operator_actor() -> str:
    try:
        return f"celery-ledger:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "celery-ledger"


def echo(ctx: click.Context, text: str = "", *, err: bool = False) -> None:
    root = ctx.find_root()
    plain = bool(os.environ.get("NO_COLOR")) or bool(root.params.get("no_color"))
    click.echo(text, err=err, color=False if plain else None)


def emit_json(data: Any) -> None:
    """Strict JSON: a stored time that is no finite number (an infinite ``due_at``) is
    printed as its text ("inf", "nan"), never as ``Infinity``, which JSON parsers refuse."""
    click.echo(json.dumps(_finite(data), indent=2, sort_keys=True, default=str, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def print_table(
    ctx: click.Context,
    header: list[str],
    rows: list[list[str]],
    colour: Callable[[int, str], str | None] = lambda i, v: None,
) -> None:
    """Columns padded to their widest cell; colour applied after padding. Every cell is
    printed ``printable``: stored text never reaches the terminal raw."""
    header = [printable(h) for h in header]
    rows = [[printable(c) for c in row] for row in rows]
    widths = [max(len(click.unstyle(r[i])) for r in (header, *rows)) for i in range(len(header))]
    widths[-1] = 0  # the last column is never padded: no trailing blanks

    def line(cells: list[str], style: Callable[[int, str], dict[str, Any]]) -> str:
        out = []
        for i, (v, w) in enumerate(zip(cells, widths, strict=True)):
            opts = {k: o for k, o in style(i, v).items() if o}
            out.append(click.style(v.ljust(w), **opts) if opts else v.ljust(w))
        return "  ".join(out).rstrip()

    echo(ctx, line(header, lambda i, v: {"bold": True}))
    for row in rows:
        echo(ctx, line(row, lambda i, v: {"fg": colour(i, v)}))


def parse_since(text: str) -> float:
    """``--since``: seconds or a duration like 30s, 10m, 2h, 1d (``parse_duration``)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def resolve_key(store: LedgerStore, ref: str) -> str:
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
        raise click.ClickException(
            f"{ref!r} matches several entries ({shown}); give more of the key"
        )
    return keys[0]


def status_colour(col: int) -> Callable[[int, str], str | None]:
    return lambda i, v: STATUS_COLOURS.get(v) if i == col else None

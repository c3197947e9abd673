"""Count the moves of one RUN delivery, from ``LedgerTask.__call__`` to the first line of the body
(design.md § "The delivery as a table").

    python benchmarks/delivery_moves.py [-v]

One warm-up delivery, then one traced (eager ``apply()`` on a SQLite ledger: the code path of a
worker's pool process, without the broker), with ``sys.settrace`` (Python functions only).

- delivery moves: calls made by the delivery's own code (``worker/task.py`` and
  ``worker/delivery.py``) to functions of ``celery_ledger``, each with its return: the steps a
  reader takes following the delivery, stepping into each callee once.
- task.py re-entries: calls into a function of ``worker/task.py`` after ``__call__``.
- at any depth: how many times the code running changes file (among ``celery_ledger``'s;
  Celery, SQLAlchemy and the standard library are stepped over), and how many of those
  changes go back into ``worker/task.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from celery import Celery

import celery_ledger.task as task_module
from celery_ledger import LedgerTask, install


def _real(path: str, cache: dict[str, str] = {}) -> str:  # noqa: B006 - a cache on purpose
    if path not in cache:
        cache[path] = os.path.realpath(path)
    return cache[path]


TASK_PY = _real(task_module.__file__)
WORKER = str(Path(TASK_PY).parent) + os.sep
REPO = str(Path(WORKER).parent) + os.sep
OURS = tuple(REPO + d + os.sep for d in ("worker", "ledger", "recovery"))
DELIVERY = {TASK_PY, WORKER + "delivery.py"}


class Moves:
    """A ``sys.settrace`` tracer that counts from the entry of ``__call__`` to ``body``."""

    def __init__(self, body: Any) -> None:
        self.body = body
        self.on = self.done = False
        self.file: str | None = None
        self.delivery_calls: list[str] = []
        self.task_entries: list[str] = []
        self.switches: list[str] = []
        self.back_into_task = 0

    def _in(self, path: str) -> None:
        if path == self.file or not path.startswith(OURS):
            return
        if self.file is not None:
            self.switches.append(f"{Path(self.file).name} -> {Path(path).name}")
            self.back_into_task += path == TASK_PY
        self.file = path

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.done:
            return None
        code = frame.f_code
        path = _real(code.co_filename)
        if not self.on:
            if event == "call" and code.co_name == "__call__" and path == TASK_PY:
                self.on = True
                self._in(path)
                return self
            return None
        if event == "return" and frame.f_back is not None:
            self._in(_real(frame.f_back.f_code.co_filename))
        if event != "call":
            return self
        if code is self.body.run.__code__:
            self.done = True
            return None
        self._in(path)
        if code.co_name.startswith("<"):
            return self  # comprehensions, generator expressions
        caller = _real(frame.f_back.f_code.co_filename) if frame.f_back else ""
        if caller in DELIVERY and path.startswith(OURS) and "harness" not in path:
            self.delivery_calls.append(f"{Path(caller).name} -> {Path(path).name}:{code.co_name}")
        if path == TASK_PY:
            self.task_entries.append(code.co_name)
        return self


def main() -> None:
    app = Celery("moves", broker="memory://", backend="cache+memory://")
    app.conf.ledger_url = f"sqlite:///{tempfile.mkdtemp()}/ledger.sqlite3"
    install(app)

    @app.task(base=LedgerTask, bind=True, name="moves.body")
    def body(self: LedgerTask, x: int) -> int:
        return x

    body.apply(args=(1,))  # warm-up: engine, schema, caches
    moves = Moves(body)
    sys.settrace(moves)
    result = body.apply(args=(2,))
    sys.settrace(None)
    assert result.status == "SUCCESS", result.result
    calls = moves.delivery_calls
    print(f"delivery moves: {2 * len(calls)} ({len(calls)} calls and their returns)")
    print(f"task.py re-entries: {len(moves.task_entries)} {moves.task_entries}")
    print(
        f"at any depth: {len(moves.switches)} file changes, "
        f"{moves.back_into_task} of them into task.py"
    )
    if "-v" in sys.argv:
        print("\n".join("  " + c for c in calls))


if __name__ == "__main__":
    main()

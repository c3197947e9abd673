"""Tasks for the outbox's hostile-input tests (guarantees.md § "Bad input", items 2, 7, 8), on
``tests_app``'s app.

A worker loads them with ``celery -A tests_app worker -I outbox_app`` (``OUTBOX_TASKS``). Each
task sends one child through the outbox from an effect step; ``kind`` picks what is wrong with
it. A good child is ``tests_app.child_effect``: one row in ``test_effects`` when it runs.
"""

from __future__ import annotations

from typing import Any

from celery_ledger import LedgerTask
from tests_app import app, child_effect, effect

#: Worker option that imports this module.
OUTBOX_TASKS = ["-I", "outbox_app"]


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def bad_child(kind: str, tag: str) -> Any:
    """The child ``send_bad`` sends: a misuse of ``self.send()`` (items 7, 8), or an option
    the broker publish would refuse every time (item 2)."""
    good = child_effect.s(tag, 0)
    misuses: dict[str, Any] = {
        "good": lambda: good,
        "eta": lambda: good.set(eta="2030-01-01T00:00:00"),
        "task_id": lambda: good.set(task_id="mine"),
        "string": lambda: "tests_app.child_effect",
        "not-json": lambda: child_effect.s(tag, object()),
        "huge": lambda: child_effect.s(tag, "x" * (20 * 1024 * 1024)),
        "nested": lambda: child_effect.s(tag, _nested(503)),
        "countdown-nan": lambda: good.set(countdown=float("nan")),
        "countdown-soon": lambda: good.set(countdown="soon"),
        "countdown-huge": lambda: good.set(countdown=1e12),
        "expires-nan": lambda: good.set(expires=float("nan")),
        "priority-word": lambda: good.set(priority="high"),
    }
    return misuses[kind]()


@app.task(shared=False, base=LedgerTask, bind=True, name="outbox_app.send_bad", key_from=("tag",))
def send_bad(self: LedgerTask, tag: str, kind: str) -> str:
    """An effect step that charges, then sends ``bad_child(kind)``."""

    def charge() -> str:
        effect(tag, "charge")
        return self.send(bad_child(kind, tag))

    return self.step("charge", charge)


@app.task(shared=False, base=LedgerTask, bind=True, name="outbox_app.send_unknown")
def send_unknown(self: LedgerTask, tag: str) -> str:
    """Sends a child by the name of a task that no app registers."""

    def notify() -> str:
        return self.send(app.signature("outbox_app.nobody_has_this", args=(tag,)))

    return self.step("notify", notify)

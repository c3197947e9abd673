"""Reconcilers: read-only answers about a step that may have executed.

A reconciler is a callable ``fn(step: AmbiguousStep) -> Reconciled`` that looks at the outside
world (usually through the external reference the step recorded before its call) and answers
``completed(output)``, ``not_executed()`` or ``unknown()``. Raising, returning anything else,
or taking longer than the timeout all mean ``unknown``: the only answers that let work
continue are the ones a reconciler gave explicitly.

A step's children (``self.send``) are recorded with its ``completed`` row, so a step that died
before that row recorded none, and a ``completed`` verdict means its body never runs again to
send them. ``completed(output, children=[sig, ...])`` returns them: the signatures the step
would have sent, in its order. They are recorded with the verdict's row in one transaction,
under the ids the step would have used, and published like any step's children.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from celery_ledger.ledger import Verdict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AmbiguousStep:
    """What a reconciler is told about a step that started and never completed."""

    key: str
    task_name: str
    task_id: str
    step: str
    input_hash: str
    occurrence: int
    external_ref: str | None
    provider_key: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Reconciled:
    """A reconciler's answer."""

    verdict: Verdict
    output: Any = None
    note: str = ""
    #: With ``completed``: the task signatures the step would have sent (``self.send``).
    children: tuple[Any, ...] = ()

    @classmethod
    def completed(
        cls, output: Any = None, note: str = "", children: Iterable[Any] = ()
    ) -> Reconciled:
        """The step did execute; ``output`` is what it would have returned, and ``children``
        the signatures it would have sent through the outbox, in the order it sends them
        (each gets the child id of that position: the n-th send of the step)."""
        return cls(Verdict.COMPLETED, output, note, tuple(children))

    @classmethod
    def not_executed(cls, note: str = "") -> Reconciled:
        """The step provably did not execute; it may run once more."""
        return cls(Verdict.NOT_EXECUTED, None, note)

    @classmethod
    def unknown(cls, note: str = "") -> Reconciled:
        """The reconciler cannot tell; the entry is parked for an operator."""
        return cls(Verdict.UNKNOWN, None, note)


Reconciler = Callable[[AmbiguousStep], Reconciled]


def ask(reconciler: Reconciler | None, step: AmbiguousStep, *, timeout: float) -> Reconciled:
    """Ask ``reconciler`` about ``step``, turning every failure into ``unknown``."""
    if reconciler is None:
        return Reconciled.unknown("no reconciler")
    answer: list[Reconciled] = []
    failure: list[BaseException] = []

    def call() -> None:
        try:
            answer.append(reconciler(step))
        except BaseException as exc:  # noqa: BLE001 - any failure means "unknown"
            failure.append(exc)

    # A thread, so that a reconciler blocked on a dead provider cannot hold the worker
    # beyond the timeout; it is a daemon and its late answer is ignored.
    t = threading.Thread(target=call, name="ledger-reconciler", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning(
            "reconciler for key=%s step=%s timed out after %ss", step.key, step.step, timeout
        )
        return Reconciled.unknown(f"reconciler timed out after {timeout}s")
    if failure:
        log.warning("reconciler for key=%s step=%s raised %r", step.key, step.step, failure[0])
        return Reconciled.unknown(f"reconciler raised {failure[0]!r}")
    result = answer[0] if answer else None
    if not isinstance(result, Reconciled):
        return Reconciled.unknown(f"reconciler returned {result!r}, not a Reconciled")
    return result

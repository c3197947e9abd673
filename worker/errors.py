"""The runtime's errors (``celery_ledger``, the Celery side).

The tree::

    StepUsageError (RuntimeError)  a body misuses the step API: the same on every run
    ├── NestedStepError            a step started inside another step's function
    ├── TransactionEndedError      a transaction step's block ended the step's transaction
    └── SendRefused                ``self.send()`` cannot keep or publish the child it was given
    AuthorizerError (ValueError)   ``ledger_authorizer`` names nothing importable or callable
    Drift (Exception)              an effect step's call does not match its replay row safely
    SignalTimeout (TimeoutError)   ``self.wait_for`` reached its deadline with no signal

    Stopped (BaseException)        the entry is settled already: end the body, settle nothing

What a caller sees of the ledger is the ledger's own tree (``celery_ledger.ledger.errors``):
``LedgerError`` and its subclasses, among them ``TaskCancelled``, ``TaskExpired`` and
``KeyPruned``, which the ledger stores in settled entries. The errors here are the runtime's:
raised by the task API or used between its modules, never stored under this module's name by
the ledger.

``StepUsageError`` derives from ``RuntimeError``, as it always has: a body's misuse is a
programming error, and the task settles ``failed`` with it. ``Drift`` is a verdict
``ReplayBook.place`` hands the attempt, which turns it into the step's outcome.

``Stopped`` derives from ``BaseException`` on purpose, like the ledger's ``Fenced``: a body
that wraps its work in ``except Exception`` must not swallow the signal that its entry was
settled (sleeping, cancelled, expired) under it.

Not here: the other layers' own. Recovery's ``UnreadableSnapshot`` (``recovery.handoff``) and
``Unpublishable`` (``recovery.outbox``) are about what recovery reads and sends; Flower's
``ActionRefused`` (``flower.actions``) carries an HTTP status.
"""

from __future__ import annotations


class StepUsageError(RuntimeError):
    """Raised when a body misuses the step API: a programming error, the same on every run.

    The task settles ``failed`` with it; it never makes a step ambiguous, never blocks the
    entry, and nothing re-runs it.
    """


class NestedStepError(StepUsageError):
    """Raised when a step is started inside another step's function (steps do not nest)."""


class TransactionEndedError(StepUsageError):
    """Raised when a transaction step's block ended the step's transaction itself (a
    ``commit()`` or ``rollback()`` on it): its writes no longer commit with the step's row."""


class SendRefused(StepUsageError):
    """Raised when ``self.send()`` refuses a child: not a signature, an option the outbox
    cannot keep or no publish could send, arguments that cannot be stored. The same on every
    run, so the task fails with it, naming the cause; the step is not left ambiguous."""


class SignalTimeout(TimeoutError):
    """Raised by ``self.wait_for(name, timeout=)`` when its deadline passed and no signal of
    that name came for this wait; its replay raises it again, whatever arrives later."""


class AuthorizerError(ValueError):
    """Raised when ``ledger_authorizer`` names something that cannot be imported or called."""


class Drift(Exception):
    """Raised by ``ReplayBook.place`` when an effect step's call cannot be matched safely."""

    def __init__(self, name: str, position: int, reason: str) -> None:
        super().__init__(reason)
        self.name = name
        self.position = position
        self.reason = reason


class Stopped(BaseException):
    """Ends the body without settling it again: the entry is settled (sleeping, cancelled,
    expired) already. A BaseException, so a body's ``except Exception`` does not swallow it.
    ``LedgerTask`` raises ``outcome`` in its place (``Ignore``: acked, nothing stored)."""

    def __init__(self, outcome: BaseException) -> None:
        super().__init__(repr(outcome))
        self.outcome = outcome

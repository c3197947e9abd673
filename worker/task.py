"""``LedgerTask``: a Celery Task base class that claims before the body runs and settles after.

Usage::

    @app.task(base=LedgerTask, side_effect="non_idempotent", key_from=("order_id",))
    def charge(self, order_id, amount):
        return self.step("charge", payments.charge, order_id, amount)

This module is the surface a task's author meets: the options, the API a body uses (``step``,
``transaction``, ``send``, ``sleep``, ``retry``, ``provider_key``), the task's identity (its
entry key) and publishing (``apply_async``). A delivery is ``delivery.Delivery``'s: its gates
and what an escaping exception does are two tables there (design.md § "The delivery as a
table"); every write under the fence is ``Attempt``'s.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from celery import Task
from celery.exceptions import Retry
from celery.utils import uuid
from celery.utils.time import maybe_make_aware

from celery_ledger import canvas, concurrency, envelope, intents, ratelimit, signals, timing
from celery_ledger.attempt import Attempt, current_attempt
from celery_ledger.codec import arguments_hash, check_depth, check_text
from celery_ledger.delivery import Delivery, replacing
from celery_ledger.ledger import MissingKeyArgument, SideEffect, entry_key, wire
from celery_ledger.recovery.reconcile import Reconciler
from celery_ledger.replay import Identify
from celery_ledger.transaction import TransactionStep

log = logging.getLogger(__name__)


class LedgerTask(Task):
    """A Celery task whose body runs at most once per effect identity, with replayable steps."""

    #: Side-effect class (``ledger.SideEffect``) of this task's steps, and of its body when it
    #: records no steps.
    side_effect: str = SideEffect.NON_IDEMPOTENT.value
    #: Business key: argument names, or a callable of the task's arguments. None: task id.
    key_from: Sequence[str] | Callable[..., Any] | None = None
    #: Lease length for this task (None: ``ledger_lease_seconds``).
    lease_seconds: float | None = None
    #: Reconciler for ambiguous steps: one callable, or a mapping of step name to callable.
    reconciler: Reconciler | Mapping[str, Reconciler] | None = None
    #: Exceptions that prove a step did not execute (raised before the request left).
    not_executed_on: tuple[type[BaseException], ...] = ()
    #: Seconds after its entry was created (published, or first claimed) past which no effect
    #: step of this task starts: it settles ``expired`` (design.md § "Durable time").
    deadline: float | None = None
    #: ``keyed`` tasks: how long (seconds) the provider keeps an idempotency key (Stripe: 24 h).
    #: An ambiguous step older than that goes to its reconciler, else an operator, instead of
    #: re-running with a key the provider may have forgotten (design.md § "Durable time").
    #: None: no window.
    provider_key_ttl: float | None = None
    #: At most ``concurrency_limit`` entries with one concurrency key run at once, fleet-wide
    #: (docs/concurrency.md): argument names (keyed per task), or a callable returning the key.
    concurrency_key: Sequence[str] | Callable[..., Any] | None = None
    concurrency_limit: int | None = None
    #: Fleet-wide rate limit: ``"10/s"``, ``"5/m"``, ``"100/h"``, or ``"5/m per <argument>"``
    #: (design.md § "Fleet-wide rate limits"). None: no limit.
    ledger_rate_limit: str | None = None

    # The ledger makes redelivery safe, so take the delivery guarantee that loses nothing:
    # ack after the body, and requeue when the pool process running it dies.
    acks_late = True
    reject_on_worker_lost = True
    Request = "celery_ledger.request:LedgerRequest"

    _signature_cache: inspect.Signature | None = None

    # -- registration ---------------------------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Validate the ledger options when the task is registered (not at run time)."""
        super().on_bound(app)
        if cls.__dict__.get("run") is None and cls.run is Task.run:
            return  # the abstract base itself
        for attr in ("key_from", "reconciler", "concurrency_key"):
            # Plain functions given as options would become methods of the task (and get
            # ``self``); keep them plain.
            if inspect.isfunction(cls.__dict__.get(attr)):
                setattr(cls, attr, staticmethod(cls.__dict__[attr]))
        try:
            SideEffect(cls.side_effect)
        except ValueError:
            raise ValueError(
                f"task {cls.name}: side_effect={cls.side_effect!r} is not one of "
                f"{[s.value for s in SideEffect]}"
            ) from None
        if cls.deadline is not None:
            try:
                envelope.relative_seconds(cls.deadline, "deadline")
            except ValueError as exc:
                raise ValueError(f"task {cls.name}: {exc}") from None
        ratelimit.check_option(cls)
        if isinstance(cls.key_from, str):
            raise TypeError(
                f"task {cls.name}: key_from must be a tuple of argument names or a "
                f"callable, not the string {cls.key_from!r}"
            )
        if cls.key_from is not None and not callable(cls.key_from):
            cls._check_argument_names("key_from", cls.key_from)
        concurrency.check_options(cls.name, cls.concurrency_key, cls.concurrency_limit)
        if cls.concurrency_key is not None and not callable(cls.concurrency_key):
            cls._check_argument_names("concurrency_key", cls.concurrency_key)
        # A misspelled secret name would hide nothing, and show the secret in clear.
        secret_args = getattr(cls, "secret_args", None) or ()
        cls._check_argument_names(
            "secret_args", (secret_args,) if isinstance(secret_args, str) else secret_args
        )

    @classmethod
    def _check_argument_names(cls, option: str, names: Iterable[str]) -> None:
        """Refuse an option that names arguments the task's signature does not have (any
        name is fine for a task that takes ``**kwargs``).

        Raises:
            ValueError: naming the option, the names and the signature.
        """
        params = [p for p in inspect.signature(cls.run).parameters.values() if p.name != "self"]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        known = {p.name for p in params}
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(
                f"task {cls.name}: {option} names {missing}, which are not arguments of "
                f"{cls.name}({', '.join(p.name for p in params)})"
            )

    # -- the API a body uses --------------------------------------------------------------

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        effect: bool | None = None,
        not_executed_on: tuple[type[BaseException], ...] = (),
        identify: Identify | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as the named step; on resume, return its stored output.

        A step is its name and its position (the n-th step of that name in the body); its
        input is checked on resume. An effect step found at its position with another input
        (a timestamp, a uuid, a value read outside any step) is drift: the entry is blocked,
        never run again silently. ``identify`` declares which arguments identify the step
        instead: names of ``fn``'s parameters, or a callable of the step's arguments; the
        others may change between attempts.

        ``effect=False`` marks a pure read inside an effect task (one write, no intent row).
        ``effect``, ``not_executed_on`` and ``identify`` are the step's options, never passed
        to ``fn``.
        """
        attempt = self._attempt()
        return attempt.step(
            name,
            fn,
            args,
            kwargs,
            effect=effect,
            not_executed_on=not_executed_on + tuple(self.not_executed_on),
            identify=identify,
        )

    def transaction(
        self, name: str, *, session: bool = False, input: Any = None
    ) -> TransactionStep:
        """A transaction step: ``with self.transaction("credit") as conn:`` runs the block on a
        connection of the ledger's database inside a transaction, and commits the step's
        ``completed`` row with the block's writes (``celery_ledger.transaction``).

        Exactly once for writes to the ledger's own database: a crash inside commits nothing
        and the step runs again; on replay the block does not run and ``.output`` holds what
        it stored (set ``tx.output`` inside the block: ``with self.transaction(...) as conn``
        binds the connection; keep the step itself with ``tx = self.transaction(...)``).
        ``session=True`` binds an ORM ``Session`` instead. ``input`` is what identifies the
        step's input for replay (checked like a step's arguments).

        Raises:
            LedgerBlocked: its input drifted from the stored one; the entry is parked.
            Fenced: this attempt was superseded (nothing committed).
        """
        return self._attempt().transaction(name, arguments_hash([[input], {}]), session=session)

    def transaction_step(
        self, name: str, fn: Callable[..., Any], *args: Any, session: bool = False, **kwargs: Any
    ) -> Any:
        """Run ``fn(conn, *args, **kwargs)`` as a transaction step (``transaction``); on
        replay, return its stored output without calling ``fn``."""
        tx = self._attempt().transaction(
            name, arguments_hash([list(args), kwargs]), session=session
        )
        return tx.run(fn, args, kwargs)

    def django_transaction_step(
        self, name: str, fn: Callable[..., Any], *args: Any, using: str = "default", **kwargs: Any
    ) -> Any:
        """A transaction step on Django's connection: ``fn(*args, **kwargs)`` runs inside
        ``transaction.atomic(using=using)`` and the step's completed row commits with its
        model writes (``celery_ledger.django_steps``). The ledger must live in that
        database. On replay, the stored output, and ``fn`` is not called."""
        from celery_ledger.django_steps import django_transaction_step

        return django_transaction_step(self._attempt(), name, fn, args, kwargs, using=using)

    def send(self, sig: Any) -> str:
        """Send a child task from inside a step, through the transactional outbox.

        The child is recorded with the step's ``completed`` row and published after it
        commits, under a task id derived from this entry, the step and the send's position:
        a crash anywhere gives it exactly one run (a ledgered child deduplicates a second
        publish by its claim). Returns the child's task id.

        Raises:
            StepUsageError: outside a step.
        """
        return self._attempt().send(sig)

    #: ``self.enqueue(task.s(...))``: the same as ``send``.
    enqueue = send

    def record_external_ref(self, ref: str) -> None:
        """Durably attach a provider handle to the running step before calling the provider."""
        self._attempt().record_external_ref(ref)

    def sleep(self, seconds: float) -> None:
        """Sleep durably: a step that records the wake time; while it is ahead the entry is
        ``sleeping``, this attempt ends (its message acked, no worker slot held) and the sweep
        re-sends the task when it is due; completed steps replay and the body goes on here.
        """
        timing.sleep_until(self._attempt(), seconds=seconds, when=None)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``; a countdown beyond ``ledger_hold_threshold_seconds`` is held by
        the ledger (the entry settles ``scheduled``) instead of published (design.md §
        "Durable time").

        The hold belongs to the ``Retry`` this call makes (``timing.mark_held``): the
        attempt settles ``scheduled`` only when that very exception ends it. Nothing else
        remembers it, so no later retry, task or delivery in this process is held by it.

        ``throw=False`` (Celery: publish the retry, return, and the body goes on): a held
        retry is then not sent at all, and nothing is stored for it; the entry follows this
        attempt's own end. That is what its message would have met had it been published:
        it is due after this attempt ends, and its claim RETURNs a completed or failed entry,
        HOLDs a sleeping or scheduled one, re-runs a retry the attempt settled itself, and
        a takeover of an attempt that died is the sweep's anyway. (Under one key, a retry's
        delivery never runs a settled body again.) Raising the returned ``Retry`` holds it
        as with ``throw=True``.
        """
        with timing.in_retry() as call:
            try:
                retry = super().retry(*args, **kwargs)
            except Retry as exc:
                timing.mark_held(exc, call)
                raise
        timing.mark_held(retry, call)
        attempt = current_attempt.get()
        if call.held is not None and attempt is not None:
            log.info(
                "retry(throw=False) of key=%s task_id=%s fence=%s held by the ledger: not "
                "sent; the entry settles as this attempt ends",
                attempt.key,
                attempt.task_id,
                attempt.fence,
            )
        return retry

    def wait_for(self, name: str, timeout: float) -> Any:
        """Wait durably for signal ``name`` (``celery_ledger.signal``) and return its payload.

        A step that records its deadline (``timeout`` seconds from now); with no signal yet
        the entry is ``sleeping`` (reason ``signal:<name>``), this attempt ends (its message
        acked, no worker slot held), and the signal, or the deadline, sends the task again;
        completed steps replay and this wait returns the payload. Each wait takes one
        signal; one sent before the wait is kept for it.

        Raises:
            SignalTimeout: ``timeout`` passed with no signal for this wait.
        """
        return signals.wait_for(self._attempt(), name, timeout)

    def wait_until(self, when: float | datetime) -> None:
        """``sleep`` until ``when`` (a datetime, or seconds since the epoch)."""
        at = maybe_make_aware(when).timestamp() if isinstance(when, datetime) else float(when)
        timing.sleep_until(self._attempt(), seconds=None, when=at)

    @property
    def provider_key(self) -> str:
        """The running step's stable provider idempotency key (``keyed`` tasks)."""
        return self._attempt().provider_key

    @property
    def ledger_attempt(self) -> Attempt | None:
        return current_attempt.get()

    def _attempt(self) -> Attempt:
        attempt = current_attempt.get()
        if attempt is None:
            raise RuntimeError(
                "steps run only inside the body of a ledgered task "
                "delivered by a worker (or apply())"
            )
        return attempt

    # -- identity -------------------------------------------------------------------------

    def ledger_key(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        task_id: str,
        header_key: Any = None,
        replacement: int = 0,
    ) -> tuple[str, str]:
        """Return (entry key, args hash) for a delivery.

        The arguments are hashed for every key, the task id too: a fresh publish that reuses a
        task id with other arguments is a conflict, not the first call's result.

        Raises:
            IdentityError: key material or arguments are not JSON.
        """
        args_hash = arguments_hash([list(args), dict(kwargs)])
        return self.entry_key_of(args, kwargs, task_id, header_key, replacement), args_hash

    def entry_key_of(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        task_id: str,
        header_key: Any = None,
        replacement: int = 0,
    ) -> str:
        """The entry key of a delivery (``ledger_key`` without hashing the arguments): what
        the worker's parent needs to hold or interrupt an entry.

        ``replacement``: how many ``self.replace()`` calls led to it (``canvas.replacement``).
        A replacement inherits the replaced task's id, by Celery's design, with arguments of
        its own. It is a new call, so it gets an entry of its own: under the replaced one's
        key it met that entry (settled ``failed``, "replaced by") and was refused as a
        conflict, or, with the same arguments, RETURNed the replaced one's ``Ignore`` and
        never ran. Each level keeps its own at-most-once: a redelivery of the replacement
        carries the same count, so it finds the replacement's entry.

        Raises:
            IdentityError: key material is not JSON.
        """
        if header_key is None and self.key_from is None:
            material: Any = task_id
        elif header_key is not None:
            material = header_key
        elif callable(self.key_from):
            material = self.key_from(*args, **kwargs)
        else:
            material = self._named_key_material(args, kwargs)
        if replacement:  # 0: the key every entry had before replacements were keyed apart
            material = {"replacement": replacement, "of": material}
        return entry_key(self.name, material)

    def _named_key_material(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], names: Sequence[str] | None = None
    ) -> Any:
        """The key material of a ``key_from`` tuple (or of ``names``: a ``concurrency_key``
        tuple): each named argument's value, found among the parameters the call binds or in
        its ``**kwargs``.

        A name the call does not give is an error, not ``None`` (guarantees.md § "Bad
        input"): with ``None``
        every call lacking it shared one business key, so the second got ``KeyConflict`` and
        the third the first's result. A named parameter with a default that the call leaves
        out keeps the material ``None`` it always had (entries already keyed so keep their key).

        Raises:
            MissingKeyArgument: the call gives no value for a name in ``key_from``.
        """
        sig = self._signature()
        bound = sig.bind_partial(*args, **kwargs).arguments
        params = sig.parameters
        extra: Mapping[str, Any] = {}
        for p in params.values():
            if p.kind is p.VAR_KEYWORD:
                extra = bound.get(p.name) or {}
        material: dict[str, Any] = {}
        missing: list[str] = []
        option = "key_from" if names is None else "concurrency_key"
        named = self.key_from if names is None else names
        assert named is not None and not callable(named)
        for name in named:
            param = params.get(name)
            if param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                if name in bound or param.default is not param.empty:
                    material[name] = bound.get(name)
                    continue
            elif name in extra:
                material[name] = extra[name]
                continue
            missing.append(name)
        if missing:
            given = sorted(set(kwargs)) or "none"
            raise MissingKeyArgument(
                f"{self.name}: {option} names {', '.join(map(repr, missing))} but this call "
                f"does not give {'it' if len(missing) == 1 else 'them'} (keyword arguments "
                f"given: {given}, positional: {len(args)}); no business key can be made, "
                "so nothing ran and nothing was recorded"
            )
        return material

    def _check_key_arguments(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], header_key: Any = None
    ) -> None:
        """Raise ``MissingKeyArgument`` if this call lacks an argument ``key_from`` names."""
        if header_key is None and self.key_from is not None and not callable(self.key_from):
            self._named_key_material(args, kwargs)

    def keyed_by_task_id(self, header_key: Any = None) -> bool:
        """Whether a delivery's entry is keyed by its task id (no business key)."""
        return header_key is None and self.key_from is None

    def _signature(self) -> inspect.Signature:
        if self._signature_cache is None:
            type(self)._signature_cache = inspect.signature(self.run)
        assert self._signature_cache is not None
        return self._signature_cache

    # -- publishing -----------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Send the task; with publish intents on, record it in the ledger first
        (``celery_ledger.intents``). An unreachable ledger never stops the publish.

        Raises:
            ValueError: a ``countdown``, ``eta``, ``expires`` or ``ledger_deadline`` header
                that is no finite time; nothing was published or recorded.
            PayloadTooLarge: the arguments nest deeper than a worker can decode; nothing was
                published or recorded.
            MissingKeyArgument: (intents on, or a held countdown) the call lacks an argument
                ``key_from`` names; nothing was published or recorded.
            KeyConflict: (intents on) a fresh publish whose key is recorded with other
                arguments; nothing was published.
            Exception: whatever the publish raised; the intent this call recorded is
                withdrawn first, so the sweep never sends what the caller saw fail.
        """
        headers = options.get("headers") or {}
        envelope.check_times(options)
        check_depth([args or (), kwargs or {}], what=f"arguments of {self.name}")
        check_text([args or (), kwargs or {}], what=f"the arguments of {self.name}")
        due = timing.hold_due(self, options, linked=bool(link or link_error))
        if due is not None or intents.wanted(self, headers):
            # The ledger records this publish: a call its business key cannot be made for
            # (it would fail at the worker) is refused before anything is recorded or
            # published (guarantees.md § "Bad input").
            self._check_key_arguments(args or (), kwargs or {}, headers.get(wire.KEY))
        if due is not None:
            # A long countdown is held by the ledger, not the broker (design.md § "Durable
            # time").
            held_id = task_id or uuid()
            if timing.hold(self, tuple(args or ()), dict(kwargs or {}), held_id, options, due):
                return self.AsyncResult(held_id)
            task_id = held_id
        publishing: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        intent: str | None = None
        if intents.wanted(self, headers):
            task_id = task_id or uuid()
            intent = intents.record(
                self,
                envelope.of_publish(
                    self,
                    tuple(args or ()),
                    dict(kwargs or {}),
                    options,
                    canvas=canvas.published_placement(options, link, link_error),
                ),
                task_id,
                deadline=envelope.deadline_of(options),
                # A retry may change its arguments under its task id; a fresh publish may not.
                check_conflict=not options.get("retries"),
            )
            publishing = intents.recorded_by_apply_async(task_id)
        try:
            with publishing:
                return super().apply_async(
                    args,
                    kwargs,
                    task_id=task_id,
                    producer=producer,
                    link=link,
                    link_error=link_error,
                    shadow=shadow,
                    **options,
                )
        except BaseException as exc:
            if intent is not None:
                assert task_id is not None
                intents.withdraw(self, intent, task_id, exc)
            raise

    def on_replace(self, sig: Any) -> Any:
        """``self.replace(sig)``: Celery publishes ``sig`` under this task's id and raises
        ``Ignore``; the entry settles ``failed``, naming the replacement
        (``delivery.replacing``)."""
        attempt = current_attempt.get()
        if attempt is None or self.request.is_eager:
            return super().on_replace(sig)
        with replacing(attempt, sig):
            return super().on_replace(sig)

    # -- delivery -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one delivery (``delivery.Delivery``: the claim, then its gate's handler); a
        direct call (``task(...)`` in the caller's own process) runs the body alone."""
        if self.request.called_directly:
            return self.run(*args, **kwargs)
        return Delivery(self, args, kwargs)()

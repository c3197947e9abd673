"""``LedgerTask``: a Celery Task base class that claims before the body runs and settles after.

Usage::

    @app.task(base=LedgerTask, side_effect="non_idempotent", key_from=("order_id",))
    def charge(self, order_id, amount):
        return self.step("charge", payments.charge, order_id, amount)

Gates (``ledger.Gate``) follow the design's table: RUN and TAKEOVER run the body under a new
fence, RETURN hands back the stored result (or raises the stored failure), WAIT never runs
beside a live lease, BLOCK and CONFLICT raise without running anything.

This module is the Celery-facing surface: options, the step API, identity, publishing, the
gate dispatch and the task-ledger-* events. The run itself is ``Attempt``'s (every write under
the fence), ambiguous steps are ``Ambiguity``'s, and re-queueing is ``redelivery``'s.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid
from celery.utils.time import maybe_make_aware

from celery_ledger import canvas, envelope, intents, refusal, runtime, timing
from celery_ledger.ambiguity import RUN_BODY, Ambiguity
from celery_ledger.attempt import Attempt, current_attempt
from celery_ledger.codec import (
    arguments_hash,
    check_depth,
    check_text,
    decode,
    encode,
    encode_failure,
)
from celery_ledger.crashpoints import crash_point
from celery_ledger.heartbeat import heartbeat
from celery_ledger.ledger import (
    Claim,
    ClaimRequest,
    EntryStatus,
    Fenced,
    Gate,
    KeyConflict,
    LedgerBlocked,
    LedgerStore,
    LedgerUnavailable,
    MissingKeyArgument,
    PayloadError,
    SideEffect,
    entry_key,
    wire,
)
from celery_ledger.ledger.errors import loadable_failure
from celery_ledger.recovery.reconcile import Reconciler
from celery_ledger.redact import scrub_for_call
from celery_ledger.redelivery import header, ledger_unavailable, redeliver, wait_briefly
from celery_ledger.replay import Identify
from celery_ledger.settings import LedgerSettings
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
    #: step of this task starts: it settles ``expired`` (issue 18, ``worker/timing.py``).
    deadline: float | None = None
    #: ``keyed`` tasks: how long (seconds) the provider keeps an idempotency key (Stripe: 24 h).
    #: An ambiguous step older than that goes to its reconciler, else an operator, instead of
    #: re-running with a key the provider may have forgotten (issue 18). None: no window.
    provider_key_ttl: float | None = None

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
        for attr in ("key_from", "reconciler"):
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
        if isinstance(cls.key_from, str):
            raise TypeError(
                f"task {cls.name}: key_from must be a tuple of argument names or a "
                f"callable, not the string {cls.key_from!r}"
            )
        if cls.key_from is not None and not callable(cls.key_from):
            cls._check_argument_names("key_from", cls.key_from)
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
        attempt = self._attempt()
        timing.sleep_until(self, attempt, runtime.store_for(self.app), seconds=seconds, when=None)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``; a countdown beyond ``ledger_hold_threshold_seconds`` is held by
        the ledger (the entry settles ``scheduled``) instead of published (issue 18).

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

    def wait_until(self, when: float | datetime) -> None:
        """``sleep`` until ``when`` (a datetime, or seconds since the epoch)."""
        at = maybe_make_aware(when).timestamp() if isinstance(when, datetime) else float(when)
        timing.sleep_until(
            self, self._attempt(), runtime.store_for(self.app), seconds=None, when=at
        )

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

    def _named_key_material(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The key material of a ``key_from`` tuple: each named argument's value, found among
        the parameters the call binds or in its ``**kwargs``.

        A name the call does not give is an error, not ``None`` (issue 30): with ``None``
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
        names = self.key_from
        assert names is not None and not callable(names)
        for name in names:
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
                f"{self.name}: key_from names {', '.join(map(repr, missing))} but this call "
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
            # published (issue 30).
            self._check_key_arguments(args or (), kwargs or {}, headers.get(wire.KEY))
        if due is not None:  # issue 18: a long countdown is held by the ledger, not the broker
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
        ``Ignore``. The attempt remembers what replaced it, so that the entry is settled
        ``failed`` with that ``Ignore`` and a reason naming the replacement: a redelivery
        RETURNs it and raises ``Ignore`` again, storing nothing over the replacement's result
        and publishing nothing (docs/design.md, "Canvas")."""
        attempt = current_attempt.get()
        if attempt is None or self.request.is_eager:
            return super().on_replace(sig)
        attempt.replaced_by = f"{sig.name or sig.task}[{sig.id}]"
        try:
            return super().on_replace(sig)
        except Ignore:
            crash_point(attempt.settings, "after-publish")
            raise

    # -- delivery -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly:
            return self.run(*args, **kwargs)
        settings = runtime.settings_for(self.app)
        store = runtime.store_for(self.app)
        header_key = header(req, wire.KEY)
        lease = float(self.lease_seconds or settings.lease_seconds)
        try:
            key, args_hash = self.ledger_key(
                args, kwargs, req.id, header_key, canvas.replacement(req)
            )
        except Exception as exc:  # noqa: BLE001 - key_from is user code, the arguments the sender's
            raise self._refuse(store, exc) from None
        # A fresh publish (no retry count, not the ledger's own re-send) must bring the
        # arguments its task id was first claimed with; a retry may change them.
        fresh = not req.retries and not header(req, wire.REDELIVERY)
        claim_req = ClaimRequest(
            key=key,
            task_name=self.name,
            task_id=req.id,
            args_hash=args_hash,
            snapshot=self._snapshot(args, kwargs),
            side_effect=self.side_effect,
            # Eager apply() has no worker node: each process is its own owner, so that one
            # process never takes another's live lease for a previous boot of its own.
            owner=runtime.owner_for(req.hostname, per_process=bool(req.is_eager)),
            lease_seconds=lease,
            max_interruptions=settings.max_resumes,
            args_may_change=not fresh and self.keyed_by_task_id(header_key),
            group_id=req.group,
            parent_id=req.parent_id,
            # The admission gate: the claim refuses a delivery whose deadline passed.
            deadline_at=timing.delivery_deadline(req),
            deadline_after=None if self.deadline is None else float(self.deadline),
        )
        claim = None
        for _ in range(3):  # a WAIT that sees the other attempt end claims again, at most twice
            try:
                claim = store.claim(claim_req)
            except LedgerUnavailable as exc:
                ledger_unavailable(self, exc, args, kwargs)
            if claim.gate is not Gate.WAIT or not wait_briefly(store, key, settings):
                break
        assert claim is not None
        self._emit(_GATE_EVENT[claim.gate], key, claim.fence, found=_value(claim.found))
        log.debug(
            "claim key=%s task_id=%s fence=%s gate=%s", key, req.id, claim.fence, claim.gate.value
        )

        if claim.gate is Gate.RETURN:
            retval = None if claim.error is not None else decode(claim.result)
            try:
                canvas.returned(
                    self,
                    store,
                    key,
                    claim.fence,
                    self._links(key, claim.fence, retval, failed=claim.error is not None),
                )
            except LedgerUnavailable as exc:
                # Which links the settle recorded cannot be read: neither publish them nor
                # let the tracer do it blind. Re-send this delivery (with its links) later.
                ledger_unavailable(self, exc, args, kwargs)
            if claim.error is not None:
                raise self._stored_failure(claim.error)
            return retval
        if claim.gate is Gate.WAIT:
            countdown = min(max(claim.lease_remaining or 1.0, 1.0), settings.wait_countdown_max)
            redeliver(self, args, kwargs, countdown=countdown)
        if claim.gate is Gate.HOLD:
            raise Ignore()  # scheduled or sleeping: the ledger sends it when due
        if claim.gate is Gate.BLOCK:
            why = scrub_for_call(
                claim.reason or "", redact=settings.redact, task=self, args=args, kwargs=kwargs
            )
            raise LedgerBlocked(
                f"{self.name}[{req.id}] key {key} is blocked: {why}; see `celery-ledger show {key}`"
            )
        if claim.gate is Gate.CONFLICT:
            what = "task id" if self.keyed_by_task_id(header_key) else f"business key {key}"
            raise self._refuse(
                store,
                KeyConflict(
                    f"{self.name}[{req.id}]: {what} was first claimed with different "
                    "arguments; the body did not run (use a different key, or the same arguments)"
                ),
            )
        return self._run_attempt(claim, store, settings, lease, args, kwargs)

    def _refuse(self, store: LedgerStore, exc: BaseException) -> BaseException:
        """End a delivery whose arguments cannot be keyed or stored, or that conflicts with
        its key's first claim (``refusal``): nothing runs; its own entry settles ``failed``
        with the refusal as its reason. Returns the error to raise."""
        refused = refusal.as_refusal(self, exc)
        refusal.record(self, store, str(self.request.id), refused, self.request.hostname)
        return refused

    def _run_attempt(
        self,
        claim: Claim,
        store: LedgerStore,
        settings: LedgerSettings,
        lease: float,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        req = self.request
        attempt = Attempt(
            self,
            store,
            settings,
            key=claim.key,
            fence=claim.fence,
            task_id=req.id,
            lease_seconds=lease,
            replay=claim.steps,
            actor=req.hostname,
            emit=self._emit,
        )
        token = current_attempt.set(attempt)
        heartbeat.register(attempt)
        try:
            try:
                if claim.gate is Gate.TAKEOVER or claim.steps:
                    early = self._ambiguity(attempt, args, kwargs).before_body(claim)
                    if early is not RUN_BODY:
                        return early
                crash_point(settings, "after-claim")
                result = self.run(*args, **kwargs)
            except timing.Stopped as stop:
                raise stop.outcome from None
            except Retry as exc:
                due, held = self._retry_due(exc, settings), timing.held_retry(exc)
                if held is not None:  # issue 18: the ledger holds the long retry countdown
                    due = {k: v for k, v in due.items() if k == "snapshot"} | held
                status = EntryStatus.RETRYING if held is None else EntryStatus.SCHEDULED
                attempt.settle(status, **due)
                raise
            except Reject as exc:
                self._settle_reject(attempt, exc, settings)
                raise
            except Fenced as exc:
                try:  # a start refused by a cancellation or a deadline settles it (issue 18)
                    timing.explain_refusal(self, attempt, store)
                except timing.Stopped as stop:
                    raise stop.outcome from None
                self._emit("fenced", attempt.key, attempt.fence, reason=str(exc))
                raise Ignore() from exc
            except LedgerBlocked:
                raise
            except LedgerUnavailable as exc:
                # The ledger went away mid-body, past the write retries. Settling `failed`
                # would be a lie (nothing failed) and impossible anyway: leave the entry
                # running. Its lease expires, the sweep interrupts it, and a resume replays
                # what completed. Re-deliver after the lease too, in case the sweep's own
                # resume message is the one that gets lost.
                log.error(
                    "ledger unreachable mid-task key=%s task_id=%s fence=%s (%s); entry "
                    "left running for recovery",
                    attempt.key,
                    attempt.task_id,
                    attempt.fence,
                    exc,
                )
                redeliver(self, args, kwargs, countdown=lease + 1.0)
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    # SystemExit, KeyboardInterrupt: the process is going away, the task did
                    # not fail. Settle nothing (a stored BaseException would be raised again
                    # by every later delivery): the entry stays running, the worker's parent
                    # sees the pool process lost (``request.LedgerRequest``) or the lease
                    # expires, and the resume replays what completed.
                    log.warning(
                        "%s raised in the body key=%s task_id=%s fence=%s; entry left "
                        "running for recovery",
                        type(exc).__name__,
                        attempt.key,
                        attempt.task_id,
                        attempt.fence,
                    )
                    raise
                if isinstance(exc, Ignore) and attempt.replaced_by is not None:
                    attempt.settle(
                        EntryStatus.FAILED,
                        error=self._dump_exc(exc, settings),
                        reason=f"replaced by {attempt.replaced_by}",
                    )
                    raise
                self._settle_failure(attempt, exc, args, kwargs)
                raise
            try:
                # What Celery's backend stores (``prepare_value``: a returned AsyncResult or
                # GroupResult becomes its ``as_tuple()``), not the raw object: the ledger's
                # result is the one the caller gets, and a RETURN hands it back the same.
                encoded = encode(
                    self.backend.prepare_value(result),
                    limit=settings.max_result_bytes,
                    what=f"result of {self.name}",
                )
            except PayloadError as exc:
                attempt.settle(EntryStatus.FAILED, error=self._dump_exc(exc, settings))
                raise
            # The next link receives the result as stored (decoded), if there is a next link.
            retval = decode(encoded) if req.chain or req.callbacks else None
            links = self._links(attempt.key, attempt.fence, retval)
            crash_point(settings, "before-settle")
            if attempt.replayed:
                self._emit("replayed", attempt.key, attempt.fence, steps=attempt.replayed)
            if not attempt.settle(EntryStatus.COMPLETED, result=encoded, links=links.children):
                self._emit("fenced", attempt.key, attempt.fence, reason="settle refused")
                raise Ignore()
            # The links are the outbox's now: the tracer must not publish them too.
            links.hand_over(req)
            crash_point(settings, "after-settle")
            canvas.publish_links(store, self.app, attempt.key, attempt.fence, links.children)
            crash_point(settings, "after-publish")
            return result
        finally:
            heartbeat.unregister(attempt)
            current_attempt.reset(token)

    def _links(self, key: str, fence: int, retval: Any, *, failed: bool = False) -> canvas.Links:
        """The links this delivery publishes when it completes (``canvas.links_of``) or, if
        ``failed``, its ``link_error`` callbacks (``canvas.errback_links_of``), as the settle
        at ``fence`` records them; none taken over if one cannot be stored (the tracer then
        publishes them, as Celery does)."""
        req = self.request
        nothing = canvas.Links([], False, list(req.callbacks or ()))
        if failed:
            nothing.errbacks_left = list(req.errbacks or ())
            if not req.errbacks:
                return nothing
        elif not (req.chain or req.callbacks):
            return nothing
        try:
            if failed:
                return canvas.errback_links_of(self, req, key, fence=fence)
            return canvas.links_of(self, req, key, retval, fence=fence)
        except PayloadError as exc:
            log.warning(
                "links of key=%s task_id=%s not recorded (%s); Celery publishes them",
                key,
                req.id,
                exc,
            )
            return nothing

    def _ambiguity(
        self, attempt: Attempt, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Ambiguity:
        return Ambiguity(attempt, self.reconciler, args, kwargs)

    # -- settling a failure ---------------------------------------------------------------

    def _settle_failure(
        self, attempt: Attempt, exc: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if attempt.ambiguous is not None and self._ambiguity(attempt, args, kwargs).after_escape():
            return  # blocked, or fenced out: nothing left to settle
        # Its link_error callbacks are recorded with the failure, as a success's links are.
        links = self._links(attempt.key, attempt.fence, None, failed=True)
        if attempt.settle(
            EntryStatus.FAILED, error=self._dump_exc(exc, attempt.settings), links=links.children
        ):
            links.hand_over(self.request)
            canvas.publish_links(
                runtime.store_for(self.app), self.app, attempt.key, attempt.fence, links.children
            )

    def _settle_reject(self, attempt: Attempt, exc: Reject, settings: LedgerSettings) -> None:
        """Settle an attempt whose body raised Celery's ``Reject`` (issue 30).

        A ``Reject`` is not the task's failure: it tells the broker what to do with the
        message, and the ledger follows it.

        ``requeue=True``: the message goes back to the queue and the body is to run again
        when it is redelivered. Settling ``failed`` stored the ``Reject`` as the result:
        every redelivery RETURNed it and raised it again, requeueing forever while the body
        never ran a second time. The attempt ended cleanly, as a ``self.retry()`` does, so it
        settles ``retrying``: the requeued message's claim RUNs the body with completed steps
        replaying, and should that message be lost, the sweep re-sends it once due (after
        ``ledger_retry_grace_seconds``). A body that rejects every time requeues every time,
        as under plain Celery; the ledger adds no loop of its own.

        ``requeue=False``: the broker drops (or dead-letters) the message; nothing will run
        it again. The entry ends ``failed`` with a reason saying so, so that the sweep never
        re-sends it and a stray duplicate RETURNs it (raising a ``Reject`` that drops it).
        Celery calls no ``link_error`` for a rejected task, so none are recorded.
        """
        if exc.requeue:
            attempt.settle(EntryStatus.RETRYING, due_in=settings.retry_grace_seconds)
            return
        attempt.settle(
            EntryStatus.FAILED,
            error=self._dump_exc(exc, settings),
            reason=f"rejected (requeue=False), message dropped: {exc.reason!r}"[:500],
        )

    def _dump_exc(self, exc: BaseException, settings: LedgerSettings) -> str:
        return encode_failure(exc, limit=settings.max_exception_bytes)

    def _stored_failure(self, error: str) -> BaseException:
        data = loadable_failure(decode(error))
        try:
            exc = self.backend.exception_to_python(data)
        except Exception:  # noqa: BLE001
            exc = None
        if isinstance(exc, Reject) and exc.requeue:
            # Settled before issue 30 stored a requeueing Reject: raising it again requeued
            # the message forever. The entry is settled; the message has nothing left to do.
            return Reject(exc.reason, requeue=False)
        if isinstance(exc, Exception):
            return exc
        # Never raise a stored SystemExit/KeyboardInterrupt again (older versions stored
        # them): in a worker it would end the pool process on every delivery.
        return RuntimeError(f"stored failure: {data!r}")

    def _snapshot(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The delivery's envelope (``envelope.of_request``), sealed for the claim; None if
        not storable (recovery then reports the entry rather than resume it)."""
        req = self.request
        try:
            return envelope.seal(
                self.app, envelope.of_request(req, args, kwargs, canvas=canvas.placement(req))
            )
        except PayloadError as exc:
            log.warning(
                "no argument snapshot for task_id=%s (%s); recovery will report it, not resume it",
                req.id,
                exc,
            )
            return None

    def _retry_due(self, exc: Retry, settings: LedgerSettings) -> dict[str, Any]:
        """When a ``self.retry()`` is due and what it re-sends: the fields of its ``retrying``
        settle, so that the sweep re-sends a retry whose message is lost (issue 14, fault 3).

        Due at its ETA (``countdown`` seconds from now on the database clock, or the ``eta``
        datetime) plus ``ledger_retry_grace_seconds``; the snapshot becomes the retry's own
        arguments and retry count (``retry(args=...)`` may change them).
        """
        grace = settings.retry_grace_seconds
        when = exc.when
        due: dict[str, Any] = {"due_in": grace}  # no ETA known: due after the grace alone
        if isinstance(when, str):
            with contextlib.suppress(ValueError):
                when = datetime.fromisoformat(when)
        if isinstance(when, datetime):
            due = {"due_at": maybe_make_aware(when).timestamp() + grace}
        elif isinstance(when, (int, float)):
            due = {"due_in": max(float(when), 0.0) + grace}
        sig = exc.sig
        if sig is None:
            return due
        req = self.request
        try:
            due["snapshot"] = envelope.seal(
                self.app, envelope.of_retry(req, sig, canvas=canvas.placement(req))
            )
        except Exception as exc_:  # noqa: BLE001 - nothing here may stop the retry itself
            # The entry keeps the snapshot it has, as a claim does for arguments it cannot
            # snapshot; the retry's own message carries the new arguments.
            log.warning(
                "no argument snapshot for the retry of task_id=%s (%s); a lost retry is "
                "re-sent with the arguments last stored",
                req.id,
                exc_,
            )
        return due

    # -- monitoring -----------------------------------------------------------------------

    def _emit(self, kind: str, key: str, fence: int, **fields: Any) -> None:
        """Send a ``task-ledger-<kind>`` Celery event; monitoring never breaks a task."""
        if not runtime.events_enabled(self.app):
            return
        try:
            self.send_event(
                f"task-ledger-{kind}",
                retry=False,
                key=key,
                fence=fence,
                task_name=self.name,
                **fields,
            )
        except Exception as exc:  # noqa: BLE001
            log.debug("could not send task-ledger-%s for key=%s: %r", kind, key, exc)


_GATE_EVENT = {
    Gate.RUN: "claimed",
    Gate.TAKEOVER: "resumed",
    Gate.RETURN: "returned",
    Gate.WAIT: "waited",
    Gate.BLOCK: "blocked",
    Gate.CONFLICT: "conflict",
    Gate.HOLD: "held",
}


def _value(status: EntryStatus | None) -> str | None:
    return None if status is None else status.value

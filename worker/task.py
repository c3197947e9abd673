"""``LedgerTask``: a Celery Task base class that claims before the body runs and settles after.

Usage::

    @app.task(base=LedgerTask, side_effect="non_idempotent", key_from=("order_id",))
    def charge(self, order_id, amount):
        return self.step("charge", payments.charge, order_id, amount)

Gates (``ledger.Gate``) follow the design's table: RUN and TAKEOVER run the body under a new
fence, RETURN hands back the stored result (or raises the stored failure), WAIT never runs
beside a live lease, BLOCK and CONFLICT raise without running anything.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.utils import uuid

from celery_ledger import intents, runtime
from celery_ledger.attempt import Attempt, current_attempt
from celery_ledger.codec import canonical_arguments, decode, encode
from celery_ledger.crashpoints import crash_point
from celery_ledger.heartbeat import heartbeat
from celery_ledger.ledger import (
    BODY_STEP,
    Claim,
    ClaimRequest,
    EntryStatus,
    Fenced,
    Gate,
    KeyConflict,
    LedgerBlocked,
    LedgerUnavailable,
    PayloadError,
    SideEffect,
    StepRecord,
    StepStatus,
    Verdict,
    entry_key,
)
from celery_ledger.recovery.reconcile import AmbiguousStep, Reconciler, ask

log = logging.getLogger(__name__)

BODY_IDENT = (BODY_STEP, "", 0)
#: args_hash of entries keyed by task id: the same id is the same effect whatever the
#: arguments (``retry(args=...)`` may change them), so there is nothing to conflict with.
TASK_ID_KEYED = "task-id"


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
        if cls.key_from is None or callable(cls.key_from):
            return
        if isinstance(cls.key_from, str):
            raise TypeError(
                f"task {cls.name}: key_from must be a tuple of argument names or a "
                f"callable, not the string {cls.key_from!r}"
            )
        sig = inspect.signature(cls.run)
        params = [p for p in sig.parameters.values() if p.name != "self"]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        names = {p.name for p in params}
        missing = [n for n in cls.key_from if n not in names]
        if missing:
            raise ValueError(
                f"task {cls.name}: key_from names {missing}, which are not arguments of "
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
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as the named step; on resume, return its stored output.

        ``effect=False`` marks a pure read inside an effect task (one write, no intent row).
        """
        attempt = self._attempt()
        return attempt.step(
            name,
            fn,
            args,
            kwargs,
            effect=effect,
            not_executed_on=not_executed_on + tuple(self.not_executed_on),
        )

    def record_external_ref(self, ref: str) -> None:
        """Durably attach a provider handle to the running step before calling the provider."""
        self._attempt().record_external_ref(ref)

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
        self, args: Sequence[Any], kwargs: Mapping[str, Any], task_id: str, header_key: Any = None
    ) -> tuple[str, str]:
        """Return (entry key, args hash) for a delivery.

        Raises:
            IdentityError: key material or arguments are not JSON.
        """
        if header_key is None and self.key_from is None:
            return entry_key(self.name, task_id), TASK_ID_KEYED
        if header_key is not None:
            material = header_key
        elif callable(self.key_from):
            material = self.key_from(*args, **kwargs)
        else:
            bound = self._signature().bind_partial(*args, **kwargs).arguments
            material = {n: bound.get(n) for n in (self.key_from or ())}
        args_hash = _sha256(canonical_arguments([list(args), dict(kwargs)]))
        return entry_key(self.name, material), args_hash

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
        (``celery_ledger.intents``). An unreachable ledger never stops the publish."""
        headers = options.get("headers") or {}
        publishing: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if intents.wanted(self, headers):
            task_id = task_id or uuid()
            intents.record(
                self,
                tuple(args or ()),
                dict(kwargs or {}),
                task_id,
                ledger_key=headers.get("ledger_key"),
                queue=options.get("queue"),
            )
            publishing = intents.recorded_by_apply_async(task_id)
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

    # -- delivery -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly:
            return self.run(*args, **kwargs)
        settings = runtime.settings_for(self.app)
        store = runtime.store_for(self.app)
        key, args_hash = self.ledger_key(args, kwargs, req.id, _header(req, "ledger_key"))
        lease = float(self.lease_seconds or settings.lease_seconds)
        claim_req = ClaimRequest(
            key=key,
            task_name=self.name,
            task_id=req.id,
            args_hash=args_hash,
            snapshot=_snapshot(args, kwargs, req),
            side_effect=self.side_effect,
            owner=runtime.owner_for(req.hostname),
            lease_seconds=lease,
            max_interruptions=settings.max_resumes,
        )
        claim = None
        for _ in range(3):  # a WAIT that sees the other attempt end claims again, at most twice
            try:
                claim = store.claim(claim_req)
            except LedgerUnavailable as exc:
                return self._ledger_unavailable(exc, args, kwargs)
            if claim.gate is not Gate.WAIT or not self._wait_briefly(store, key, settings):
                break
        assert claim is not None
        self._emit(_GATE_EVENT[claim.gate], key, claim.fence, found=_value(claim.found))
        log.debug(
            "claim key=%s task_id=%s fence=%s gate=%s", key, req.id, claim.fence, claim.gate.value
        )

        if claim.gate is Gate.RETURN:
            if claim.error is not None:
                raise self._stored_failure(claim.error)
            return decode(claim.result)
        if claim.gate is Gate.WAIT:
            countdown = min(max(claim.lease_remaining or 1.0, 1.0), settings.wait_countdown_max)
            return self._redeliver(args, kwargs, countdown=countdown)
        if claim.gate is Gate.BLOCK:
            raise LedgerBlocked(
                f"{self.name}[{req.id}] key {key} is blocked: {claim.reason}; "
                f"see `celery-ledger show {key}`"
            )
        if claim.gate is Gate.CONFLICT:
            raise KeyConflict(
                f"{self.name}[{req.id}]: business key {key} was first claimed with different "
                "arguments; the body did not run (use a different key, or the same arguments)"
            )
        return self._run_attempt(claim, store, settings, lease, args, kwargs)

    def _run_attempt(
        self,
        claim: Claim,
        store: Any,
        settings: Any,
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
        )
        token = current_attempt.set(attempt)
        heartbeat.register(attempt)
        try:
            try:
                if claim.gate is Gate.TAKEOVER or claim.steps:
                    early = self._resolve_ambiguity(attempt, claim, args, kwargs)
                    if early is not _RUN_BODY:
                        return early
                crash_point(settings, "after-claim")
                result = self.run(*args, **kwargs)
            except Retry:
                self._settle(attempt, EntryStatus.RETRYING)
                raise
            except Fenced as exc:
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
                return self._redeliver(args, kwargs, countdown=lease + 1.0)
            except BaseException as exc:
                self._settle_failure(attempt, exc, args, kwargs)
                raise
            try:
                encoded = encode(
                    result, limit=settings.max_result_bytes, what=f"result of {self.name}"
                )
            except PayloadError as exc:
                self._settle(attempt, EntryStatus.FAILED, error=self._dump_exc(exc))
                raise
            crash_point(settings, "before-settle")
            if attempt.replayed:
                self._emit("replayed", attempt.key, attempt.fence, steps=attempt.replayed)
            if not self._settle(attempt, EntryStatus.COMPLETED, result=encoded):
                self._emit("fenced", attempt.key, attempt.fence, reason="settle refused")
                raise Ignore()
            return result
        finally:
            heartbeat.unregister(attempt)
            current_attempt.reset(token)

    # -- ambiguity ------------------------------------------------------------------------

    def _resolve_ambiguity(
        self, attempt: Attempt, claim: Claim, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Decide every step that started and never completed, before anything runs.

        Returns ``_RUN_BODY`` to go on, or the task's result when a reconciler proved the
        whole body completed. Raises LedgerBlocked after parking the entry.
        """
        body = attempt.replay.get(BODY_IDENT)
        real_steps = [r for r in claim.steps if r.name != BODY_STEP]
        for row in real_steps:
            if row.status is StepStatus.STARTED:
                self._resolve(attempt, row.ident, row.external_ref, args, kwargs)
        if real_steps or not attempt.side_effect.writes_intent:
            return _RUN_BODY
        # A task that recorded no steps: its body is the effect. If an earlier attempt ran it
        # and nothing says how that ended, the body itself is ambiguous.
        if (
            claim.gate is Gate.TAKEOVER
            and claim.executions >= 1
            and (body is None or body.status is StepStatus.STARTED)
        ):
            verdict = self._resolve(
                attempt, BODY_IDENT, body.external_ref if body else None, args, kwargs
            )
            if verdict is not None and verdict[0] is Verdict.COMPLETED:
                self._settle(attempt, EntryStatus.COMPLETED, result=verdict[1])
                return decode(verdict[1])
            body = attempt.replay.get(BODY_IDENT)
        if body is not None and body.status is StepStatus.NOT_EXECUTED:
            # The one authorized re-run: record its intent, so a crash during it is ambiguous
            # again instead of authorized again.
            attempt._fenced(store_write(attempt, BODY_IDENT, StepStatus.STARTED), "body start")
        return _RUN_BODY

    def _resolve(
        self,
        attempt: Attempt,
        ident: tuple[str, str, int],
        ref: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Verdict, str] | None:
        name = ident[0]
        if attempt.side_effect.rerun_when_ambiguous:
            log.info(
                "ambiguous step re-run key=%s task_id=%s fence=%s step=%s class=%s",
                attempt.key,
                attempt.task_id,
                attempt.fence,
                name,
                attempt.side_effect.value,
            )
            return None
        step = AmbiguousStep(
            key=attempt.key,
            task_name=self.name,
            task_id=attempt.task_id,
            step=name,
            input_hash=ident[1],
            occurrence=ident[2],
            external_ref=ref,
            provider_key=_provider_key(attempt.key, ident),
            args=args,
            kwargs=kwargs,
        )
        answer = ask(self._reconciler_for(name), step, timeout=attempt.settings.reconcile_timeout)
        if answer.verdict is Verdict.COMPLETED:
            try:
                encoded = encode(
                    answer.output,
                    limit=attempt.settings.max_result_bytes,
                    what=f"reconciled output of step {name!r}",
                )
            except PayloadError as exc:
                answer = type(answer).unknown(str(exc))
            else:
                attempt._fenced(
                    store_write(attempt, ident, StepStatus.COMPLETED, encoded),
                    f"step {name} reconcile",
                )
                attempt.replay[ident] = _row(ident, StepStatus.COMPLETED, attempt.fence, encoded)
                self._emit("reconciled", attempt.key, attempt.fence, step=name, verdict="completed")
                return (Verdict.COMPLETED, encoded)
        if (
            answer.verdict is Verdict.NOT_EXECUTED
            and attempt.side_effect is not SideEffect.IRREVERSIBLE
        ):
            attempt._fenced(
                store_write(attempt, ident, StepStatus.NOT_EXECUTED), f"step {name} reconcile"
            )
            attempt.replay[ident] = _row(ident, StepStatus.NOT_EXECUTED, attempt.fence)
            self._emit("reconciled", attempt.key, attempt.fence, step=name, verdict="not_executed")
            return (Verdict.NOT_EXECUTED, "")
        why = answer.note or answer.verdict.value
        if answer.verdict is Verdict.NOT_EXECUTED:
            why = "irreversible steps are never re-run without an operator"
        reason = (
            f"step {name!r} may have executed (external ref: {ref or 'none'}; "
            f"reconciler: {why}); reconcile or release: "
            f"celery-ledger show {attempt.key}"
        )
        self._block(attempt, reason)
        raise LedgerBlocked(f"{self.name}[{attempt.task_id}] key {attempt.key}: {reason}")

    def _reconciler_for(self, step: str) -> Reconciler | None:
        rec = self.reconciler
        if isinstance(rec, Mapping):
            return rec.get(step) or rec.get("*")
        return rec

    def _block(self, attempt: Attempt, reason: str) -> None:
        log.warning(
            "blocked key=%s task_id=%s fence=%s: %s",
            attempt.key,
            attempt.task_id,
            attempt.fence,
            reason,
        )
        self._settle(attempt, EntryStatus.BLOCKED, reason=reason)
        self._emit("blocked", attempt.key, attempt.fence, reason=reason)

    # -- settling -------------------------------------------------------------------------

    def _settle(self, attempt: Attempt, status: EntryStatus, **fields: Any) -> bool:
        """Settle with bounded retries while the ledger is unreachable.

        Returns False when the fence moved (superseded). If the ledger stays unreachable past
        ``ledger_settle_retry_seconds`` the entry is left running: its lease expires, the
        sweep interrupts it, and the resume replays the completed steps. Nothing is lost.
        """
        settings = attempt.settings
        deadline = time.monotonic() + settings.settle_retry_seconds
        delay = 0.1
        while True:
            try:
                ok = attempt.store.settle(
                    attempt.key, attempt.fence, status, actor=self.request.hostname, **fields
                )
                break
            except LedgerUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    log.error(
                        "settle %s of key=%s task_id=%s fence=%s failed for %ss (%s); "
                        "entry left running for recovery",
                        status.value,
                        attempt.key,
                        attempt.task_id,
                        attempt.fence,
                        settings.settle_retry_seconds,
                        exc,
                    )
                    return True
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if ok:
            self._emit("settled", attempt.key, attempt.fence, status=status.value)
        else:
            attempt.mark_superseded(f"settle {status.value} refused")
        return ok

    def _settle_failure(
        self, attempt: Attempt, exc: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if attempt.ambiguous is None:
            self._settle(attempt, EntryStatus.FAILED, error=self._dump_exc(exc))
            return
        # The exception escaped from inside a started effect step: the step may have crossed
        # (the charge went through, the response was lost). Ask, never assume.
        ident = attempt.ambiguous
        try:
            self._resolve(attempt, ident, None, args, kwargs)
        except LedgerBlocked:
            return
        except Fenced:
            return
        self._settle(attempt, EntryStatus.FAILED, error=self._dump_exc(exc))

    def _dump_exc(self, exc: BaseException) -> str:
        try:
            return encode(
                self.backend.prepare_exception(exc, "json"),
                limit=64 * 1024,
                what="stored exception",
            )
        except Exception:  # noqa: BLE001 - an odd exception must not stop the settle
            return encode(
                {
                    "exc_type": type(exc).__name__,
                    "exc_message": [repr(exc)[:2000]],
                    "exc_module": "builtins",
                },
                limit=64 * 1024,
                what="stored exception",
            )

    def _stored_failure(self, error: str) -> BaseException:
        data = decode(error)
        try:
            exc = self.backend.exception_to_python(data)
        except Exception:  # noqa: BLE001
            exc = None
        if isinstance(exc, BaseException):
            return exc
        return RuntimeError(f"stored failure: {data!r}")

    # -- redelivery -----------------------------------------------------------------------

    def _redeliver(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        countdown: float,
        headers: dict[str, Any] | None = None,
    ) -> Any:
        """Send this delivery again later with the same task id, without spending a retry.

        ``Ignore`` then acks this message and records no state, so a RETURN stored by the
        other attempt is not overwritten with RETRY.
        """
        req = self.request
        sig = self.signature_from_request(req, args, kwargs, countdown=countdown)
        # The entry exists (WAIT) or the ledger is down (claim): no publish intent to record.
        sig.options["headers"] = {
            **(sig.options.get("headers") or {}),
            **(headers or {}),
            "ledger_redelivery": True,
        }
        sig.apply_async()
        raise Ignore()

    def _ledger_unavailable(
        self, exc: LedgerUnavailable, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        settings = runtime.settings_for(self.app)
        n = int(_header(self.request, "ledger_unavailable") or 0)
        countdown = min(settings.unavailable_backoff * (2**n), settings.unavailable_backoff_max)
        log.warning(
            "ledger unavailable at claim task=%s task_id=%s (attempt %s); body not run, "
            "redelivering in %.1fs: %s",
            self.name,
            self.request.id,
            n + 1,
            countdown,
            exc,
        )
        return self._redeliver(
            args, kwargs, countdown=countdown, headers={"ledger_unavailable": n + 1}
        )

    def _wait_briefly(self, store: Any, key: str, settings: Any) -> bool:
        """Poll a live lease for up to ``ledger_wait_poll_seconds``; True if it ended."""
        deadline = time.monotonic() + settings.wait_poll_seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                found = store.peek_status(key)
            except LedgerUnavailable:
                return False
            if found is None:
                return True
            status, left = found
            if status is not EntryStatus.RUNNING or left is None or left <= 0:
                return True
        return False

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


_RUN_BODY = object()
_GATE_EVENT = {
    Gate.RUN: "claimed",
    Gate.TAKEOVER: "resumed",
    Gate.RETURN: "returned",
    Gate.WAIT: "waited",
    Gate.BLOCK: "blocked",
    Gate.CONFLICT: "conflict",
}


def _value(status: EntryStatus | None) -> str | None:
    return None if status is None else status.value


def _header(req: Any, name: str) -> Any:
    value = getattr(req, name, None)
    if value is None and isinstance(getattr(req, "headers", None), dict):
        value = req.headers.get(name)
    return value


def _snapshot(args: tuple[Any, ...], kwargs: dict[str, Any], req: Any) -> str | None:
    """Arguments and routing needed to re-enqueue this task; None if not JSON-able."""
    delivery = req.delivery_info or {}
    data = {
        "args": list(args),
        "kwargs": kwargs,
        "queue": delivery.get("routing_key") or None,
        "ledger_key": _header(req, "ledger_key"),
    }
    try:
        return encode(data, limit=16 * 1024 * 1024, what="argument snapshot")
    except PayloadError as exc:
        log.warning(
            "no argument snapshot for task_id=%s (%s); recovery will report it, not resume it",
            req.id,
            exc,
        )
        return None


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _provider_key(key: str, ident: tuple[str, str, int]) -> str:
    from celery_ledger.ledger import provider_key

    return provider_key(key, ident[0], ident[2])


def _row(
    ident: tuple[str, str, int], status: StepStatus, fence: int, output: str | None = None
) -> StepRecord:
    return StepRecord(
        name=ident[0],
        input_hash=ident[1],
        occurrence=ident[2],
        seq=0,
        status=status,
        fence=fence,
        output=output,
    )


def store_write(
    attempt: Attempt, ident: tuple[str, str, int], status: StepStatus, output: str | None = None
) -> bool:
    row = attempt.replay.get(ident)
    return attempt.store.write_step(
        attempt.key, attempt.fence, ident, seq=row.seq if row else 0, status=status, output=output
    )

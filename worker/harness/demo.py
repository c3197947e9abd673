"""``celery-ledger demo``: watch plain Celery lose and duplicate orders, and the ledger not.

One workload, three runs side by side, each with its own worker (and queue) and the same crash
schedule:

1. **enqueue**: start the workers (and beat for the ledgered run); send N orders to each.
2. **crash**: once every pool process is in the middle of an order, SIGKILL the whole worker
   (parent and pool) and restart it under the same node name; then SIGKILL the pool process
   running an order that has charged the card and not yet sent the receipt.
3. **recover**: plain Celery does what it does; the ledgered worker's boot sweep and beat's
   sweep (every 1 s, lease 3 s) resume what was cut.
4. **verify**: count the effects table and the ledger.

"Lost" is an accepted order that never completed and is not parked; a ledgered order parked
``blocked`` (with a reason) is reported apart. "Charged twice" is an order with two or more
charge rows. Nothing here is hard-coded: the table shows what the run measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import click

from celery_ledger.harness import demo_app
from celery_ledger.harness.demo_app import RunReport
from celery_ledger.harness.orchestrate import (
    Phases,
    RunKind,
    Workload,
    concurrency_option,
    json_option,
    run_command,
    safe_url,
    side_by_side,
    staged,
)
from celery_ledger.harness.processes import READY_TIMEOUT, Process, ProcessFailed, wait_ready

#: Each crash waits at most this long for its moment; then it is skipped and said so.
CRASH_WAIT_SECONDS = 20.0

KINDS = (
    RunKind("plain", demo_app.PLAIN, "plain Celery", "(early ack)"),
    RunKind("acks_late", demo_app.PLAIN_ACKS_LATE, "plain Celery", "(acks_late)"),
    RunKind("ledgered", demo_app.LEDGERED, "celery-ledger", "(LedgerTask)", ledgered=True),
)


class DemoRun:
    """One column of the table: a workload and its crash schedule.

    The whole worker dies first, while every pool process is in the middle of an order; it
    restarts under the same node name; then one pool process dies right after its order
    charged the card. (In this order because a worker killed while it holds a message it has
    not yet started loses that message on ``filesystem://`` before any task, ledgered or not,
    could record it; see ``celery-ledger verify`` for random crashes.)
    """

    def __init__(self, work: Workload, gap: float) -> None:
        self.work = work
        self.gap = gap
        self.stage = "worker"
        self._since = time.monotonic()

    @property
    def worker(self) -> Process:
        return self.work.workers["w"]

    def tick(self) -> bool:
        """Advance the schedule one poll; True once every crash is done (or skipped)."""
        snap = self.work.refresh()
        crashes = self.work.report.crashes
        waited = time.monotonic() - self._since
        if self.stage == "worker":
            in_flight = snap.with_effect("reserve") - snap.with_effect("receipt")
            # Mid-flight means between two effects: every order in flight performed its last
            # effect less than half a gap ago, so none is inside a step (a kill there leaves
            # a step that may have run, parked for an operator: the story of `verify`).
            now = time.time()
            between = all(now - max(snap.orders[o].at.values()) < self.gap / 2 for o in in_flight)
            # Pool processes half a gap out of phase are never all just past an effect: once
            # half the orders are done (or time runs short), any moment with one in flight
            # will do. A kill inside a step parks that order for an operator; it loses nothing.
            done = len(snap.with_effect("receipt"))
            late = waited > CRASH_WAIT_SECONDS / 2 or 2 * done >= len(self.work.order_ids)
            if in_flight and (
                (waited > 0.5 and len(in_flight) >= self.work.concurrency and between) or late
            ):
                self.worker.kill()
                crashes.append(
                    f"SIGKILL whole worker (pid {self.worker.pid} and its pool) "
                    f"with {len(in_flight)} order(s) in flight; restarted"
                )
                self.work.restart("w")
                self._next("restart")
            elif waited > CRASH_WAIT_SECONDS:
                crashes.append("worker kill skipped: no order was in flight")
                self._next("child")
        elif self.stage == "restart":
            if self.worker.is_ready():
                self.work.mark_progress()
                self._next("child")
            elif waited > READY_TIMEOUT:
                raise ProcessFailed(
                    f"{self.worker.name} not ready after "
                    f"{READY_TIMEOUT:.0f}s:\n{self.worker.log_tail()}"
                )
        elif self.stage == "child":
            # The pool process of an order that charged the card and sent no receipt yet:
            # plain Celery forgets the order, or charges it again on redelivery.
            charged = snap.with_effect("charge") - snap.with_effect("receipt")
            children = self.worker.children()
            for order_id in sorted(charged):
                pid = snap.orders[order_id].pids["charge"]
                if pid in children and self.worker.kill_child(pid):
                    crashes.append(
                        f"SIGKILL pool process {pid} after {order_id} charged, before its receipt"
                    )
                    self._next("done")
                    break
            else:
                if waited > CRASH_WAIT_SECONDS:
                    crashes.append(
                        "pool-process kill skipped: no order was between charge and receipt"
                    )
                    self._next("done")
        return self.stage == "done"

    def _next(self, stage: str) -> None:
        self.stage = stage
        self._since = time.monotonic()


@dataclass
class DemoReport:
    ok: bool
    orders: int
    concurrency: int
    broker: str
    ledger: str
    data_dir: str
    kept: bool
    seconds: float
    runs: dict[str, RunReport]
    commands: list[str]


def run_demo(
    *,
    orders: int,
    concurrency: int,
    gap: float,
    broker: str | None,
    ledger: str | None,
    keep: bool,
    phases: Phases,
) -> DemoReport:
    """Run the three workloads side by side; always stop every process and clean up."""
    started = time.monotonic()
    with staged(
        "celery-ledger-demo", broker=broker, ledger=ledger, keep=keep, phases=phases
    ) as stage:
        works = [stage.workload(k, orders=orders, concurrency=concurrency) for k in KINDS]
        with phases.phase("enqueue"):
            procs = [w.start_worker("w") for w in works]
            procs += [w.start_beat() for w in works if w.kind.ledgered]
            phases.update(f"starting {len(procs)} processes ...")
            wait_ready(procs)
            for w in works:
                w.enqueue([gap] * orders)
            phases.done(
                f"{len(works)} workers (+ beat for the ledger) up; {orders} orders sent to each"
            )
        with phases.phase("crash"):
            runs = [DemoRun(w, gap) for w in works]
            deadline = time.monotonic() + 2 * CRASH_WAIT_SECONDS + READY_TIMEOUT
            pending = list(runs)
            while pending and time.monotonic() < deadline:
                pending = [r for r in pending if not r.tick()]
                phases.update(" · ".join(f"{r.work.kind.id}: {r.stage}" for r in runs))
                time.sleep(0.05)
            kills = sum(1 for w in works for c in w.report.crashes if c.startswith("SIGKILL"))
            phases.done(
                f"SIGKILLed {kills} times: each whole worker mid-flight (restarted),"
                " then a pool process right after its order charged the card"
            )
        with phases.phase("recover"):
            stage.settle(
                60 + orders * gap,
                interval=0.2,
                update=lambda: phases.update(
                    " · ".join(
                        f"{w.kind.id} {w.completed()}/{orders}" + (" done" if w.finished else "")
                        for w in works
                    )
                ),
            )
            phases.done(
                "plain Celery drained what it still had; the ledger's boot sweep "
                "and beat sweep resumed what was cut"
            )
        stage.orch.stop_all()
        with phases.phase("verify"):
            reports = stage.tally()
            led = reports["ledgered"]
            phases.done(
                f"counted effects and ledger entries: the ledgered run lost "
                f"{led.lost + led.never_claimed}, duplicated "
                f"{led.duplicate_effects}"
            )
    box = stage.box
    return DemoReport(
        ok=(
            led.lost == 0
            and led.never_claimed == 0
            and led.duplicate_effects == 0
            and led.charged_twice == 0
        ),
        orders=orders,
        concurrency=concurrency,
        broker=safe_url(box.broker_url) or "filesystem://",
        ledger=safe_url(box.ledger_url),
        data_dir=str(box.data_dir),
        kept=keep,
        seconds=round(time.monotonic() - started, 1),
        runs=reports,
        commands=box.ledger_commands(led.resumed_keys[:1]) if keep else [],
    )


# -- output -----------------------------------------------------------------------------------


ROWS = [
    ("orders completed", lambda r, n: f"{r.completed}/{n}"),
    ("lost", lambda r, n: str(r.lost + r.never_claimed)),
    ("charged twice", lambda r, n: str(r.charged_twice)),
    ("duplicate effects", lambda r, n: str(r.duplicate_effects)),
    ("blocked (parked)", lambda r, n: str(r.blocked) if r.ledgered else "-"),
    ("resumed", lambda r, n: str(r.resumed) if r.ledgered else "-"),
    ("steps replayed", lambda r, n: str(r.steps_replayed) if r.ledgered else "-"),
    ("time taken", lambda r, n: f"{r.seconds:.1f}s"),
]


def render(report: DemoReport) -> str:
    runs = [report.runs[k.id] for k in KINDS]
    lines = side_by_side(KINDS, runs, ROWS, report.orders)
    led = report.runs["ledgered"]
    lines.append("")
    for k, r in zip(KINDS, runs, strict=True):
        for crash in r.crashes:
            lines.append(f"  {k.id:<10} {crash}")
    if led.reconciler:
        answers = ", ".join(f"{v} {n}" for v, n in sorted(led.reconciler.items()))
        lines.append(f"  ledgered   reconciler asked about an interrupted step: {answers}")
    for b in led.blocked_orders:
        lines.append(
            f"  blocked    {b['order_id']}: step {', '.join(b['ambiguous_steps']) or '?'}"
            f" may have run: {b['reason']}"
        )
    lines.append("")
    if report.ok:
        lines.append(
            click.style("OK", fg="green", bold=True)
            + f": the ledgered run lost nothing and duplicated nothing "
            f"({led.completed} completed, {led.blocked} parked for an operator)."
        )
    else:
        lost = led.lost_orders + led.never_claimed_orders
        lines.append(
            click.style("FAIL", fg="red", bold=True)
            + f": the ledgered run lost {led.lost + led.never_claimed} "
            f"({led.never_claimed} never claimed) and duplicated "
            f"{led.duplicate_effects} effect(s); lost: {', '.join(lost)}"
        )
    lines.append(f"Took {report.seconds:.0f}s on {report.broker} with ledger {report.ledger}.")
    if report.kept:
        lines.append(f"Data kept in {report.data_dir}; look at the ledger with:")
        lines.extend(f"  {c}" for c in report.commands)
    return "\n".join(lines)


@click.command("demo")
@click.option(
    "--orders", type=click.IntRange(1, 1000), default=24, show_default=True, help="Orders per run."
)
@json_option
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the data directory, ledger rows and broker keys for `celery-ledger list/show`.",
)
@click.option(
    "--broker",
    metavar="URL",
    help="Broker URL (e.g. redis://127.0.0.1:6379/0); default: filesystem://.",
)
@click.option(
    "--ledger",
    "ledger_url",
    metavar="URL",
    help="Ledger URL (e.g. postgresql://...); default: SQLite in the data directory.",
)
@concurrency_option
@click.option(
    "--gap",
    type=click.FloatRange(0.05, 5.0),
    default=0.25,
    show_default=True,
    help="Seconds of work between an order's effects.",
)
def demo(
    orders: int,
    as_json: bool,
    keep: bool,
    broker: str | None,
    ledger_url: str | None,
    concurrency: int,
    gap: float,
) -> None:
    """Crash real workers under plain Celery and under the ledger; compare what survived."""
    run_command(
        "the demo",
        header=f"celery-ledger demo: {orders} orders per run (quote, reserve, charge, "
        f"receipt), {concurrency} pool processes per worker, 3 runs side by side",
        as_json=as_json,
        run=lambda phases: run_demo(
            orders=orders,
            concurrency=concurrency,
            gap=gap,
            broker=broker,
            ledger=ledger_url,
            keep=keep,
            phases=phases,
        ),
        render=render,
    )


COMMANDS = [demo]

"""The process harness itself (``celery_ledger.harness.processes``), on a trivial ``python -c``
parent that forks one child, standing in for a Celery worker and its pool: stopping reaches a
paused process and the whole group, SIGTERM goes to the parent only, and every wait ends
within its bound.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celery_ledger.harness.processes import (
    Process,
    ProcessFailed,
    ProcessGroup,
    WaitTimeout,
    child_env,
    group_alive,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process states from /proc"
)

#: A parent that forks one child (its "pool process"), both running until signalled. With
#: ``ignore`` the parent ignores SIGTERM; otherwise it exits on it, leaving its child orphaned
#: in the group. Each says in the log when it got SIGTERM.
FORKING = r"""
import os, signal, sys, time
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, lambda *_: (print("child got SIGTERM", flush=True), os._exit(1)))
    print("child ready", flush=True)
    while True:
        time.sleep(0.05)
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: (print("parent got SIGTERM", flush=True), os._exit(0)))
print(f"child pid {child}", flush=True)
print("parent ready", flush=True)
while True:
    time.sleep(0.05)
"""


def forking(group: ProcessGroup, name: str, on_term: str = "exit") -> tuple[Process, int]:
    """Start a forking parent; wait until both it and its child are set up. Returns the child's
    pid, as the parent printed it."""
    proc = group.spawn(name, [sys.executable, "-c", FORKING, on_term], ready_marker="parent ready")
    proc.wait_ready(timeout=30)
    proc.wait_log("child ready", timeout=30)
    # Parent and child write to one log: a line of one may land inside a line of the other.
    found = re.search(r"child pid (\d+)", proc.log_text())
    assert found, proc.log_text()
    return proc, int(found.group(1))


def state(pid: int) -> str | None:
    """The process's state letter, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat[stat.rindex(")") + 2]


def gone(pid: int) -> bool:
    # A zombie has exited; only its (new) parent's wait is missing.
    return state(pid) in (None, "Z")


def test_stop_resumes_a_paused_process_and_stops_it_warmly_leaving_no_child(
    tmp_path: Path,
) -> None:
    with ProcessGroup(tmp_path) as group:
        proc, child = forking(group, "paused")
        assert proc.children() == [child]
        proc.pause()
        wait_for(lambda: state(proc.pid) == "T" and state(child) == "T", timeout=10, what="stop")

        proc.stop(timeout=10)

        assert proc.proc is not None and proc.proc.returncode == 0  # its own SIGTERM exit
        log = proc.log_text()
        assert "parent got SIGTERM" in log
        assert "child got SIGTERM" not in log  # SIGTERM went to the parent only
        assert gone(child) and not group_alive(proc.pid)
        assert not proc.alive and not proc.paused


def test_stop_kills_the_group_when_the_parent_ignores_sigterm(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        proc, child = forking(group, "stubborn", "ignore")
        started = time.monotonic()
        proc.stop(timeout=0.5)
        assert time.monotonic() - started < 0.5 + 10  # the SIGKILL'd parent's reaping bound
        assert proc.proc is not None and proc.proc.returncode == -9
        # Gone when stop returns, not some time later: the demo checks right after it exits.
        assert gone(child) and not group_alive(proc.pid)
        proc.stop()  # twice is harmless


def test_leaving_the_group_by_an_exception_stops_every_process(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path, stop_timeout=1)
    with pytest.raises(RuntimeError, match="the test failed"), group:
        first, first_child = forking(group, "first")
        second, second_child = forking(group, "second", "ignore")
        raise RuntimeError("the test failed")
    for pid in (first.pid, first_child, second.pid, second_child):
        wait_for(lambda pid=pid: gone(pid), timeout=10, what=f"{pid} to go")
    with pytest.raises(RuntimeError, match="stopped"):
        group.spawn("late", [sys.executable, "-c", "pass"])


def test_kill_child_kills_only_a_child_of_the_process(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        proc, child = forking(group, "parent")
        other, other_child = forking(group, "other")
        assert proc.kill_child(other.pid) is False
        assert proc.kill_child(other_child) is False
        assert other.alive and not gone(other_child)
        assert proc.kill_child(child) is True
        wait_for(lambda: gone(child), timeout=10, what="the child to die")
        assert proc.alive


def test_a_wait_that_never_comes_true_fails_within_its_bound() -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="waiting for the impossible"):
        wait_for(lambda: False, timeout=0.5, interval=0.05, what="the impossible")
    took = time.monotonic() - started
    assert 0.5 <= took < 0.5 + 5
    assert wait_for(lambda: 42, timeout=0) == 42


def test_a_check_ends_a_wait_early() -> None:
    def dead() -> None:
        raise RuntimeError("it died")

    with pytest.raises(RuntimeError, match="it died"):
        wait_for(lambda: False, timeout=60, check=dead)


def test_a_process_that_exits_before_it_is_ready_fails_with_its_log(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        argv = [sys.executable, "-c", "import sys; print('no broker here'); sys.exit(3)"]
        proc = group.spawn("early", argv, ready_marker=" ready.")
        with pytest.raises(ProcessFailed, match="exited with status 3") as failed:
            proc.wait_ready(timeout=30)
        assert "no broker here" in str(failed.value)
        with pytest.raises(ProcessFailed, match="exited with status 3"):
            proc.wait_log("anything", timeout=30)


def test_a_process_not_ready_in_time_fails_with_its_log(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        argv = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"]
        proc = group.spawn("slow", argv, ready_marker=" ready.")
        proc.wait_log("starting", timeout=30)
        with pytest.raises(ProcessFailed, match="slow not ready after 1s") as failed:
            wait_ready([proc], timeout=1)
        assert "starting" in str(failed.value)
        with pytest.raises(WaitTimeout, match="'never' in slow.log"):
            proc.wait_log("never", timeout=0.3)


def test_child_env_drops_prefixes_and_puts_pythonpath_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://elsewhere")
    monkeypatch.setenv("PYTHONPATH", "/theirs")
    env = child_env(
        {"CELERY_LEDGER_URL": "sqlite://"}, drop_prefixes=("CELERY_",), pythonpath=[tmp_path]
    )
    assert "CELERY_BROKER_URL" not in env
    assert env["CELERY_LEDGER_URL"] == "sqlite://"  # what the caller sets is kept
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/theirs"])
    assert child_env({})["CELERY_BROKER_URL"] == "redis://elsewhere"


def test_a_group_process_gets_the_group_environment_and_its_own(tmp_path: Path) -> None:
    script = "import os; print(os.environ.get('CELERY_X'), os.environ['A'], os.environ['B'])"
    with ProcessGroup(tmp_path, env={"A": "group", "B": "group"}, drop_prefixes=("CELERY_",)) as g:
        os.environ["CELERY_X"] = "inherited"
        try:
            proc = g.spawn("env", [sys.executable, "-c", script], env={"B": "own"})
        finally:
            del os.environ["CELERY_X"]
        proc.wait_log("None group own", timeout=30)


#: Starts ``sleep`` through a ProcessGroup while Ctrl-C arrives inside ``Popen``, after the fork
#: (as when the demo is interrupted while it restarts a worker), then leaves the group as the
#: demo does. Prints the pid of the child that Popen started.
INTERRUPTED_START = r"""
import signal, subprocess, sys
from pathlib import Path
from celery_ledger.harness.processes import ProcessGroup

# Ctrl-C raises KeyboardInterrupt, as in a terminal: a process started with SIGINT ignored
# (the test runner's worker can hand that down) would not see the interrupt at all.
signal.signal(signal.SIGINT, signal.default_int_handler)

real = subprocess.Popen

class Interrupted(real):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print(self.pid, flush=True)
        signal.raise_signal(signal.SIGINT)  # the KeyboardInterrupt comes in here

subprocess.Popen = Interrupted
try:
    with ProcessGroup(Path(sys.argv[1]), stop_timeout=2) as group:
        group.spawn("sleeper", ["sleep", "60"])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_during_a_start_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_START, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = proc.stdout.split()
    assert lines[-1:] == ["interrupted"], (proc.stdout, proc.stderr[-2000:])
    pid = int(lines[0])
    try:
        wait_for(lambda: gone(pid), timeout=5, what=f"the started process {pid} to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

"""How the suite is scheduled (``conftest.pytest_collection_modifyitems``). Every test that
touches the shared RabbitMQ runs in the one xdist group that serializes them:
``test_broker_faults.py`` stops the shared server's app and shortens its ``consumer_timeout``
to 1 s, which cuts or closes the connections of any other RabbitMQ test running beside it.
The groups must take under ``--dist loadgroup``, and the longest tests are moved first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run_pytest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pytest ARGS`` from the repository, no cache, with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE.parent,
        env={**os.environ, **(env or {})},
    )


PLUGIN = """
def pytest_collection_finish(session):
    for item in session.items:
        groups = [m.args[0] for m in item.iter_markers("xdist_group")]
        print("GROUP", item.nodeid, ",".join(groups))
"""


def test_the_broker_fault_tests_on_rabbitmq_are_in_the_rabbitmq_group(tmp_path: Path) -> None:
    (tmp_path / "show_groups.py").write_text(PLUGIN)
    out = run_pytest(
        *("--collect-only", "-q", "-p", "show_groups", str(HERE / "test_broker_faults.py")),
        env={"PYTHONPATH": str(tmp_path)},
    )
    groups = {}
    for line in out.stdout.splitlines():
        if line.startswith("GROUP "):
            _, nodeid, names = (line + " ").split(" ", 2)
            groups[nodeid] = names.strip()
    on_rabbitmq = {k: v for k, v in groups.items() if k.endswith("[rabbitmq]")}
    assert len(on_rabbitmq) == 3, out.stdout + out.stderr
    assert set(on_rabbitmq.values()) == {"rabbitmq-server"}, on_rabbitmq


#: Records, as each test is set up, the xdist worker and the node id xdist gave it (``@group``
#: appended when the group took), then skips it: nothing of the test itself runs.
PROBE = """
import os
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + " " + item.nodeid + "\\n")
    pytest.skip("probe: only where it would run")
"""


def test_xdist_keeps_each_group_on_one_worker(tmp_path: Path) -> None:
    """The markers are no use unless xdist sees them: its own ``collection_modifyitems``
    appends ``@group`` to a grouped test's node id, and it must run after ours. Under
    ``-n 2 --dist loadgroup`` every test of a group is set up on one worker, with its
    group in its node id."""
    (tmp_path / "probe.py").write_text(PROBE)
    out_file = tmp_path / "seen.txt"
    proc = run_pytest(
        *("-n", "2", "--dist", "loadgroup", "-p", "probe", "-q"),
        *(str(HERE / "test_broker_faults.py"), str(HERE / "test_verify.py")),
        env={"PYTHONPATH": str(tmp_path), "PROBE_OUT": str(out_file)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = [line.split(" ", 1) for line in out_file.read_text().splitlines()]
    workers: dict[str, set[str]] = {}
    for worker, nodeid in seen:
        assert "@" in nodeid, f"{nodeid} has no group in its node id: xdist did not see it"
        workers.setdefault(nodeid.rpartition("@")[2], set()).add(worker)
    assert set(workers) == {"rabbitmq-server", "chaos-workloads"}, seen
    for group, on in workers.items():
        assert len(on) == 1, f"{group} ran on {sorted(on)}"


def test_every_long_first_entry_names_a_test() -> None:
    """``conftest.LONG_FIRST`` moves the longest tests to the front; an entry left behind by a
    rename would move nothing, silently."""
    from conftest import LONG_FIRST

    out = run_pytest("--collect-only", "-q", str(HERE))
    names = [line.rpartition("/")[2] for line in out.stdout.splitlines() if "::" in line]
    assert len(names) > 100, out.stdout[-2000:] + out.stderr[-2000:]
    for prefix in LONG_FIRST:
        assert any(n.startswith(prefix) for n in names), f"{prefix} names no test"

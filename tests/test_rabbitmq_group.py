"""Every test that touches the shared RabbitMQ runs in the one xdist group that serializes
them (``conftest.pytest_collection_modifyitems``): ``test_broker_faults.py`` stops the shared
server's app and shortens its ``consumer_timeout`` to 1 s, which cuts or closes the
connections of any other RabbitMQ test running beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PLUGIN = """
def pytest_collection_finish(session):
    for item in session.items:
        groups = [m.args[0] for m in item.iter_markers("xdist_group")]
        print("GROUP", item.nodeid, ",".join(groups))
"""


def test_the_broker_fault_tests_on_rabbitmq_are_in_the_rabbitmq_group(tmp_path: Path) -> None:
    (tmp_path / "show_groups.py").write_text(PLUGIN)
    here = Path(__file__).parent
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "show_groups"]
        + ["-p", "no:cacheprovider", str(here / "test_broker_faults.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=here.parent,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    groups = {}
    for line in out.stdout.splitlines():
        if line.startswith("GROUP "):
            _, nodeid, names = (line + " ").split(" ", 2)
            groups[nodeid] = names.strip()
    on_rabbitmq = {k: v for k, v in groups.items() if k.endswith("[rabbitmq]")}
    assert len(on_rabbitmq) == 3, out.stdout + out.stderr
    assert set(on_rabbitmq.values()) == {"rabbitmq-server"}, on_rabbitmq

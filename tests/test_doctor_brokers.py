"""``doctor``'s broker checks (design.md § "Recovery"), through the installed console script.

RabbitMQ: ``consumer_timeout`` shorter than the longest lease, classic queues without publisher
confirms, a quorum queue's ``x-delivery-limit`` against ``ledger_max_resumes``. Redis:
``visibility_timeout`` shorter than the lease. Each is one line; ``--strict`` turns a WARN into
exit status 1; a value doctor cannot read is one ``Error:`` line, exit 1, no traceback. Doctor
never opens the broker, so none of these needs a server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

BIN = Path(sys.executable).parent


def doctor(tmp_path: Path, conf: str, *args: str, broker: str = "amqp://guest@127.0.0.1//"):
    """Run ``celery-ledger -A doctorapp doctor ARGS`` on an app whose config is ``conf``."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    (tmp_path / "doctorapp.py").write_text(
        textwrap.dedent(
            f"""
            from kombu import Exchange, Queue
            from celery_ledger import create_app

            app = create_app("doctorapp", broker_url={broker!r}, ledger_url={ledger!r},
                             result_backend="cache+memory://")
            """
        )
        + textwrap.dedent(conf)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env["PYTHONPATH"] = str(tmp_path)
    subprocess.run(
        [str(BIN / "celery-ledger"), "--url", ledger, "migrate"],
        env=env,
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    return subprocess.run(
        [str(BIN / "celery-ledger"), "-A", "doctorapp", "doctor", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def checks(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


def one_warning(tmp_path: Path, conf: str, check: str, words: str, **kw: str) -> None:
    found = checks(doctor(tmp_path, conf, "--json", **kw))[check]
    assert found["status"] == "WARN" and words in found["reason"], found
    strict = doctor(tmp_path, conf, "--strict", **kw)
    assert strict.returncode == 1, strict
    lines = [line for line in strict.stdout.splitlines() if line.startswith(check)]
    assert len(lines) == 1 and "WARN" in lines[0] and words.split(":")[0] in lines[0], lines
    assert "Traceback" not in strict.stderr
    assert doctor(tmp_path, conf, **kw).returncode == 0  # a WARN alone fails only --strict


def test_rabbitmq_consumer_timeout_shorter_than_the_lease(tmp_path):
    one_warning(
        tmp_path,
        "app.conf.ledger_rabbitmq_consumer_timeout = 30000\n",
        "visibility",
        "consumer_timeout 30s (server) < lease 60s",
    )


def test_rabbitmq_queue_consumer_timeout_argument_is_read(tmp_path):
    one_warning(
        tmp_path,
        """
        app.conf.task_queues = [Queue("q", queue_arguments={
            "x-queue-type": "quorum", "x-consumer-timeout": 10000})]
        """,
        "visibility",
        "consumer_timeout 10s (queue) < lease 60s",
    )


def test_rabbitmq_classic_queues_without_confirms(tmp_path):
    one_warning(tmp_path, "", "rabbitmq", "without publisher confirms")


def test_rabbitmq_delivery_limit_at_or_below_max_resumes(tmp_path):
    one_warning(
        tmp_path,
        """
        app.conf.task_queues = [Queue("q", queue_arguments={
            "x-queue-type": "quorum", "x-delivery-limit": 3})]
        """,
        "rabbitmq",
        "x-delivery-limit 3 <= ledger_max_resumes 5",
    )


def test_rabbitmq_passes_with_quorum_queues_and_a_higher_limit(tmp_path):
    conf = """
    app.conf.task_queues = [Queue("q", queue_arguments={
        "x-queue-type": "quorum", "x-delivery-limit": 20})]
    """
    found = checks(doctor(tmp_path, conf, "--json"))
    assert found["rabbitmq"]["status"] == "PASS", found["rabbitmq"]
    assert found["visibility"]["status"] == "PASS", found["visibility"]


def test_redis_visibility_timeout_shorter_than_the_lease(tmp_path):
    one_warning(
        tmp_path,
        'app.conf.broker_transport_options = {"visibility_timeout": 30}\n',
        "visibility",
        "lease 60s > visibility_timeout 30s",
        broker="redis://127.0.0.1:6379/0",
    )


def test_unreadable_broker_values_are_one_line(tmp_path):
    for conf, words in (
        ('app.conf.ledger_rabbitmq_consumer_timeout = "soon"\n', "is not a number"),
        (
            'app.conf.task_queues = [Queue("q", queue_arguments={"x-delivery-limit": "abc"})]\n',
            "x-delivery-limit of queue q is 'abc', not a count",
        ),
    ):
        proc = doctor(tmp_path, conf)
        assert proc.returncode == 1, proc
        errors = proc.stderr.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("Error: ") and words in errors[0], errors
        assert "Traceback" not in proc.stderr

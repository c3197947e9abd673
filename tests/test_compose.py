"""docker-compose.yml and the Dockerfile: accepted by a compose client, and shaped as promised.

No engine is needed: ``docker compose config`` (or the older ``docker-compose config``)
validates and interpolates the file without contacting a daemon, and the structural checks
below read it with PyYAML. No image is built or pulled.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).parent.parent
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"

RESTART_POLICIES = re.compile(r"^(no|always|unless-stopped|on-failure(:\d+)?)$")
LONG_RUNNING = ("redis", "postgres", "worker-1", "worker-2", "beat", "flower", "metrics")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def command_text(service: dict[str, Any]) -> str:
    cmd = service.get("command", "")
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def compose_client() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose`` (v1), whichever works here."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30
        ).returncode
        == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def run_config(client: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FLOWER_BASIC_AUTH", "CELERY_APP", "POSTGRES_PASSWORD")
    }
    return subprocess.run(
        [*client, "-f", str(COMPOSE), "config", "-q"],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_compose_client_accepts_the_file() -> None:
    client = compose_client()
    if client is None:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` is installed; the "
            "structural tests below still run"
        )
    ok = run_config(client, {"FLOWER_BASIC_AUTH": "admin:secret"})
    assert ok.returncode == 0, ok.stderr
    # Flower is never started open: without credentials the stack does not even configure.
    refused = run_config(client, {})
    assert refused.returncode != 0
    assert "FLOWER_BASIC_AUTH" in refused.stderr


def test_the_stack_has_every_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {
        "redis",
        "postgres",
        "migrate",
        "worker-1",
        "worker-2",
        "beat",
        "flower",
        "metrics",
    }


def test_every_service_has_a_restart_policy_and_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert RESTART_POLICIES.match(str(service.get("restart", ""))), name
        check = service.get("healthcheck") or {}
        if name in LONG_RUNNING:
            assert check.get("test"), f"{name} has no healthcheck"
            assert {"interval", "timeout", "retries"} <= set(check), name
    # The one-shot exits: its health is its exit code, which dependants wait for.
    migrate = compose["services"]["migrate"]
    assert migrate["healthcheck"] == {"disable": True}
    assert migrate["restart"].startswith("on-failure")
    assert command_text(migrate) == "celery-ledger migrate"


def test_postgres_keeps_its_data_in_a_volume(compose: dict[str, Any]) -> None:
    volumes = compose["services"]["postgres"]["volumes"]
    named = [v.split(":")[0] for v in volumes if v.endswith(":/var/lib/postgresql/data")]
    assert named and named[0] in compose["volumes"]


def test_everything_on_the_ledger_waits_for_the_migration(compose: dict[str, Any]) -> None:
    for name in ("worker-1", "worker-2", "beat", "flower", "metrics"):
        deps = compose["services"][name]["depends_on"]
        assert deps["migrate"] == {"condition": "service_completed_successfully"}, name
        assert deps["postgres"] == {"condition": "service_healthy"}, name
        assert deps["redis"] == {"condition": "service_healthy"}, name
        env = compose["services"][name]["environment"]
        assert env["CELERY_LEDGER_URL"].startswith("postgresql://"), name
        assert env["CELERY_BROKER_URL"].startswith("redis://redis:"), name


def test_two_workers_send_events_under_distinct_stable_node_names(compose: dict[str, Any]) -> None:
    names = set()
    for name in ("worker-1", "worker-2"):
        service = compose["services"][name]
        cmd = command_text(service)
        assert " worker " in cmd and " -E " in cmd, cmd
        node = re.search(r"-n (\S+)", cmd)
        assert node is not None, cmd
        names.add(node.group(1))
        assert service["hostname"] == name, "a fixed hostname keeps the node name on restart"
        assert service["environment"]["CELERY_LEDGER_SEND_EVENTS"] == "1"
    assert len(names) == 2


def test_flower_runs_the_ledger_flowerconfig_with_authentication(compose: dict[str, Any]) -> None:
    flower = compose["services"]["flower"]
    cmd = command_text(flower)
    conf = re.search(r"--conf=(\S+)", cmd)
    assert conf is not None, cmd
    # The Dockerfile copies worker/ into its WORKDIR: the path must be that file.
    workdir = re.search(r"^WORKDIR (\S+)$", DOCKERFILE.read_text(), re.M)
    assert workdir is not None
    relative = Path(conf.group(1)).relative_to(workdir.group(1))
    assert relative == Path("worker/flowerconfig.py") and (REPO / relative).is_file()
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert "FLOWER_UNAUTHENTICATED_API" not in flower["environment"]
    # Published on the host's loopback only (Flower's /metrics is unauthenticated).
    assert all(str(p).startswith("127.0.0.1:") for p in flower["ports"])


def test_the_dockerfile_builds_the_project_as_a_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    instructions = [
        line.split(None, 1)
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith((" ", "\t"))
    ]
    keywords = [i[0] for i in instructions]
    assert keywords[0] == "FROM" and instructions[0][1].startswith("python:3.")
    assert "pip install ." in text
    user = [i[1] for i in instructions if i[0] == "USER"]
    assert user and user[-1] not in ("root", "0")
    for keyword, args in instructions:
        if keyword == "COPY":
            *sources, _dest = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"the Dockerfile copies missing {source}"


# -- the same stack on RabbitMQ (docker-compose.rabbitmq.yml) -------------------------------

RABBITMQ_OVERRIDE = REPO / "docker-compose.rabbitmq.yml"


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of an override file: mappings merge key by key, the rest replaces."""
    out = dict(base)
    for key, value in override.items():
        if key.startswith("x-"):
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def rabbitmq_stack(compose: dict[str, Any]) -> dict[str, Any]:
    return merged(compose, dict(yaml.safe_load(RABBITMQ_OVERRIDE.read_text())))


def test_the_rabbitmq_override_runs_every_ledger_service_on_rabbitmq(
    rabbitmq_stack: dict[str, Any],
) -> None:
    services = rabbitmq_stack["services"]
    rabbit = services["rabbitmq"]
    assert RESTART_POLICIES.match(rabbit["restart"])
    assert {"test", "interval", "timeout", "retries"} <= set(rabbit["healthcheck"])
    named = [v.split(":")[0] for v in rabbit["volumes"] if v.endswith(":/var/lib/rabbitmq")]
    assert named and named[0] in rabbitmq_stack["volumes"]
    # consumer_timeout above any task, and doctor told the same value.
    timeout = re.search(
        r"consumer_timeout (\d+)", rabbit["environment"]["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"]
    )
    assert timeout is not None
    for name in ("migrate", "worker-1", "worker-2", "beat", "flower", "metrics"):
        env = services[name]["environment"]
        assert env["CELERY_BROKER_URL"].startswith("amqp://ledger:"), name
        assert "@rabbitmq:5672/" in env["CELERY_BROKER_URL"], name
        assert env["CELERY_TASK_DEFAULT_QUEUE_TYPE"] == "quorum", name
        assert env["CELERY_LEDGER_RABBITMQ_CONSUMER_TIMEOUT"] == timeout.group(1), name
        assert env["CELERY_LEDGER_URL"].startswith("postgresql://"), name  # kept from the base
    for name in ("worker-1", "worker-2", "beat", "flower", "metrics"):
        deps = services[name]["depends_on"]
        assert deps["rabbitmq"] == {"condition": "service_healthy"}, name
        assert deps["migrate"] == {"condition": "service_completed_successfully"}, name


def test_the_rabbitmq_stacks_app_declares_quorum_queues_on_a_topic_exchange(
    rabbitmq_stack: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment the override gives a worker, read by ``create_app`` here (no engine,
    no broker): the queue Celery declares is a quorum queue, and countdowns take RabbitMQ's
    native delayed delivery (a topic exchange)."""
    from celery_ledger import create_app

    env = rabbitmq_stack["services"]["worker-1"]["environment"]
    for key in ("CELERY_BROKER_URL", "CELERY_TASK_DEFAULT_QUEUE_TYPE"):
        monkeypatch.setenv(key, str(env[key]).replace("${RABBITMQ_PASSWORD:-ledger}", "ledger"))
    app = create_app("stack", data_dir=tmp_path, ledger_url=f"sqlite:///{tmp_path / 'l.db'}")
    queue = app.amqp.queues[app.conf.task_default_queue]
    assert queue.queue_arguments == {"x-queue-type": "quorum"}
    assert queue.exchange.type == "topic"
    app.close()


def test_a_compose_client_accepts_the_rabbitmq_override() -> None:
    client = compose_client()
    if client is None:
        pytest.skip("no compose client here; the structural tests above still run")
    proc = subprocess.run(
        [*client, "-f", str(COMPOSE), "-f", str(RABBITMQ_OVERRIDE), "config", "-q"],
        cwd=REPO,
        env={**os.environ, "FLOWER_BASIC_AUTH": "admin:secret"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr

"""Reaching the test servers: PostgreSQL, Redis and RabbitMQ on 127.0.0.1.

A missing server skips the test on a laptop and fails it under CI=true (dramatiq's conftest):
a CI run that silently skipped every server test would prove nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import time
import uuid

import pytest

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_ADMIN_URL = os.environ.get(
    "CELERY_LEDGER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_HOST = os.environ.get("CELERY_LEDGER_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("CELERY_LEDGER_TEST_REDIS_PORT", "6379"))
RABBITMQ_HOST = os.environ.get("CELERY_LEDGER_TEST_RABBITMQ_HOST", "127.0.0.1")
RABBITMQ_PORT = int(os.environ.get("CELERY_LEDGER_TEST_RABBITMQ_PORT", "5672"))
#: rabbitmqctl talks to the node on this machine (the tests add and delete vhosts with it, and
#: the broker-fault tests stop and start its app).
RABBITMQCTL = os.environ.get("CELERY_LEDGER_TEST_RABBITMQCTL", "rabbitmqctl")


def missing(what: str) -> None:
    """Skip (laptop) or fail (CI) because a server is not reachable."""
    msg = f"{what} is not reachable on 127.0.0.1"
    if CI:
        pytest.fail(f"{msg}, and CI=true requires it", pytrace=False)
    pytest.skip(msg)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pg_url_for(dbname: str) -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{dbname}"


def create_pg_database() -> tuple[str, str]:
    """Create a uniquely named database; return (name, url)."""
    import psycopg

    try:
        conn = psycopg.connect(
            PG_ADMIN_URL.replace("+psycopg", ""), autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError:
        missing("PostgreSQL")
        raise
    name = f"cl_test_{uuid.uuid4().hex[:12]}"
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, pg_url_for(name)


def drop_pg_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


#: Databases this process made and emptied again, for its next tests: ``CREATE DATABASE`` and
#: ``DROP DATABASE`` cost about a second together on this server, and a few hundred tests
#: each want a database of their own. Dropped when the process exits.
_pg_pool: list[str] = []


def drop_pg_pool() -> None:
    while _pg_pool:
        # The server may be gone: nothing else to do then.
        with contextlib.suppress(Exception):
            drop_pg_database(_pg_pool.pop())


def take_pg_database() -> tuple[str, str]:
    """An empty database of this test's own: an emptied one of this process's, or a new one;
    ``give_back_pg_database`` when the test is done with it."""
    if _pg_pool:
        name = _pg_pool.pop()
        return name, pg_url_for(name)
    return create_pg_database()


def give_back_pg_database(name: str) -> None:
    """Empty ``name`` as a new database is (every connection to it ended, its settings reset,
    every schema dropped, ``public`` made again) for the next test; drop it if that fails."""
    import psycopg

    admin_url = PG_ADMIN_URL.replace("+psycopg", "")
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as admin:
            # A test may have refused connections or made the database read-only.
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            admin.execute(f'ALTER DATABASE "{name}" RESET ALL')
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        with psycopg.connect(pg_url_for(name), autocommit=True, connect_timeout=10) as conn:
            schemas = [
                row[0]
                for row in conn.execute(
                    "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'"
                    " AND nspname <> 'information_schema'"
                )
            ]
            for schema in schemas:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
            conn.execute("CREATE SCHEMA public")
            conn.execute("ALTER SCHEMA public OWNER TO pg_database_owner")
            conn.execute("GRANT USAGE ON SCHEMA public TO PUBLIC")
    except Exception:  # noqa: BLE001 - not reusable: a fresh one next time
        drop_pg_database(name)
        return
    if not _pg_pool:
        atexit.unregister(drop_pg_pool)
        atexit.register(drop_pg_pool)
    _pg_pool.append(name)


_redis_db = 0
#: Database 0 holds one claim key per database number, so that concurrent pytest runs (and the
#: processes of one xdist run) on one Redis never flush each other's database.
_CLAIM = "celery-ledger-test:redis-db:{}"
#: A claim outlives any one test (the per-test timeout is 180 s) and then lapses by itself, so a
#: run that was SIGKILLed frees its database without anyone cleaning up.
_CLAIM_SECONDS = 300
#: How long a test waits for a database number when every one is claimed by other runs.
_CLAIM_WAIT_SECONDS = 120


def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _release_redis_claim() -> None:
    """At exit: give this process's database number back at once (not after the claim lapses)."""
    if not _redis_db:
        return
    import redis

    try:
        admin = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=0, socket_timeout=2)
        try:
            key = _CLAIM.format(_redis_db)
            if admin.get(key) == _me().encode():
                admin.delete(key)
        finally:
            admin.close()
    except Exception:  # noqa: BLE001 - the claim lapses by itself anyway
        pass


def redis_url() -> str:
    """A Redis URL on a database number of its own, emptied for this test.

    kombu keeps its unacked-message bookkeeping in fixed key names per database, so two tests
    sharing one database would restore each other's messages. Each test takes the next number
    (1-15) that no other live process has claimed, and gives up this process's previous one.
    """
    global _redis_db
    if not port_open(REDIS_HOST, REDIS_PORT):
        missing("Redis")
    import redis

    me = _me()
    admin = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=0)
    try:
        previous = _redis_db
        if not previous:
            atexit.register(_release_redis_claim)
        deadline = time.monotonic() + _CLAIM_WAIT_SECONDS
        candidate = 0
        while not candidate:
            start = (previous or os.getpid()) % 15
            for step in range(15):
                number = (start + step) % 15 + 1
                key = _CLAIM.format(number)
                if admin.set(key, me, nx=True, ex=_CLAIM_SECONDS) or admin.get(key) == me.encode():
                    admin.expire(key, _CLAIM_SECONDS)
                    candidate = number
                    break
            else:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"all 15 Redis test databases stayed claimed by other pytest runs for "
                        f"{_CLAIM_WAIT_SECONDS}s"
                    )
                time.sleep(1.0)
        if previous and previous != candidate and admin.get(_CLAIM.format(previous)) == me.encode():
            admin.delete(_CLAIM.format(previous))
    finally:
        admin.close()
    _redis_db = candidate
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=_redis_db)
    client.flushdb()
    client.close()
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{_redis_db}"


# -- RabbitMQ ---------------------------------------------------------------------------------


def rabbitmqctl(*args: str, timeout: float = 60) -> str:
    """Run ``rabbitmqctl ARGS`` against the local node; return its output.

    Raises:
        RuntimeError: it exited non-zero (the message quotes its output).
    """
    import subprocess

    proc = subprocess.run(
        [RABBITMQCTL, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"rabbitmqctl {' '.join(args)} exited {proc.returncode}: "
            f"{(proc.stdout + proc.stderr).strip()[-800:]}"
        )
    return proc.stdout


def rabbitmq_available() -> bool:
    import shutil

    return port_open(RABBITMQ_HOST, RABBITMQ_PORT) and shutil.which(RABBITMQCTL) is not None


def create_rabbitmq_vhost() -> tuple[str, str]:
    """A vhost of this test's own on the local RabbitMQ, guest allowed on it: (name, url).

    Queues, exchanges and the native delayed-delivery topology of quorum queues all live in
    the vhost, so parallel tests (and parallel pytest runs) never see each other's messages,
    and deleting the vhost removes everything the test made.
    """
    if not rabbitmq_available():
        missing("RabbitMQ (port 5672 and rabbitmqctl)")
    name = f"cl-test-{uuid.uuid4().hex[:12]}"
    rabbitmqctl("add_vhost", name)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    return name, f"amqp://guest:guest@{RABBITMQ_HOST}:{RABBITMQ_PORT}/{name}"


def delete_rabbitmq_vhost(name: str) -> None:
    rabbitmqctl("delete_vhost", name)

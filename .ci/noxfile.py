"""The Celery versions people run: one nox session per supported Celery minor.

    pip install nox && nox -f .ci/noxfile.py              # every version
    nox -f .ci/noxfile.py -s "celery(minor='5.4')"        # one
    nox -f .ci/noxfile.py -r -s "celery(minor='5.4')" -- tests/test_canvas.py -k chord   # some

Each session installs the project with its test extra, then the Celery minor and the kombu
line that Celery minor was released with (``celery>=5.4`` admits kombu 5.3 too, but the
project asks for ``kombu>=5.4``), and runs what touches Celery most: the store's contract and
schema, the runtime's delivery, replay and crash suites, the canvas tests, and ``verify`` on
the embedded default. Server-backed tests need the same servers and variables as the main
suite (``CELERY_LEDGER_TEST_PG``, ``CELERY_LEDGER_TEST_REDIS_HOST``; see ``.ci/run``).

Where an older Celery or kombu differs, the tests say so at the point they differ, each
naming the versions: ``tests/procs.py::redelivering`` does kombu 5.4 to 5.6's Redis
redelivery once a second, ``tests/test_delivery.py::create_result_tables`` creates Celery
5.4's result tables, and a chord's callback may be delivered twice on Celery 5.4 to 5.6's
Redis backend (``test_chord_member_duplicated_by_visibility_timeout``). What a version lacks
is in docs/pages/limits.md ("Celery and kombu versions"). No test is deselected on any
version: each session runs the whole list.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent

#: Celery minor -> the kombu line released beside it.
VERSIONS = {"5.4": "5.4", "5.5": "5.5", "5.6": "5.6", "5.7": "5.7"}

TESTS = [
    "tests/test_store_contract.py",
    "tests/test_schema.py",
    "tests/test_runtime.py",
    "tests/test_delivery.py",
    "tests/test_replay.py",
    "tests/test_steps_crash.py",
    "tests/test_canvas.py",
    "tests/test_canvas_links.py",
    "tests/test_chord_unlock.py",
    "tests/test_verify.py::test_verify_on_the_embedded_default",
]

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False


@nox.session
@nox.parametrize("minor", list(VERSIONS))
def celery(session: nox.Session, minor: str) -> None:
    session.chdir(ROOT)
    session.install("-e", ".[dev]")
    session.install(f"celery[redis]=={minor}.*", f"kombu=={VERSIONS[minor]}.*")
    session.run(
        "python", "-c", "import celery, kombu; print(celery.__version__, kombu.__version__)"
    )
    # Test ids or pytest options given after ``--`` replace the default list, so one failing
    # test can be rerun alone: nox -f .ci/noxfile.py -r -s "celery(minor='5.4')" -- tests/x.py::t
    args = session.posargs or ["-n", "2", "--dist", "loadgroup", *TESTS]
    session.run("python", "-m", "pytest", *args)

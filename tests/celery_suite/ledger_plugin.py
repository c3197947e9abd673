"""A pytest plugin that runs Celery's own integration tests with every task a ``LedgerTask``.

Loaded by ``.ci/celery-suite`` with ``-p ledger_plugin`` when ``CELERY_SUITE_LEDGER=1``; it
changes nothing in Celery's test files. Celery's fixtures build every test app through
``celery.contrib.testing.app.TestApp``, and ``t/integration/tasks.py`` defines its tasks with
``@shared_task``, which takes its base class from the app (``task_cls``) when the app
finalizes. So wrapping ``TestApp`` here, at import (before Celery's ``conftest`` imports the
tasks), makes every one of them (and Celery's own built-in tasks) a ``LedgerTask``, on an app
the ledger is installed on, with its ledger at ``CELERY_LEDGER_URL``.

Tasks that name their own ``base=`` (``ClassBasedAutoRetryTask``, the stamping tests' task
classes) stay what they name, as they would in a user's code.
"""

from __future__ import annotations

import os
from typing import Any

from celery.contrib.testing import app as testing_app

_TestApp = testing_app.TestApp


def ledgered_test_app(*args: Any, **kwargs: Any) -> Any:
    """Celery's ``TestApp``, with ``LedgerTask`` as its task class and the ledger installed."""
    kwargs.setdefault("task_cls", "celery_ledger.task:LedgerTask")
    app = _TestApp(*args, **kwargs)
    app.conf.ledger_url = os.environ["CELERY_LEDGER_URL"]
    from celery_ledger import install  # only in a ledgered run

    return install(app)


if os.environ.get("CELERY_SUITE_LEDGER") == "1":
    testing_app.TestApp = ledgered_test_app


def pytest_report_header(config: Any) -> str:
    ledgered = os.environ.get("CELERY_SUITE_LEDGER") == "1"
    return f"celery-suite: {'ledgered (every task a LedgerTask)' if ledgered else 'plain Celery'}"

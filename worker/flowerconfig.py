"""Flower configuration for a ledger-aware cluster: ``celery -A proj flower --conf=<this file>``.

Flower executes this file at start (tornado's ``parse_config_file``: a top-level name that is
a Flower option, such as ``max_tasks = 10000``, sets it; any other name is ignored). It does
two things:

- it registers the celery-ledger collector in prometheus_client's default registry, which is
  the one Flower's ``/metrics`` renders, so that page carries the ``celery_ledger_*`` gauges
  next to Flower's own ``flower_events_total{type="task-ledger-..."}``;
- it adds the Ledger page (``/ledger``: overview, stuck list, entries; release and resume
  when ``ledger_flower_actions`` is on) to Flower, behind Flower's own authentication
  (``celery_ledger.flower``). In a Flower configuration of your own, the page is one line:
  ``from celery_ledger.flower import install_in_flower; install_in_flower()``.

The ledger is the one the Flower command's app names (``ledger_url`` / ``CELERY_LEDGER_URL``),
opened read-only and read at most once per ``CELERY_LEDGER_METRICS_TTL`` seconds (default 5).

Authentication is not set here, so no secret lives in a file: pass ``--basic-auth=user:pass``
or set ``FLOWER_BASIC_AUTH`` (or ``FLOWER_AUTH`` with an OAuth provider). Without any of them
Flower's pages are open to anyone who reaches the port, and this file says so in the log.
"""

# Every top-level name here is matched against Flower's options, and tornado defines one
# called ``logging`` (a level): importing the module under that name would fail the start.
import logging as _logging
import os as _os

from tornado.options import options as _flower_options

from celery_ledger.flower import install_in_flower as _install_ledger_page
from celery_ledger.metrics import DEFAULT_TTL_SECONDS, install_in_flower

install_in_flower(ttl=float(_os.environ.get("CELERY_LEDGER_METRICS_TTL", DEFAULT_TTL_SECONDS)))
_install_ledger_page()

if not (_flower_options.basic_auth or _flower_options.auth or _flower_options.auth_provider):
    _logging.getLogger("celery_ledger.flowerconfig").warning(
        "Flower starts without authentication: anyone who reaches its port sees every task's "
        "arguments and results; set FLOWER_BASIC_AUTH or --basic-auth"
    )

"""The operator CLI: ``celery-ledger …`` and ``celery -A proj ledger …``.

- ``celery_ledger.cli.main``: the ``celery-ledger`` console script (the command group);
- ``celery_ledger.cli.plugin``: the ``celery ledger`` sub-command, which Celery imports into
  every ``celery`` command line, so it imports click only and loads the rest on first use;
- ``ops`` (list, show, release, resume, sweep, stats), ``doctor`` (doctor, migrate),
  ``metrics``, and ``common`` (what every command shares).

This module imports nothing, so that loading the plugin loads nothing more.
"""

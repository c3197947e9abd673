"""The Ledger page in Flower: overview, stuck list, entry page, release and resume.

Served by Flower itself (same port, authentication and URL prefix): Flower's ``--conf`` file
calls ``install_in_flower()`` before Flower builds its app (``celery_ledger.flower.hook``).
The shipped ``celery_ledger/flowerconfig.py`` does; in a configuration of your own, add::

    from celery_ledger.flower import install_in_flower; install_in_flower()

Modules: ``hook`` (routes and templates into Flower), ``loader`` (Flower's templates,
patched, and the page's own), ``handlers`` (Tornado handlers), ``views`` (what each page
shows), ``queries`` (the page's bounded, index-driven reads), ``actions`` (release and
resume), ``context`` (per-process store and cached aggregates).

``views``, ``actions``, ``queries`` and ``context`` import neither Flower nor Tornado: the Django
admin (``celery_ledger.contrib.django``) renders and acts through them too. So this package
imports ``hook`` (Tornado and Flower) only when ``install_in_flower`` is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["install_in_flower"]


def __getattr__(name: str) -> Any:
    if name != "install_in_flower":
        raise AttributeError(f"module 'celery_ledger.flower' has no attribute {name!r}")
    value = importlib.import_module("celery_ledger.flower.hook").install_in_flower
    globals()[name] = value
    return value

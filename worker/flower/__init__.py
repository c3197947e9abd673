"""The Ledger page in Flower: overview, stuck list, entry page, release and resume.

Served by Flower itself (same port, authentication and URL prefix): Flower's ``--conf`` file
calls ``install_in_flower()`` before Flower builds its app (``celery_ledger.flower.hook``).
The shipped ``celery_ledger/flowerconfig.py`` does; in a configuration of your own, add::

    from celery_ledger.flower import install_in_flower; install_in_flower()

Modules: ``hook`` (routes and templates into Flower), ``loader`` (Flower's templates,
patched, and the page's own), ``handlers`` (Tornado handlers), ``views`` (what each page
shows), ``queries`` (the page's bounded, index-driven reads), ``actions`` (release and
resume), ``context`` (per-process store and cached aggregates).
"""

from celery_ledger.flower.hook import install_in_flower

__all__ = ["install_in_flower"]

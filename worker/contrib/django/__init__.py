"""The ledger in the Django admin: add ``"celery_ledger.contrib.django"`` to INSTALLED_APPS.

What it gives a Django project (docs/django.md):

- **Ledger entries** in the admin: the list by status, the stuck list (blocked, interrupted,
  running past the lease, retrying past the due time) and a search by key, key prefix, task
  id or group id; each entry's page with its steps, external references, events and the
  command that moves it on. Everything shown is the operator view the CLI and Flower render
  (``celery_ledger.view.entry_detail`` through ``celery_ledger.flower.views``), secrets
  redacted the same way.
- **Release, resume, cancel, mark dead** on the entry page, through the same calls as Flower
  (``celery_ledger.flower.actions``): the store's one-shot release and fenced writes, the
  resume's compare-and-set, and ``ledger_authorizer`` asked last with the Django user.
  Read-only unless ``ledger_authorizer`` is set (``celery_ledger.contrib.django.context``).

Modules: ``apps`` (the app config), ``models`` (one unmanaged model, for the admin's index and
permissions; never queried), ``context`` (the Celery app, settings and store of this process),
``admin`` (the views). The ledger's tables stay Alembic's: this app's one migration creates
no table.
"""

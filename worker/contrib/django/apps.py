"""The app config of ``celery_ledger.contrib.django``."""

from __future__ import annotations

from django.apps import AppConfig


class LedgerAdminConfig(AppConfig):
    """Ledger entries in the Django admin (``celery_ledger.contrib.django``)."""

    name = "celery_ledger.contrib.django"
    #: The admin's URLs and permissions read ``celery_ledger`` (``/admin/celery_ledger/``,
    #: ``celery_ledger.view_ledgerentry``); "django" would collide with Django's own labels.
    label = "celery_ledger"
    verbose_name = "Celery ledger"
    default_auto_field = "django.db.models.AutoField"

"""One unmanaged model: what the admin lists, never what it reads.

``LedgerEntry`` maps ``ledger_entries`` (``celery_ledger.ledger.schema``) by its key only, with
``managed = False``: Django never creates, alters or drops the ledger's tables (Alembic owns
them; workers migrate them), and its one migration is the model's state, no table. The model
exists so that the admin's index links to the ledger and Django's permissions attach to it
(``view_ledgerentry`` lets a staff user see the pages). The admin reads and writes through
``LedgerStore`` (``celery_ledger.contrib.django.admin``), not through this model: the
ledger's URL is ``ledger_url``, which need not be one of Django's ``DATABASES``.
"""

from __future__ import annotations

from django.db import models


class LedgerEntry(models.Model):
    """A ledger entry, by its key (``ledger_entries.key``)."""

    key = models.CharField(max_length=64, primary_key=True)

    class Meta:
        managed = False
        db_table = "ledger_entries"
        verbose_name = "ledger entry"
        verbose_name_plural = "ledger entries"

    def __str__(self) -> str:
        return self.key

from __future__ import annotations

from django.db import models


class Credit(models.Model):
    """One credit per effect: no unique constraint, so a duplicate is a second row."""

    order_id = models.CharField(max_length=64)
    kind = models.CharField(max_length=16)

    class Meta:
        app_label = "djangoproj"
        db_table = "dj_credit"

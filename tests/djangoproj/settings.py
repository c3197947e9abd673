"""Django settings from the environment the test sets: ``TEST_DJANGO_DB`` is the ledger's own
URL, so Django's database is the ledger's (the condition of a Django transaction step)."""

from __future__ import annotations

import os
from urllib.parse import urlparse

_url = os.environ["TEST_DJANGO_DB"]
if _url.startswith("sqlite"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _url.split("sqlite:///", 1)[1],
            # Take the write lock at BEGIN, as the ledger does, and wait for it like the
            # ledger's own connections.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
        }
    }
else:
    _u = urlparse(_url)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _u.path.lstrip("/"),
            "USER": _u.username,
            "HOST": _u.hostname,
            "PORT": _u.port or 5432,
        }
    }

INSTALLED_APPS = ["djangoproj"]
SECRET_KEY = "celery-ledger-tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

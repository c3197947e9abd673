"""Django settings of the admin tests (tests/test_django_admin.py): Django's own database is a
SQLite file (users, sessions); the ledger is elsewhere (PostgreSQL), named only here, through
Celery's Django namespace: ``CELERY_LEDGER_URL`` as a Django setting, not an environment
variable (the test's server has none). ``tests/djangoproj/settings.py`` stays the step tests'.
"""

from __future__ import annotations

import os

DEBUG = True  # runserver serves the admin's static files
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
SECRET_KEY = "celery-ledger-admin-tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["TEST_DJANGO_ADMIN_DB"]}
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_ledger.contrib.django",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "djangoproj.admin_urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"

# The project's Celery app (djangoproj/admin_celery.py) reads every CELERY_* setting below.
LEDGER_CELERY_APP = "djangoproj.admin_celery:app"
CELERY_BROKER_URL = os.environ["TEST_BROKER_URL"]
CELERY_LEDGER_URL = os.environ["TEST_LEDGER_URL"]
# Unset: the admin is read-only (the default). The actions server names the test's.
if os.environ.get("TEST_ADMIN_AUTHORIZER"):
    CELERY_LEDGER_AUTHORIZER = os.environ["TEST_ADMIN_AUTHORIZER"]

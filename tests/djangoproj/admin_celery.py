"""The admin tests' Celery app, as Celery's Django guide writes ``proj/celery.py``: its
configuration is Django's settings under the ``CELERY_`` namespace."""

from celery import Celery

app = Celery("djangoproj")
app.config_from_object("django.conf:settings", namespace="CELERY")

"""A minimal Django project for tests/test_django_steps.py (issue 16): one app, one model."""

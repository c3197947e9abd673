"""A minimal Django project for tests/test_django_steps.py: one app, one model."""

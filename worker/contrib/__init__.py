"""Integrations with other frameworks, each imported only when a project asks for it.

``celery_ledger.contrib.django``: the Django admin for ledger entries. Nothing else in
``celery_ledger`` imports from here, so a project without Django never loads it.
"""

"""The admin tests' ``ledger_authorizer``: a Django superuser may act from the admin."""

from __future__ import annotations

from typing import Any

from celery_ledger.authorize import Decision


def may_act(operator: Any, action: Any, entry: Any) -> Decision:
    user = operator.user
    if operator.via != "django" or user is None:
        return Decision.deny("only from the Django admin")
    if not user.is_superuser:
        return Decision.deny(f"{operator.name} is not a superuser")
    return Decision.allow()

"""The admin tests' URLs: Django's admin, where ``celery_ledger.contrib.django`` registers."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]

"""The usage app: who held which GPUs when (SPEC §7)."""

from django.apps import AppConfig


class UsageConfig(AppConfig):
    name = "usage"
    verbose_name = "GPU usage"

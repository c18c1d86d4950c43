"""The webhooks app: admission decisions for KubeVirt VMIs."""

from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"
    verbose_name = "Admission webhooks"

"""The binder app: the cluster mirror, the pure placement engine and the passes around it."""

from django.apps import AppConfig


class BinderConfig(AppConfig):
    name = "binder"
    verbose_name = "GPU placement"

    def ready(self) -> None:
        from . import signals

        signals.connect()

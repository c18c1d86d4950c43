"""The binder app: the cluster mirror, the pure placement engine and the passes around it."""

from django.apps import AppConfig


class BinderConfig(AppConfig):
    name = "binder"
    verbose_name = "GPU placement"

    def ready(self) -> None:
        # Django's documented place for start-up wiring: models are ready now.
        from binder import signals, tasks  # noqa: F401 - tasks registers the Celery tasks by name

        signals.connect()

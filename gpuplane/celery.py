"""The Celery app that runs the serialized binder.

With no ``CELERY_BROKER_URL`` (the embedded default) tasks run in-process and
eagerly, so the demo needs neither Redis nor a worker.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")

app = Celery("gpuplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

"""gpuplane: the GPU control plane for KubeVirt VMs (Django project package).

The Celery app is imported here so that ``@shared_task`` binds to it whenever Django
starts, whether in a web process, a worker or a management command.
"""

from gpuplane.celery import app as celery_app

__all__ = ["celery_app"]

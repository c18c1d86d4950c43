"""Every change of a mirrored object queues a full pass (events collapse into one).

Connected in ``BinderConfig.ready``. Bulk loads do not send model signals; the loaders
queue their pass themselves.
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save

from binder import models
from binder.queue import auto_pass, queue_full_pass

MIRRORED = (
    models.Namespace,
    models.Node,
    models.GpuClass,
    models.GpuDevice,
    models.GpuBudget,
    models.VirtualMachineInstance,
    models.Pod,
)


def _changed(sender: Any, **kwargs: Any) -> None:
    if auto_pass() and not kwargs.get("raw", False):
        queue_full_pass()


def connect() -> None:
    for model in MIRRORED:
        post_save.connect(_changed, sender=model, dispatch_uid=f"gpuplane-pass-{model.__name__}-save")
        post_delete.connect(_changed, sender=model, dispatch_uid=f"gpuplane-pass-{model.__name__}-delete")

"""URL map of the webhook server (``GPUPLANE_SERVE=webhook``): the VMI webhook and its probes.

The admin, the tenant API, its schema and ``/metrics`` are not served here: the port the
kube-apiserver reaches answers only what it needs.
"""

from django.urls import path

from gpuplane.urls import healthz, readyz
from webhooks.views import VmiAdmissionView

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("webhooks/vmi", VmiAdmissionView.as_view(), name="webhook-vmi"),
]

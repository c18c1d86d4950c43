"""URL map of the webhook server (``GPUPLANE_SERVE=webhook``): the VMI webhook and a probe.

The admin, the tenant API, its schema and ``/metrics`` are not served here: the port the
kube-apiserver reaches answers only what it needs.
"""

from django.urls import path

from gpuplane.urls import healthz
from webhooks.views import VmiAdmissionView

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("webhooks/vmi", VmiAdmissionView.as_view(), name="webhook-vmi"),
]

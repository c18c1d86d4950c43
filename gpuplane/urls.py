"""URL map: the staff admin, health, metrics, the webhook, the API and its schema and docs."""

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from django.views.decorators.csp import csp_override
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from binder.metrics import metrics_view
from binder.runtime import readmodel
from usage.api.catalog import GpuOptionsView
from webhooks.views import VmiAdmissionView


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness for probes and for ``make demo`` to know the server is up."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: 503 until this process's read model of the mirror is built, then 200.

    The webhook, the catalog and the board decide from the model; before it is built the
    first call would wait for the build (seconds at 100k devices). Liveness (``/healthz``)
    does not depend on it."""
    model = readmodel.MODEL
    if not model.built.is_set():
        return JsonResponse({"status": "building the read model", "reason": model.why_invalid}, status=503)
    return JsonResponse({"status": "ready", "devices": len(model.records["GPU"]), "nodes": len(model.records["Node"])})


#: The API docs pages start Swagger UI / Redoc with an inline script (drf-spectacular's
#: templates), and Redoc runs a worker from a blob: everything else as SECURE_CSP.
DOCS_CSP = {
    **settings.SECURE_CSP,
    "script-src": ["'self'", "'unsafe-inline'"],
    "worker-src": ["'self'", "blob:"],
}

admin.site.site_header = "gpuplane"
admin.site.site_title = "gpuplane"
admin.site.index_title = "GPU placement, budgets and usage"

urlpatterns = [
    # Nothing is served at the root: a newcomer who opens the host lands in the admin.
    path("", RedirectView.as_view(pattern_name="admin:index", permanent=False), name="root"),
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", csp_override(DOCS_CSP)(SpectacularSwaggerView.as_view(url_name="schema")), name="api-docs"),
    path("api/redoc/", csp_override(DOCS_CSP)(SpectacularRedocView.as_view(url_name="schema")), name="api-redoc"),
    path("api/v1/", include("usage.urls")),
    path("api/v1/catalog/gpu-options", GpuOptionsView.as_view(), name="catalog-gpu-options"),
    path("webhooks/vmi", VmiAdmissionView.as_view(), name="webhook-vmi"),
]

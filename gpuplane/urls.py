"""URL map: the staff admin, health, metrics, the webhook, the API and its schema and docs."""

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from django.views.decorators.csp import csp_override
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from binder.metrics import metrics_view
from usage.api.catalog import GpuOptionsView
from webhooks.views import VmiAdmissionView


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness for probes and for ``make demo`` to know the server is up."""
    return JsonResponse({"status": "ok"})


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
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", csp_override(DOCS_CSP)(SpectacularSwaggerView.as_view(url_name="schema")), name="api-docs"),
    path("api/redoc/", csp_override(DOCS_CSP)(SpectacularRedocView.as_view(url_name="schema")), name="api-redoc"),
    path("api/v1/", include("usage.urls")),
    path("api/v1/catalog/gpu-options", GpuOptionsView.as_view(), name="catalog-gpu-options"),
    path("webhooks/vmi", VmiAdmissionView.as_view(), name="webhook-vmi"),
]

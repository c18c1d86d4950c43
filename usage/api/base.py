"""Authentication, tenant scoping and the 404 rule: the one base every tenant view derives from."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.pagination import PageNumberPagination
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request

from binder.kube.objects import text_problem
from usage import queries
from usage.tenancy import STAFF_READ_PERMISSION, Visible, may_read, visible_namespaces

# -- the base: authentication, scoping, 404 ---------------------------------------------------


class TenantScopedView(GenericAPIView):  # type: ignore[type-arg] # generic only in the stubs
    """Authenticated, tenant-scoped: the one place the API applies "who sees what".

    ``scoped_queryset()`` is the model's queryset limited to the user's namespaces;
    ``tenant(ns)`` returns ``ns`` if the user may read it and it is known, else raises
    404 (never 403, so another tenant's namespace names do not leak).
    """

    permission_classes = [IsAuthenticated]
    scoped_model: Any = None

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        # DRF reads ``?format=`` as "the default renderer"; an empty format is a mistake.
        if request.query_params.get("format") == "":
            raise ValidationError({"format": ["must not be empty: json or csv, or leave it out"]})
        self._refuse_unknown_parameters(request)
        # A NUL or a lone surrogate in a path part (``/devices/t1/a%00b``) names nothing that
        # can exist, and PostgreSQL refuses it in a query (a 500 before): 400 naming the part.
        for name, value in self.kwargs.items():
            problem = text_problem(value) if isinstance(value, str) else None
            if problem is not None:
                raise ValidationError({name: [problem]})

    def _refuse_unknown_parameters(self, request: Request) -> None:
        """A list endpoint's query names only its filters, its page parameters and
        ``format``: anything else (a misspelt filter, ``className`` for ``class_name``) is a
        400 naming it, where DRF would ignore it and answer every row as if unfiltered."""
        filterset = getattr(self, "filterset_class", None)
        if filterset is None:
            return
        known = {"format", *filterset.base_filters}
        pagination = getattr(self, "pagination_class", None)
        if pagination is not None:
            known |= {pagination.page_query_param, pagination.page_size_query_param or ""}
        unknown = sorted(name for name in request.query_params if name not in known)
        if unknown:
            raise ValidationError(
                {
                    name or "(empty name)": [f"unknown query parameter; this endpoint takes {', '.join(sorted(known))}"]
                    for name in unknown
                }  # fmt: skip
            )

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        """DRF answers a ``?format=`` this view does not offer with a bare "Not found.",
        which reads as if the tenant or the path were wrong: say which formats it offers."""
        try:
            return super().perform_content_negotiation(request, force)
        except Http404:
            offered = ", ".join(sorted({r.format for r in self.get_renderers() if r.format != "api"}))
            wanted = request.query_params.get("format", "")
            raise NotFound(f"format={wanted} is not offered here; this endpoint answers {offered}") from None

    def staff_permission(self) -> str:
        """The admin's view permission of what this endpoint reads: what staff need to read
        every tenant here (the admin pages ask the same)."""
        if self.scoped_model is None:
            return STAFF_READ_PERMISSION
        meta = self.scoped_model._meta
        return f"{meta.app_label}.view_{meta.model_name}"

    def visible(self) -> Visible:
        return visible_namespaces(self.request.user, self.staff_permission(), self.request.auth)

    def scoped_queryset(self) -> QuerySet[Any]:
        return self.scoped_model.objects.for_tenant(self.visible())  # type: ignore[no-any-return]

    def get_queryset(self) -> QuerySet[Any]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular reading the view
            return self.scoped_model.objects.none()  # type: ignore[no-any-return]
        return self.tenant_queryset()

    def tenant_queryset(self) -> QuerySet[Any]:
        """The view's rows; override to narrow ``scoped_queryset()`` further."""
        return self.scoped_queryset()

    def tenant(self, namespace: str | None = None) -> str:
        namespace = namespace if namespace is not None else self.kwargs["namespace"]
        readable = may_read(self.request.user, namespace, self.staff_permission(), self.request.auth)
        if not readable or not queries.namespace_known(namespace):
            raise NotFound(f"namespace {namespace!r} not found")
        return namespace


class Pages(PageNumberPagination):
    """``?page=N&page_size=M`` (default 100, at most 1000).

    A page or size that is not a positive integer, or a size above 1000, is a 400 naming
    the parameter (DRF alone answers 404 "Invalid page" for ``page=0`` and silently
    ignores a bad size); a page past the last one is 404, as in DRF.
    """

    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> Any:
        self.check_parameters(request)
        return super().paginate_queryset(queryset, request, view)

    def check_parameters(self, request: Request) -> None:
        """400 naming ``page`` or ``page_size`` if either is given and not valid."""
        for name in (self.page_query_param, self.page_size_query_param):
            raw = request.query_params.get(name)
            if raw is None or raw == "last" and name == self.page_query_param:
                continue
            if not raw.isdigit() or int(raw) < 1:
                raise ValidationError({name: [f"must be a positive integer, got {raw!r}"]})
            if name == self.page_size_query_param and int(raw) > self.max_page_size:
                raise ValidationError({name: [f"must be at most {self.max_page_size}, got {raw}"]})

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"]["minimum"] = 1
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"]["maximum"] = self.max_page_size
        return parameters


NOT_FOUND = OpenApiResponse(
    inline_serializer("NotFound", fields={"detail": serializers.CharField()}),
    description="no such namespace or object, or not yours",
)
UNAUTHORIZED = OpenApiResponse(
    inline_serializer("Unauthorized", fields={"detail": serializers.CharField()}),
    description="no or bad credentials",
)
BAD_REQUEST = OpenApiResponse(
    OpenApiTypes.OBJECT, description='a parameter is invalid: the body names it, e.g. {"from": ["..."]}'
)

"""The one place gpuplane talks to the Kubernetes API server (cluster mode).

Everything else (sync, the binder's status writes and its single GET after a conflict,
finalizers, the webhook's bind-request annotation, fresh VMI reads for usage records) goes through
:class:`KubeApi`, built on the official ``kubernetes`` client. Objects travel as the
plain JSON dicts the API server sends (camelCase, as ``kubectl get -o json`` prints
them), because that is what ``binder.kube.objects`` parses and validates; the client's typed
models would cost a conversion per object and a second shape to keep in step.

Writes that must not overwrite someone else's change carry the ``resourceVersion``
they were computed from (``metadata.resourceVersion`` in the merge patch): the API
server answers 409 Conflict if the object moved on, and the caller leaves that object
for the next pass (the binder GETs that one object and mirrors it first). Every write
returns the object as the server stored it, with its new resourceVersion, which the
callers mirror (``binder.mirror.write.mirror_objects``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch

from binder.kube.kinds import BY_KIND, Kind
from binder.kube.resources import BIND_NODE_SELECTOR_ANNOTATION, BIND_REQUEST_ANNOTATION

log = logging.getLogger(__name__)

#: The finalizer gpuplane puts on every GPU and GPUClass.
FINALIZER = "gpuplane.io/release"
#: Writes kept in flight at once by :func:`each_in_flight` (within the client's connection
#: pool, which the official client sizes at 5 per CPU).
WRITERS = 8


def each_in_flight[In, Out](call: Callable[[In], Out], items: Sequence[In]) -> list[Out | Exception]:
    """``call`` on each item, up to :data:`WRITERS` at once; the results in order, a call
    that raised giving its exception in its place (one object's refusal never stops the
    others; the caller classifies it, ``binder.errors``).

    The API server serves requests in parallel, so a caller writing thousands of objects
    (a pass's status writes, the sync's finalizers) waits for the slowest of a few round
    trips at a time instead of the sum of them all. ``call`` must not touch the database:
    only HTTP runs on the pool's threads, the caller's bookkeeping stays on its own.
    """

    def guarded(item: In) -> Out | Exception:
        try:
            return call(item)
        except Exception as exc:  # noqa: BLE001 - handed back in the item's place
            return exc

    if len(items) < 2:
        return [guarded(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(min(WRITERS, len(items))) as pool:
        return list(pool.map(guarded, items))


#: Where each mirrored kind lives in the API (``binder.kube.kinds``: one row per kind).
RESOURCES: dict[str, Kind] = BY_KIND


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again, then watch from the list."""


@dataclass(frozen=True, slots=True)
class Listing:
    """A list's objects (kind and apiVersion filled in) and the version to watch from."""

    items: list[dict[str, Any]]
    resource_version: str
    served: bool = True
    """False: the API server does not serve this optional kind (its CRD is not installed)."""


class KubeApi:
    """Raw-JSON access to the kinds in :data:`RESOURCES` over an ``ApiClient``."""

    def __init__(self, api_client: client.ApiClient, request_timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.request_timeout = request_timeout

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str = "application/merge-patch+json",
        stream: bool = False,
        timeout: float | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        response = self.api_client.call_api(
            path,
            method,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
            _request_timeout=timeout if timeout is not None else self.request_timeout,
        )
        if stream:
            return response
        data = response.data
        return json.loads(data) if data else None

    # -- reads ----------------------------------------------------------------------------------

    def list(self, kind: str, label_selector: str = "") -> Listing:
        """Every object of ``kind`` cluster-wide, and the list's resourceVersion."""
        resource = RESOURCES[kind]
        query = [("labelSelector", label_selector)] if label_selector else []
        try:
            body = self._call("GET", resource.path(), query=query)
        except client.ApiException as exc:
            if exc.status == 404 and resource.optional:
                return Listing([], "", served=False)
            raise
        items = [self._typed(resource, item) for item in body.get("items") or []]
        return Listing(items, str((body.get("metadata") or {}).get("resourceVersion") or ""))

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None if it does not exist."""
        resource = RESOURCES[kind]
        try:
            return self._typed(resource, self._call("GET", resource.path(namespace, name)))
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def watch(self, kind: str, resource_version: str, timeout_seconds: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(type, object)`` events after ``resource_version``; raises :class:`Gone` on 410.

        Ends after ``timeout_seconds`` (the server closes the stream); the caller
        watches again from the last version it saw.
        """
        resource = RESOURCES[kind]

        def raw_list(**kwargs: Any) -> Any:
            query = [("watch", "true"), ("allowWatchBookmarks", "true")]
            if kwargs.get("resource_version"):
                query.append(("resourceVersion", kwargs["resource_version"]))
            if kwargs.get("timeout_seconds"):
                query.append(("timeoutSeconds", kwargs["timeout_seconds"]))
            return self._call("GET", resource.path(), query=query, stream=True, timeout=timeout_seconds + 10)

        watcher = watch.Watch()
        try:
            for event in watcher.stream(raw_list, resource_version=resource_version, timeout_seconds=timeout_seconds):
                kind_of_event = event["type"]
                obj = event.get("raw_object") or event.get("object")
                if kind_of_event == "BOOKMARK":
                    yield kind_of_event, obj
                    continue
                yield kind_of_event, self._typed(resource, obj)
        except client.ApiException as exc:
            if exc.status == 410:
                raise Gone(str(exc.reason)) from None
            raise
        finally:
            watcher.stop()

    @staticmethod
    def _typed(resource: Kind, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The object with ``kind`` and ``apiVersion``: list items of built-in kinds lack them."""
        typed = dict(obj)
        typed.setdefault("kind", resource.kind)
        typed.setdefault("apiVersion", resource.api_version)
        return typed

    # -- writes ---------------------------------------------------------------------------------

    def patch_status(
        self, kind: str, namespace: str, name: str, status: Mapping[str, Any], resource_version: str | None
    ) -> dict[str, Any]:
        """Merge ``status`` through the status subresource, only if still at ``resource_version``."""
        resource = RESOURCES[kind]
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._typed(resource, self._call("PATCH", resource.path(namespace, name, "status"), body=body))

    def set_finalizers(
        self, kind: str, namespace: str, name: str, finalizers: Sequence[str], resource_version: str
    ) -> dict[str, Any]:
        """Replace ``metadata.finalizers``, only if still at ``resource_version``; the object as stored."""
        resource = RESOURCES[kind]
        body = {"metadata": {"finalizers": [*finalizers] or None, "resourceVersion": resource_version}}
        return self._typed(resource, self._call("PATCH", resource.path(namespace, name), body=body))

    def patch_node(self, name: str, patch: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
        """A staff node action (cordon, drain and their undoing): merge ``patch``
        into the Node, only if it is still at ``resource_version`` (409 Conflict otherwise)."""
        resource = RESOURCES["Node"]
        body = {**patch, "metadata": {**dict(patch.get("metadata") or {}), "resourceVersion": resource_version}}
        return self._typed(resource, self._call("PATCH", resource.path(None, name), body=body))

    def annotate_bind_request(
        self, namespace: str, name: str, request_id: str, node_selector: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """The webhook's bind request: the ``gpuplane.io/bind-request`` annotation
        and, with it, the VMI's nodeSelector as ``gpuplane.io/bind-node-selector``
        (removed when the VMI has none, so an older request's selector does not stay)."""
        selector = json.dumps(dict(node_selector), sort_keys=True, separators=(",", ":")) if node_selector else None
        body = {
            "metadata": {"annotations": {BIND_REQUEST_ANNOTATION: request_id, BIND_NODE_SELECTOR_ANNOTATION: selector}}
        }
        return self._typed(RESOURCES["GPU"], self._call("PATCH", RESOURCES["GPU"].path(namespace, name), body=body))


def with_finalizer(obj: Mapping[str, Any]) -> list[str] | None:
    """The finalizers ``obj`` should have, or None if it already has them (or is going)."""
    meta = obj.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    if meta.get("deletionTimestamp") or FINALIZER in finalizers:
        return None
    return [*finalizers, FINALIZER]


def without_finalizer(obj: Mapping[str, Any]) -> list[str]:
    return [f for f in (obj.get("metadata") or {}).get("finalizers") or [] if f != FINALIZER]


def is_deleting(obj: Mapping[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))

"""A Kubernetes API server for the cluster-mode tests: kmock's emulator, extended.

kmock (``kmock.KubernetesEmulator``) serves a Kubernetes-shaped HTTP API from memory
over a real aiohttp server, so the tests drive gpuplane through the official
``kubernetes`` client over real HTTP. Its store is deliberately naive (it merges JSON,
its path parser cannot address ``/api/v1/namespaces`` itself, lists carry no
resourceVersion), so this subclass takes over the object requests and behaves where
gpuplane depends on it as a real kube-apiserver does. Each extension says which real
behaviour it stands for:

- **uid, resourceVersion, creationTimestamp** are set by the server on create (a
  creationTimestamp the test gives is kept, so "oldest order first" stays
  deterministic); ``status`` in a create is dropped, as for any kind with a status
  subresource (``seed()`` writes it through ``/status`` afterwards); every
  write bumps one cluster-wide resourceVersion (etcd's revision), and lists and watch
  events carry it.
- **Optimistic concurrency**: a write whose body names ``metadata.resourceVersion``
  that is no longer current answers **409 Conflict**, as the apiserver's precondition
  check does; a create of an existing name is 409 AlreadyExists.
- **The status subresource**: a write to ``.../status`` changes only ``status``; a
  write to the object itself ignores ``status`` (CRDs with ``subresources.status``,
  and built-in kinds).
- **Label selectors** (``labelSelector=a=b,c!=d,e``) filter lists and watches.
- **Watch from a resourceVersion** replays the events after it; a version older than
  the compaction horizon (``compact()``) answers an ERROR event with **410 Gone**
  ("too old resource version"), as etcd compaction makes the real server do.
  ``timeoutSeconds`` ends the stream, like the server-side watch timeout.
- **Finalizers block deletion**: DELETE of an object with finalizers sets
  ``deletionTimestamp`` (MODIFIED); the object goes (DELETED) when the last finalizer
  is removed. No new finalizers may be added once deleting (the apiserver forbids it).
- **Namespace deletion** marks the namespace Terminating and deletes every object in
  it (the namespace controller); the namespace goes once it is empty.
- **Fault injection** (``fail_writes``): a callable that may turn any write into an
  error status (409, 500...), standing for conflicts with other writers and a flaky
  apiserver or etcd.
- **Watch delivery** (``withhold``, ``release_held``): a callable that may hold an event
  back from every watch (delivered by ``release_held``, after later ones) or drop it for
  good, while reads (GET, LIST) already return the write. It stands for the real
  server's watch cache trailing etcd (a write's response, and a consistent LIST, arrive
  before its event, by seconds under load) and, for a dropped event, one the sync never
  applies (its watch ended or failed after the event was sent; only a relist repairs
  it). A held event keeps its object's resourceVersion; its delivery takes a new
  revision of the log, as a watch resumed after it would see it.
- **Request counts**: ``calls`` records every object request as the RBAC verb it needs,
  and ``gpuplane_calls`` those not made by the test's own set-up and checks
  (``RunningApiServer.request``), so a test can say "no LIST of GPUs happened during a
  pass" (an audit log filtered by user would say the same of a real server).

Merge-patch (RFC 7386) is applied for ``application/merge-patch+json`` and, as an
approximation, for strategic merge patches (gpuplane sends only maps there);
``application/json-patch+json`` bodies go through ``jsonpatch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import jsonpatch
import kmock

from binder.kube.client import RESOURCES


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS = [
    Kind("", "v1", "namespaces", "Namespace", False),
    Kind("", "v1", "nodes", "Node", False),
    Kind("", "v1", "pods", "Pod", True),
    Kind("kubevirt.io", "v1", "virtualmachineinstances", "VirtualMachineInstance", True),
    Kind("gpuplane.io", "v1alpha1", "gpuclasses", "GPUClass", False),
    Kind("gpuplane.io", "v1alpha1", "gpus", "GPU", True),
    Kind("gpuplane.io", "v1alpha1", "gpubudgets", "GPUBudget", True),
]
BY_PATH = {(k.group, k.version, k.plural): k for k in KINDS}

PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+)(?=/))?"
    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?/?$"
)


#: The User-Agent of the test's own requests (set-up and checks), not counted as gpuplane's.
TEST_AGENT = "kube-emulator-test"

#: ``/api/v1/namespaces/<name>[/status]``: a namespace itself, not a path inside one.
NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces(?:/(?P<name>[^/]+))?(?:/(?P<sub>status|finalize))?/?$")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def matches_selector(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = re.split("==?", term, maxsplit=1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def proposed_object(current: dict[str, Any], data: Any, method: str, content_type: str) -> Any:
    """The object a PUT, JSON patch or merge patch proposes for ``current``."""
    if method == "PUT":
        return copy.deepcopy(data)
    if "json-patch" in content_type or isinstance(data, list):
        try:
            return jsonpatch.apply_patch(current, data)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise ApiError(422, "Invalid", f"the JSON patch does not apply: {exc}") from None
    return merge_patch(current, data)


def wanted_version(data: Any) -> str | None:
    """The resourceVersion a write insists on: in the object, or a JSON patch ``test`` op."""
    wanted_rv = (data.get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
    if wanted_rv is None and isinstance(data, list):
        tests = [op for op in data if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"]
        wanted_rv = tests[0].get("value") if tests else None
    return wanted_rv


def watched(meta: dict[str, Any], ns: str | None, name: str | None, selector: str) -> bool:
    """Whether a watch of namespace ``ns``, object ``name`` and ``selector`` sees this object."""
    if ns is not None and meta.get("namespace") != ns:
        return False
    if name is not None and meta.get("name") != name:
        return False
    return matches_selector(meta.get("labels") or {}, selector)


@dataclass
class Event:
    revision: int
    kind: Kind
    type: str
    obj: dict[str, Any]


@dataclass
class Store:
    """Objects by (kind plural, namespace, name), one revision counter, an event log."""

    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    revision: int = 100
    horizon: int = 0  # watches from before this revision get 410 Gone


def rbac_call(method: str, kind: Kind, name: str | None, sub: str | None, query: Any) -> tuple[str, str, str]:
    """The (API group, resource, verb) RBAC checks for a request, as the apiserver maps it."""
    resource = f"{kind.plural}/{sub}" if sub else kind.plural
    if method == "GET":
        verb = "watch" if query.get("watch", "").lower() in ("true", "1") else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
    return (kind.group, resource, verb)


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with the real API server behaviours listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store = Store()
        self.lock = threading.Lock()
        self.fail_writes: Callable[[str, Kind, str, str], int | None] | None = None
        self.changed: asyncio.Condition | None = None
        self.writes: list[tuple[str, str, str, str, int]] = []  # (verb, plural, ns, name+sub, status code)
        #: Every object request as the RBAC verb it needs: (API group, resource[/sub], verb).
        self.calls: list[tuple[str, str, str]] = []
        #: The same, without the test's own requests (``RunningApiServer.request``).
        self.gpuplane_calls: list[tuple[str, str, str]] = []
        #: Watch delivery: ``withhold(event)`` says "hold" (deliver at ``release_held``), "drop" or None.
        self.withhold: Callable[[Event], str | None] | None = None
        self.held: list[Event] = []

    # -- HTTP entry ----------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = PATH.match(raw.path)
        kind = None
        namespace_match = NAMESPACE_PATH.match(raw.path)
        if namespace_match:
            kind = BY_PATH[("", "v1", "namespaces")]
            match = {"ns": None, "name": namespace_match["name"], "sub": namespace_match["sub"]}  # type: ignore[assignment]
        elif match:
            group = "" if match["core"] else match["group"]
            version = match["core"] or match["version"]
            kind = BY_PATH.get((group, version, match["plural"]))
        if kind is None:
            return await super().__call__(raw)  # discovery and the rest: kmock's own
        self.calls.append(rbac_call(raw.method, kind, match["name"], match["sub"], raw.query))
        if raw.headers.get("User-Agent") != TEST_AGENT:
            self.gpuplane_calls.append(self.calls[-1])
        if self.changed is None:  # created in the server's own event loop
            self.changed = asyncio.Condition()
        body = await raw.read()
        try:
            if raw.method == "GET" and raw.query.get("watch", "").lower() in ("true", "1"):
                return await self._watch(raw, kind, match["ns"], match["name"])
            result = await self._serve(raw, kind, match["ns"], match["name"], match["sub"], body)
            return aiohttp.web.json_response(result, status=201 if raw.method == "POST" else 200)
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)

    async def _serve(
        self, raw: Any, kind: Kind, ns: str | None, name: str | None, sub: str | None, body: bytes
    ) -> dict[str, Any]:
        method = raw.method
        if method == "GET" and name is None:
            return self.list(kind, ns, raw.query.get("labelSelector", ""))
        if method == "GET":
            return self.get(kind, ns or "", name or "")
        data = json.loads(body) if body else {}
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, "")
        target = f"{name or data.get('metadata', {}).get('name', '')}{'/' + sub if sub else ''}"
        if self.fail_writes is not None:
            code = self.fail_writes(verb, kind, ns or "", target)
            if code is not None:
                self.writes.append((verb, kind.plural, ns or "", target, code))
                reason = {409: "Conflict", 500: "InternalError", 503: "ServiceUnavailable"}.get(code, "Failure")
                raise ApiError(code, reason, f"injected fault on {verb} {kind.plural} {ns}/{target}")
        with self.lock:
            if method == "POST":
                result = self.create(kind, ns, data)
            elif method == "DELETE":
                result = self.delete(kind, ns or "", name or "")
            elif method in ("PATCH", "PUT"):
                content_type = raw.headers.get("Content-Type", "")
                result = self.write(kind, ns or "", name or "", sub, data, method, content_type)
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        self.writes.append((verb, kind.plural, ns or "", target, 200))
        await self._wake()
        return result

    async def _wake(self) -> None:
        assert self.changed is not None
        async with self.changed:
            self.changed.notify_all()

    # -- the store -------------------------------------------------------------------------

    def _key(self, kind: Kind, ns: str | None, name: str) -> tuple[str, str, str]:
        return (kind.plural, (ns or "") if kind.namespaced else "", name)

    def _emit(self, kind: Kind, type_: str, obj: dict[str, Any]) -> None:
        event = Event(self.store.revision, kind, type_, copy.deepcopy(obj))
        verdict = self.withhold(event) if self.withhold is not None else None
        if verdict == "hold":
            self.held.append(event)
        elif verdict != "drop":
            self.store.events.append(event)

    def release_held(self) -> int:
        """Deliver the held events now (after every event sent meanwhile), in write order."""
        with self.lock:
            held, self.held = self.held, []
            for event in held:
                self.store.revision += 1
                self.store.events.append(Event(self.store.revision, event.kind, event.type, event.obj))
        return len(held)

    def _bump(self, obj: dict[str, Any]) -> None:
        self.store.revision += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.store.revision)

    def list(self, kind: Kind, ns: str | None, selector: str = "") -> dict[str, Any]:
        with self.lock:
            items = [
                copy.deepcopy(obj)
                for (plural, obj_ns, _), obj in sorted(self.store.objects.items())
                if plural == kind.plural
                and (ns is None or obj_ns == ns)
                and matches_selector(obj.get("metadata", {}).get("labels") or {}, selector)
            ]
            return {
                "apiVersion": kind.api_version,
                "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(self.store.revision)},
                "items": items,
            }

    def get(self, kind: Kind, ns: str, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.store.objects.get(self._key(kind, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
            return copy.deepcopy(obj)

    def create(self, kind: Kind, ns: str | None, data: dict[str, Any]) -> dict[str, Any]:
        meta = data.setdefault("metadata", {})
        name = meta.get("name") or ""
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if kind.namespaced:
            ns = ns or meta.get("namespace") or ""
            namespace = self.store.objects.get(("namespaces", "", ns))
            if namespace is None:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found')
            if namespace["metadata"].get("deletionTimestamp"):
                raise ApiError(403, "Forbidden", f"namespace {ns} is being terminated")
            meta["namespace"] = ns
        key = self._key(kind, ns, name)
        if key in self.store.objects:
            raise ApiError(409, "AlreadyExists", f'{kind.plural} "{name}" already exists')
        data["apiVersion"], data["kind"] = kind.api_version, kind.kind
        if kind.status_subresource:
            data.pop("status", None)  # with a status subresource, create ignores status
        meta["uid"] = str(uuid.uuid4())
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta.pop("deletionTimestamp", None)
        self._bump(data)
        self.store.objects[key] = data
        self._emit(kind, "ADDED", data)
        return copy.deepcopy(data)

    def write(
        self, kind: Kind, ns: str, name: str, sub: str | None, data: Any, method: str, content_type: str
    ) -> dict[str, Any]:
        key = self._key(kind, ns, name)
        current = self.store.objects.get(key)
        if current is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        proposed = proposed_object(current, data, method, content_type)
        wanted_rv = wanted_version(data)
        if wanted_rv is not None and wanted_rv != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {kind.plural} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
            )
        result = copy.deepcopy(current)
        if sub == "status":
            result["status"] = proposed.get("status", {})
        elif sub is None:
            old_meta = current["metadata"]
            meta = dict(proposed.get("metadata") or {})
            for fixed in ("uid", "creationTimestamp", "deletionTimestamp", "namespace", "name"):
                if fixed in old_meta:
                    meta[fixed] = old_meta[fixed]
                else:
                    meta.pop(fixed, None)
            if old_meta.get("deletionTimestamp"):
                added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
                if added:
                    raise ApiError(
                        422, "Invalid", f"metadata.finalizers: no new finalizers can be added while deleting: {added}"
                    )
            result = {k: v for k, v in proposed.items() if k != "status"}
            result["metadata"] = meta
            if "status" in current:
                result["status"] = current["status"]
            result["apiVersion"], result["kind"] = kind.api_version, kind.kind
        else:
            raise ApiError(404, "NotFound", f"no subresource {sub!r}")
        self._bump(result)
        if result["metadata"].get("deletionTimestamp") and not result["metadata"].get("finalizers"):
            del self.store.objects[key]
            self._emit(kind, "DELETED", result)
            self._namespace_maybe_gone(ns)
        else:
            self.store.objects[key] = result
            self._emit(kind, "MODIFIED", result)
        return copy.deepcopy(result)

    def delete(self, kind: Kind, ns: str, name: str) -> dict[str, Any]:
        key = self._key(kind, ns, name)
        current = self.store.objects.get(key)
        if current is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        if kind.plural == "namespaces":
            return self._delete_namespace(name, current)
        meta = current["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                self._bump(current)
                self._emit(kind, "MODIFIED", current)
            return copy.deepcopy(current)
        del self.store.objects[key]
        self._bump(current)
        self._emit(kind, "DELETED", current)
        self._namespace_maybe_gone(ns)
        return copy.deepcopy(current)

    def _delete_namespace(self, name: str, namespace: dict[str, Any]) -> dict[str, Any]:
        if not namespace["metadata"].get("deletionTimestamp"):
            namespace["metadata"]["deletionTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            namespace.setdefault("status", {})["phase"] = "Terminating"
            self._bump(namespace)
            self._emit(BY_PATH[("", "v1", "namespaces")], "MODIFIED", namespace)
        for plural, ns, obj_name in [k for k in self.store.objects if k[1] == name]:
            kind = next(k for k in KINDS if k.plural == plural)
            self.delete(kind, ns, obj_name)
        self._namespace_maybe_gone(name)
        return copy.deepcopy(namespace)

    def _namespace_maybe_gone(self, ns: str) -> None:
        namespace = self.store.objects.get(("namespaces", "", ns))
        if namespace is None or not namespace["metadata"].get("deletionTimestamp"):
            return
        if any(k[1] == ns for k in self.store.objects):
            return
        del self.store.objects[("namespaces", "", ns)]
        self._bump(namespace)
        self._emit(BY_PATH[("", "v1", "namespaces")], "DELETED", namespace)

    def compact(self) -> None:
        """Forget the event history up to now: older watches get 410 Gone (etcd compaction)."""
        with self.lock:
            self.store.horizon = self.store.revision
            self.store.events.clear()

    # -- watch -------------------------------------------------------------------------------

    def _watch_start(self, kind: Kind, ns: str | None, selector: str, since: str | None) -> tuple[list[Event], int]:
        """The events a watch from ``since`` begins with, and the revision it follows from
        (-1: that version is compacted away, 410 Gone)."""
        with self.lock:
            if since in (None, "", "0"):
                # No version: the current objects as ADDED, then changes (like the real server).
                start = self.store.revision
                return [Event(start, kind, "ADDED", o) for o in self.list(kind, ns, selector)["items"]], start
            if int(since) < self.store.horizon:
                return [], -1
            return [], int(since)

    async def _watch(self, raw: Any, kind: Kind, ns: str | None, name: str | None) -> aiohttp.web.StreamResponse:
        assert self.changed is not None
        selector = raw.query.get("labelSelector", "")
        timeout = float(raw.query.get("timeoutSeconds") or 3600)
        since = raw.query.get("resourceVersion")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)

        async def send(payload: dict[str, Any]) -> None:
            await response.write(json.dumps(payload).encode() + b"\n")

        initial, start = self._watch_start(kind, ns, selector, since)
        if start < 0:
            gone = ApiError(410, "Expired", f"too old resource version: {since} ({self.store.horizon})")
            await send({"type": "ERROR", "object": gone.status()})
            await response.write_eof()
            return response
        for event in initial:
            await send({"type": event.type, "object": event.obj})
        deadline = asyncio.get_running_loop().time() + timeout
        position = start
        try:
            while True:
                with self.lock:
                    if position < self.store.horizon:
                        gone = ApiError(410, "Expired", f"too old resource version: {position}")
                        pending: list[Event] = []
                        compacted = True
                    else:
                        compacted = False
                        pending = [ev for ev in self.store.events if ev.revision > position and ev.kind == kind]
                        position = self.store.revision
                if compacted:
                    await send({"type": "ERROR", "object": gone.status()})
                    break
                for ev in pending:
                    if watched(ev.obj.get("metadata", {}), ns, name, selector):
                        await send({"type": ev.type, "object": ev.obj})
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                async with self.changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 0.5))
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        await response.write_eof()
        return response


class RunningApiServer:
    """An :class:`ApiServer` served over HTTP from a thread of its own, for sync tests."""

    def __init__(self) -> None:
        self.server = ApiServer()
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.server, kmock.Server(self.server) as http:
            self.url = str(http.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> RunningApiServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the Kubernetes emulator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One HTTP call to the emulator (test set-up), JSON in and out; errors raise."""
        data = json.dumps(body).encode() if body is not None else None
        content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
        headers = {"Content-Type": content_type, "User-Agent": TEST_AGENT}
        call = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)  # noqa: S310
        with urllib.request.urlopen(call, timeout=10) as answer:  # noqa: S310 - the local emulator
            return json.loads(answer.read() or b"null")

    def seed(self, *objects: dict[str, Any]) -> None:
        """Create each object, then write its status through ``/status``, the way real
        objects get theirs (kubelet, KubeVirt, gpuplane)."""
        for obj in objects:
            resource = RESOURCES[obj["kind"]]
            namespace = obj["metadata"].get("namespace")
            created = self.request("POST", resource.path(namespace), obj)
            if obj.get("status"):
                path = resource.path(namespace, created["metadata"]["name"], "status")
                self.request("PATCH", path, {"status": obj["status"]})

"""Objects on the control plane: what every one serves from the start (deploy/'s CRDs, namespace
and RBAC, KubeVirt's CRDs), server-side apply, seeding objects with their status as their
writers would, and switching a CRD's rules or deploy/'s finalizer policy for a block."""

from __future__ import annotations

import contextlib
import functools
import json
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import yaml

from harness.controlplane.apiserver import UNION_USER, ApiError, ApiServer
from harness.controlplane.processes import ROOT, kubevirt_dir

CRDS = ROOT / "deploy" / "base" / "crds"
RBAC = ROOT / "deploy" / "base" / "rbac.yaml"
FINALIZER_POLICY = ROOT / "deploy" / "base" / "finalizer-policy.yaml"
NAMESPACE = ROOT / "deploy" / "base" / "namespace.yaml"
#: KubeVirt's CRDs every control plane serves: the VMI's. Not the VirtualMachine's, an optional kind
#: to the sync: with it served, the garbage collector would delete the tests' VMIs, whose captured
#: shape names a VirtualMachine owner that does not exist (the VM cluster serves them all).
KUBEVIRT_READ = frozenset({"virtualmachineinstances.kubevirt.io"})
# Kinds whose CRD has no status subresource: KubeVirt's virt-controller writes a VMI's status
# with the object itself, and KubeVirt's own CRD (installed here) serves no ``/status``.
NO_STATUS_SUBRESOURCE = frozenset({"VirtualMachineInstance"})
#: Metadata the apiserver sets on create, whatever the client sends.
SERVER_SET = frozenset({"uid", "resourceVersion", "creationTimestamp", "selfLink", "generation", "managedFields"})


def install(api: ApiServer, kubevirt: bool) -> None:
    """The CRDs (deploy/'s and KubeVirt's: all of them with ``kubevirt``, else the VMI's), deploy/'s
    namespace and RBAC, and the union identity's bindings; then wait until the CRDs serve."""
    docs: list[dict[str, Any]] = []
    for path in sorted(CRDS.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    # KubeVirt's CRDs: all of them where virt-controller runs, else the VMI's (KUBEVIRT_READ).
    crds = [d for d in yaml.safe_load_all((kubevirt_dir() / "crds.yaml").read_text()) if d]
    docs += [d for d in crds if kubevirt or d["metadata"]["name"] in KUBEVIRT_READ]
    docs += [d for d in yaml.safe_load_all(NAMESPACE.read_text()) if d]
    docs += [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    for role in [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"]:
        docs.append({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{UNION_USER}-{role}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": UNION_USER}],
        })  # fmt: skip
    for doc in docs:
        apply(api, doc)

    def established(name: str) -> bool:
        crd = api.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        return any(
            c["type"] == "Established" and c["status"] == "True" for c in crd.get("status", {}).get("conditions", [])
        )

    for doc in docs:
        if doc["kind"] == "CustomResourceDefinition":
            api.wait(functools.partial(established, doc["metadata"]["name"]))
    api.wait(lambda: api.request("GET", "/apis/gpuplane.io/v1alpha1/gpus") is not None)
    api.wait(lambda: api.request("GET", "/apis/kubevirt.io/v1/virtualmachineinstances") is not None)


def apply(api: ApiServer, obj: dict[str, Any], *, field_manager: str = "gpuplane-tests", dry_run: bool = False) -> Any:
    """Server-side apply of one object, as ``kubectl apply --server-side`` sends it."""
    from binder.kube.client import RESOURCES

    kind = obj["kind"]
    meta = obj["metadata"]
    path = RESOURCES[kind].path(meta.get("namespace"), meta["name"]) if kind in RESOURCES else builtin_path(obj)
    query = {"fieldManager": field_manager, "force": "true"}
    if dry_run:
        query["dryRun"] = "All"
    return api.request(
        "PATCH", f"{path}?{urllib.parse.urlencode(query)}", obj, content_type="application/apply-patch+yaml"
    )


def seed(api: ApiServer, *objects: dict[str, Any]) -> list[dict[str, Any]]:
    """Create each object, then write its status (through ``/status`` where the kind has
    one), the way real objects get theirs (kubelet, KubeVirt, gpuplane); returns them as
    stored.

    What the server decides for itself is realised rather than sent: it refuses a
    ``resourceVersion`` on create and replaces ``uid`` and ``creationTimestamp``. So a
    uid the test gave is swapped for the server's wherever later objects name it (owner
    references, KubeVirt's labels, a VMI's ``activePods``: statuses are written after
    every object exists), and GPUs the test dated later are created in a later second
    (the server's timestamps have second resolution), so "oldest order first" sees the
    order the test meant.
    """
    from binder.kube.client import RESOURCES

    uids: dict[str, str] = {}
    created_objects: list[tuple[dict[str, Any], dict[str, Any]]] = []
    last_given = ""
    last_second = 0
    for obj in objects:
        resource = RESOURCES[obj["kind"]]
        namespace = obj["metadata"].get("namespace")
        given = str(obj["metadata"].get("creationTimestamp") or "")
        if obj["kind"] == "GPU" and last_given and given > last_given:
            while int(time.time()) <= last_second:
                time.sleep(0.02)
        body = {k: v for k, v in obj.items() if k != "status"}
        body["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in SERVER_SET}
        created = api.request("POST", resource.path(namespace), _swap(body, uids))
        if obj["kind"] == "GPU":
            last_given, last_second = given, int(time.time())
        if obj["metadata"].get("uid"):
            uids[str(obj["metadata"]["uid"])] = created["metadata"]["uid"]
        created_objects.append((obj, created))
    stored = []
    for obj, created in created_objects:
        status = dict(obj.get("status") or {})
        if obj["kind"] == "Pod":
            status.pop("qosClass", None)  # computed by the server from the containers, immutable
        if status:
            resource = RESOURCES[obj["kind"]]
            sub = None if obj["kind"] in NO_STATUS_SUBRESOURCE else "status"
            path = resource.path(obj["metadata"].get("namespace"), created["metadata"]["name"], sub)
            created = api.request("PATCH", path, {"status": _swap(status, uids)})
        stored.append(created)
    return stored


@contextlib.contextmanager
def older_crd(api: ApiServer, plural: str, probe: dict[str, Any]) -> Iterator[None]:
    """While the block runs, ``<plural>.gpuplane.io`` is served with its value rules
    (patterns, CEL rules, lengths, item counts, required fields) stripped, as an older CRD served it:
    objects created then are what "slipped past" the rules means. ``probe`` is an object
    the current CRD refuses; the switch waits until the server takes it (dry run), and
    back until it refuses it again."""
    path = CRDS / f"{plural}.yaml"
    current = next(d for d in yaml.safe_load_all(path.read_text()) if d)
    lax = _strip_rules(json.loads(json.dumps(current)))
    resource = f"/apis/gpuplane.io/v1alpha1/namespaces/{probe['metadata'].get('namespace', '')}/{plural}"
    if not probe["metadata"].get("namespace"):
        resource = f"/apis/gpuplane.io/v1alpha1/{plural}"

    def accepted() -> bool:
        try:
            api.request("POST", resource + "?dryRun=All", probe)
        except ApiError:
            return False
        return True

    apply(api, lax)
    api.wait(accepted, timeout=30)
    try:
        yield
    finally:
        apply(api, current)
        api.wait(lambda: not accepted(), timeout=30)


@contextlib.contextmanager
def finalizer_policy(api: ApiServer, probe_namespace: str) -> Iterator[None]:
    """While the block runs, deploy/'s finalizer policy (a MutatingAdmissionPolicy and its
    binding) is installed, as deployed: the apiserver puts gpuplane's finalizer on every GPU
    and GPUClass it creates. The switch waits until a dry-run GPU create in
    ``probe_namespace`` (which must exist) comes back with the finalizer, and back until it
    comes back without (the apiserver loads policies from a watch, not at once)."""
    from binder.kube.client import FINALIZER

    docs = [d for d in yaml.safe_load_all(FINALIZER_POLICY.read_text()) if d]
    probe = {
        "apiVersion": "gpuplane.io/v1alpha1", "kind": "GPU",
        "metadata": {"name": "finalizer-policy-probe", "namespace": probe_namespace},
        "spec": {"className": "probe", "vmName": "probe"},
    }  # fmt: skip
    resource = f"/apis/gpuplane.io/v1alpha1/namespaces/{probe_namespace}/gpus?dryRun=All"

    def applied() -> bool:
        stored = api.request("POST", resource, probe)
        return FINALIZER in (stored["metadata"].get("finalizers") or ())

    for doc in docs:
        apply(api, doc)
    api.wait(applied, timeout=30)
    try:
        yield
    finally:
        for doc in reversed(docs):
            api.request("DELETE", builtin_path(doc))
        api.wait(lambda: not applied(), timeout=30)


def _swap(value: Any, uids: dict[str, str]) -> Any:
    """``value`` with every uid the test gave replaced by the one the server assigned."""
    if not uids:
        return value
    text = json.dumps(value)
    for given, assigned in uids.items():
        text = text.replace(given, assigned)
    return json.loads(text)


#: The value rules of a CRD's schema (:func:`older_crd` strips them).
RULE_KEYS = ("pattern", "x-kubernetes-validations", "maxLength", "maxItems", "minLength", "minItems", "required")


def _strip_rules(node: Any) -> Any:
    """A schema without its value rules (types and structure kept: it stays structural)."""
    if isinstance(node, dict):
        for key in RULE_KEYS:
            node.pop(key, None)
        if node.get("x-kubernetes-list-type") == "set":
            node["x-kubernetes-list-type"] = "atomic"
        for value in node.values():
            _strip_rules(value)
    elif isinstance(node, list):
        for value in node:
            _strip_rules(value)
    return node


#: Built-in kinds the tests apply, by kind: (API path prefix, plural, namespaced).
_BUILTIN = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Service": ("/api/v1", "services", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "MutatingWebhookConfiguration": ("/apis/admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", False),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", False,
    ),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "MutatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "mutatingadmissionpolicies", False),
    "MutatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1", "mutatingadmissionpolicybindings", False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicybindings", False,
    ),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
}  # fmt: skip


def builtin_path(obj: dict[str, Any]) -> str:
    try:
        prefix, plural, namespaced = _BUILTIN[obj["kind"]]
    except KeyError:
        raise ValueError(f"harness/controlplane/objects.py does not know where {obj['kind']} lives") from None
    meta = obj["metadata"]
    namespace = f"/namespaces/{meta.get('namespace', 'default')}" if namespaced else ""
    return f"{prefix}{namespace}/{plural}/{meta['name']}"

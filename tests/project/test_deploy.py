"""The Kubernetes manifests in deploy/.

Every overlay is rendered with ``kubectl kustomize``, as ``kubectl apply -k`` would render
it. Built-in kinds are validated against the Kubernetes 1.32 OpenAPI schemas shipped by
``kubernetes-validate`` (strict: unknown fields are errors); the gpuplane kinds against the
``openAPIV3Schema`` of the CRDs themselves, turned into JSON Schema the way the apiserver
applies it (unknown fields refused, ``date-time`` checked). The demo cluster and any
gpuplane object among the real fixtures (tests/fixtures/kubernetes) must pass those schemas, and the schemas
must not accept what the loader (``binder.kube.objects``) refuses, or the sync would choke on an
object the apiserver let in.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from harness.manifests import DEPLOY, of_kind, one, overlay, pod_containers, render, render_text

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cluster", "standalone")
#: The Kubernetes minor the built-in kinds are validated against.
K8S_VERSION = "1.32"
#: Kinds the base carries for newer clusters only, checked against the release that made them GA
#: (the finalizer policy: delete it in an overlay for an older cluster; docs/operations.md).
SINCE = {"MutatingAdmissionPolicy": "1.36", "MutatingAdmissionPolicyBinding": "1.36"}
GROUP, VERSION = "gpuplane.io", "v1alpha1"
GPUPLANE_KINDS = ("GPUClass", "GPU", "GPUBudget")
NAMESPACE = "gpuplane-system"
IMAGE = "ghcr.io/gpuplane/gpuplane:0.1.0"
CA_PLACEHOLDER = "FILL_ME_FROM_manage.py_webhook_cert"
SECRET_KEYS = ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SECRET_KEY")

#: Exactly what gpuplane may do against the API (deploy/base/rbac.yaml says which code
#: path needs each; binder/kube/client.py makes every call): (ClusterRole, API group, resource)
#: -> verbs.
MIRRORED = [("", "namespaces"), ("", "nodes"), ("", "pods"), ("kubevirt.io", "virtualmachineinstances"),
            ("kubevirt.io", "virtualmachines")]  # fmt: skip
MIRRORED += [(GROUP, r) for r in ("gpuclasses", "gpus", "gpubudgets")]
EXPECTED_RULES: dict[tuple[str, str, str], set[str]] = {
    # sync_cluster: list and watch into the mirror; add the finalizer.
    **{("gpuplane-sync", g, r): {"list", "watch"} for g, r in MIRRORED},
    ("gpuplane-sync", GROUP, "gpus"): {"list", "watch", "patch"},
    ("gpuplane-sync", GROUP, "gpuclasses"): {"list", "watch", "patch"},
    # the binder: one object read after a 409, status, finalizer removal, VMIs for usage records.
    ("gpuplane-binder", GROUP, "gpubudgets"): {"get"},
    ("gpuplane-binder", GROUP, "gpus"): {"get", "patch"},
    ("gpuplane-binder", GROUP, "gpuclasses"): {"get", "patch"},
    **{("gpuplane-binder", GROUP, f"{r}/status"): {"patch"} for r in ("gpus", "gpuclasses", "gpubudgets")},
    ("gpuplane-binder", "kubevirt.io", "virtualmachineinstances"): {"get", "list"},
    # the web: the bind request annotation, VMIs for the tenant usage API.
    ("gpuplane-webhook", GROUP, "gpus"): {"patch"},
    ("gpuplane-web", "kubevirt.io", "virtualmachineinstances"): {"get", "list"},
    # the admin's node actions: the node's resourceVersion, then the cordon or drain patch.
    ("gpuplane-web", "", "nodes"): {"get", "patch"},
}
#: All roles together: list/watch on the mirrored kinds, get on VMIs and on the three
#: gpuplane kinds (the binder's single read after a 409), patch on gpus and gpuclasses
#: (finalizers, bind request) and on the status of the three gpuplane kinds; get and
#: patch on nodes (the admin's cordon and drain). No update: no code path PUTs an object.
EXPECTED_UNION = {
    *{(g, r, v) for g, r in MIRRORED for v in ("list", "watch")},
    ("kubevirt.io", "virtualmachineinstances", "get"),
    ("kubevirt.io", "virtualmachineinstances", "list"),
    *{(GROUP, r, "get") for r in ("gpus", "gpuclasses", "gpubudgets")},
    *{(GROUP, r, "patch") for r in ("gpus", "gpuclasses")},
    *{(GROUP, f"{r}/status", "patch") for r in ("gpus", "gpuclasses", "gpubudgets")},
    ("", "nodes", "get"),
    ("", "nodes", "patch"),
}
#: ServiceAccount -> the ClusterRoles bound to it (cluster overlay).
EXPECTED_BINDINGS = {
    "gpuplane-web": {"gpuplane-web"},
    "gpuplane-webhook": {"gpuplane-webhook"},
    "gpuplane-binder": {"gpuplane-binder"},
    "gpuplane-sync": {"gpuplane-sync"},
    "gpuplane-beat": set(),
}
DEPLOYMENTS = {
    "cluster": {"gpuplane-web", "gpuplane-webhook", "gpuplane-binder", "gpuplane-beat", "gpuplane-sync"},
    "standalone": {"gpuplane-web", "gpuplane-binder", "gpuplane-beat"},
}


# -- the CRDs ------------------------------------------------------------------------------


def crds(docs: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """The gpuplane CRDs by kind, from the base's crds/ (or the given rendered objects)."""
    docs = render(DEPLOY / "base" / "crds") if docs is None else docs
    return {d["spec"]["names"]["kind"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}


def served_version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version


# -- every overlay renders and validates ----------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_renders(name: str) -> None:
    docs = overlay(name)
    assert len(docs) > 10
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "CustomResourceDefinition", "ConfigMap", "Service", "Deployment"} <= kinds
    # Secrets never come from the repository.
    assert "Secret" not in kinds
    names = [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))
    for doc in docs:
        cluster_scoped = ("Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                          "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")  # fmt: skip
        if doc["kind"] not in cluster_scoped and not doc["kind"].endswith("WebhookConfiguration"):
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuplane"


def test_crds_render_alone() -> None:
    assert set(crds()) == set(GPUPLANE_KINDS)
    for name in OVERLAYS:
        rendered = crds(overlay(name))
        assert {k: v["spec"] for k, v in rendered.items()} == {k: v["spec"] for k, v in crds().items()}


@pytest.mark.parametrize("name", OVERLAYS)
def test_builtin_kinds_validate_against_kubernetes_schemas(name: str) -> None:
    checked, errors = [], []
    for doc in overlay(name):
        try:
            kubernetes_validate.validate(doc, SINCE.get(doc["kind"], K8S_VERSION), strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
        checked.append(doc["kind"])
    assert not errors, "\n".join(errors)
    assert "Deployment" in checked and "CustomResourceDefinition" in checked


def test_kubernetes_validate_refuses_a_broken_deployment() -> None:
    """The validator is really strict: an unknown field and a wrong type are errors."""
    deployment = one(overlay("cluster"), "Deployment", "gpuplane-web")
    kubernetes_validate.validate(copy.deepcopy(deployment), K8S_VERSION, strict=True)
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenessprobe"):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


# -- the CRDs -------------------------------------------------------------------------------


def test_crd_names_scope_and_subresources() -> None:
    expected = {
        "GPUClass": ("gpuclasses", "gpuclass", "Cluster", ["gpucl"]),
        "GPU": ("gpus", "gpu", "Namespaced", ["gpud"]),
        "GPUBudget": ("gpubudgets", "gpubudget", "Namespaced", ["gpub"]),
    }
    for kind, crd in crds().items():
        plural, singular, scope, short = expected[kind]
        names = crd["spec"]["names"]
        assert crd["metadata"]["name"] == f"{plural}.{GROUP}"
        assert crd["spec"]["group"] == GROUP and crd["spec"]["scope"] == scope
        assert (names["plural"], names["singular"], names["shortNames"]) == (plural, singular, short)
        assert names["listKind"] == f"{kind}List"
        assert names["categories"] == ["gpuplane"]
        version = served_version(crd)
        assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
        assert version["subresources"] == {"status": {}}


def builtin_names() -> set[str]:
    """Names kubectl already resolves: every built-in kind (as its singular), the common
    plurals and the built-in and KubeVirt short names."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S_VERSION}.0-local-strict"
    kinds = {p.name.split("-", 1)[0] for p in schemas.glob("*.json")}
    short = {
        "cm", "cs", "csr", "crd", "crds", "cj", "deploy", "ds", "ep", "ev", "hpa", "ing", "limits", "netpol",
        "no", "ns", "pc", "pdb", "po", "pv", "pvc", "quota", "rc", "rs", "sa", "sc", "sts", "svc",
        "vm", "vms", "vmi", "vmis", "vmim", "dv", "dvs",
    }  # fmt: skip
    return kinds | {k + "s" for k in kinds} | short


def test_short_names_do_not_clash() -> None:
    taken = builtin_names()
    ours = [n for crd in crds().values() for n in crd["spec"]["names"]["shortNames"]]
    assert len(ours) == len(set(ours))
    for name in ours:
        assert name not in taken
        assert name not in {crd["spec"]["names"][k] for crd in crds().values() for k in ("plural", "singular")}
    assert "deployment" in taken and "svc" in taken  # the list is real


def columns(kind: str) -> list[dict[str, Any]]:
    return served_version(crds()[kind])["additionalPrinterColumns"]


def test_gpu_printer_columns() -> None:
    default = [(c["name"], c["jsonPath"]) for c in columns("GPU") if not c.get("priority")]
    assert default == [
        ("Class", ".spec.className"),
        ("VM", ".spec.vmName"),
        ("Phase", ".status.phase"),
        ("Node", ".status.node"),
        ("Age", ".metadata.creationTimestamp"),
    ]
    wide = [c["name"] for c in columns("GPU") if c.get("priority")]
    assert wide == ["Held As", "Reason"]


def test_printer_columns_point_at_schema_fields() -> None:
    for kind, crd in crds().items():
        schema = served_version(crd)["schema"]["openAPIV3Schema"]
        names = [c["name"] for c in columns(kind)]
        assert [c["name"] for c in columns(kind) if not c.get("priority")][-1] == "Age"
        assert len(names) == len(set(names))
        for column in columns(kind):
            path = column["jsonPath"].lstrip(".").split(".")
            if path == ["metadata", "creationTimestamp"]:
                assert column["type"] == "date"
                continue
            node = schema
            for part in path:
                node = node["properties"][part]
            expected = {"integer": "integer", "string": "string", "object": "string"}[node["type"]]
            assert column["type"] == expected, column


def test_crd_fields_per_spec() -> None:
    def spec_of(kind: str) -> dict[str, Any]:
        return served_version(crds()[kind])["schema"]["openAPIV3Schema"]["properties"]

    cls = spec_of("GPUClass")
    assert cls["spec"]["required"] == ["resourceName"]
    units = cls["spec"]["properties"]["unitsPerDevice"]
    assert (units["type"], units["minimum"], units["default"]) == ("integer", 1, 1)
    selector = cls["spec"]["properties"]["nodeSelector"]["additionalProperties"]
    assert selector["type"] == "string" and selector["maxLength"] == 63
    assert cls["spec"]["properties"]["displayName"]["type"] == "string"
    assert {k: v["type"] for k, v in cls["status"]["properties"].items()} == {
        "allocatable": "integer", "bound": "integer", "lost": "integer",
    }  # fmt: skip

    dev = spec_of("GPU")
    assert sorted(dev["spec"]["required"]) == ["className", "vmName"]
    status = dev["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Bound", "Lost"]
    assert status["since"]["format"] == "date-time"
    assert set(status) == {
        "phase", "node", "since", "reason", "answeredRequest", "answer", "className", "borrowed", "reclaimFor",
    }  # fmt: skip
    alternatives = dev["spec"]["properties"]["alternativeClassNames"]
    assert (alternatives["maxItems"], alternatives["x-kubernetes-list-type"]) == (8, "set")

    budget = spec_of("GPUBudget")
    assert budget["spec"]["required"] == ["limits"]
    assert budget["spec"]["properties"]["limits"]["additionalProperties"] == {"type": "integer", "minimum": 0}
    assert budget["spec"]["properties"]["borrowing"]["additionalProperties"] == {"type": "integer", "minimum": 0}
    for field in ("used", "borrowed"):
        assert budget["status"]["properties"][field]["additionalProperties"] == {"type": "integer", "minimum": 0}


# -- RBAC -----------------------------------------------------------------------------------


def rules(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], set[str]]:
    result: dict[tuple[str, str, str], set[str]] = {}
    for kind in ("ClusterRole", "Role"):
        for name, role in of_kind(docs, kind).items():
            for rule in role.get("rules", []):
                assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/URLs
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        result.setdefault((name, group, resource), set()).update(rule["verbs"])
    return result


def test_rbac_has_no_wildcards_and_exactly_the_listed_verbs() -> None:
    docs = overlay("cluster")
    for kind in ("ClusterRole", "Role"):
        for role in of_kind(docs, kind).values():
            assert "aggregationRule" not in role
            for rule in role["rules"]:
                for field in ("apiGroups", "resources", "verbs"):
                    assert not any("*" in value for value in rule[field]), rule
    found = rules(docs)
    assert found == EXPECTED_RULES
    union = {(g, r, v) for (_, g, r), verbs in found.items() for v in verbs}
    assert union == EXPECTED_UNION
    assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")


def test_rbac_matches_the_api_calls_the_code_makes() -> None:
    """binder/kube/client.py makes every call (GET for list/watch/get, merge PATCH); if it ever
    creates, PUTs or deletes, rbac.yaml needs the verb, and this says so."""
    source = (ROOT / "binder" / "kube" / "client.py").read_text()
    assert set(re.findall(r'_call\(\s*"([A-Z]+)"', source)) == {"GET", "PATCH"}
    for package in ("binder", "usage", "webhooks", "gpuplane"):
        for path in (ROOT / package).rglob("*.py"):
            if path != ROOT / "binder" / "kube" / "client.py":
                text = path.read_text()
                assert "call_api(" not in text and "client.CoreV1Api" not in text, path


def test_rbac_bindings() -> None:
    docs = overlay("cluster")
    accounts = of_kind(docs, "ServiceAccount")
    assert set(accounts) == set(EXPECTED_BINDINGS)
    roles = of_kind(docs, "ClusterRole")
    bound: dict[str, set[str]] = {name: set() for name in accounts}
    for binding in of_kind(docs, "ClusterRoleBinding").values():
        assert binding["roleRef"]["kind"] == "ClusterRole" and binding["roleRef"]["name"] in roles
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
            bound[subject["name"]].add(binding["roleRef"]["name"])
    assert bound == EXPECTED_BINDINGS
    assert accounts["gpuplane-beat"]["automountServiceAccountToken"] is False
    deployments = of_kind(docs, "Deployment")
    for name, deployment in deployments.items():
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == name


def test_standalone_makes_no_api_calls() -> None:
    docs = overlay("standalone")
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "MutatingWebhookConfiguration"):
        assert not of_kind(docs, kind), kind
    accounts = of_kind(docs, "ServiceAccount")
    assert set(accounts) == {"gpuplane-web", "gpuplane-binder", "gpuplane-beat"}
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())


# -- Deployments and settings ---------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_deployments(name: str) -> None:
    docs = overlay(name)
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == DEPLOYMENTS[name]
    (config_map,) = of_kind(docs, "ConfigMap").values()
    assert config_map["metadata"]["name"].startswith("gpuplane-settings-")  # hashed: a change rolls the pods
    command = {n: d["spec"]["template"]["spec"]["containers"][0]["command"] for n, d in deployments.items()}
    assert command["gpuplane-web"] == ["gunicorn", "-c", "deploy/gunicorn.conf.py", "gpuplane.wsgi"]
    if name == "cluster":
        assert command["gpuplane-webhook"] == ["python", "deploy/webhook_server.py"]
        assert deployments["gpuplane-webhook"]["spec"]["replicas"] == 2
    assert command["gpuplane-binder"] == [
        "celery", "-A", "gpuplane", "worker", "-Q", "binder", "--concurrency", "1", "--prefetch-multiplier", "1",
        "-l", "info",
    ]  # fmt: skip
    assert command["gpuplane-beat"][:4] == ["celery", "-A", "gpuplane", "beat"]
    if name == "cluster":
        assert command["gpuplane-sync"] == ["python", "manage.py", "sync_cluster", "--no-progress"]
    assert deployments["gpuplane-web"]["spec"]["replicas"] == 2
    beat = deployments["gpuplane-beat"]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"
    assert beat["template"]["spec"]["initContainers"][0]["command"] == ["python", "manage.py", "migrate", "--noinput"]
    if "gpuplane-sync" in deployments:
        sync = deployments["gpuplane-sync"]["spec"]
        assert sync["replicas"] == 1 and sync["strategy"]["type"] == "Recreate"

    for deployment in deployments.values():
        spec = deployment["spec"]["template"]["spec"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # The restricted Pod Security Standard (the namespace enforces it).
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in pod_containers(deployment):
            assert container["image"] == IMAGE
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/var/lib/gpuplane"]]
            assert "emptyDir" in volumes[mounts["/tmp"]]  # noqa: S108 (the pod's own emptyDir)
            assert container["envFrom"] == [{"configMapRef": {"name": config_map["metadata"]["name"]}}]
            env = {e["name"]: e for e in container["env"]}
            for key in SECRET_KEYS:
                assert env[key] == {
                    "name": key,
                    "valueFrom": {"secretKeyRef": {"name": "gpuplane-secrets", "key": key}},
                }
            # A value may name where a secret is mounted (``*_FILE``), never hold one.
            secretive = re.compile(r"(?i)secret|password|token")
            assert all(
                "value" not in e or e["name"].endswith("_FILE") or not secretive.search(e["name"]) for e in env.values()
            )


@pytest.mark.parametrize(
    ("deployment", "service"), [("gpuplane-web", "gpuplane-api"), ("gpuplane-webhook", "gpuplane-webhook")]
)
def test_web_and_webhook_serve_tls_with_probes(deployment: str, service: str) -> None:
    docs = overlay("cluster")
    web = one(docs, "Deployment", deployment)
    spec = web["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUPLANE_TLS_CERT_FILE"] == "/etc/gpuplane/tls/tls.crt"
    assert env["GPUPLANE_TLS_KEY_FILE"] == "/etc/gpuplane/tls/tls.key"
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/gpuplane/tls")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "gpuplane-webhook-tls" and mount["readOnly"] is True
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["scheme"], get["path"], get["port"]) == ("HTTPS", path, "https")
    front = one(docs, "Service", service)
    port, *metrics = front["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (443, "https")
    https, *metrics_port = container["ports"]
    assert https == {"name": "https", "containerPort": 8443}
    if deployment == "gpuplane-webhook":
        # The webhook server's own /metrics, plain HTTP beside the webhook (docs/webhook.md).
        assert metrics == [{"name": "metrics", "port": 9102, "targetPort": "metrics", "protocol": "TCP"}]
        assert metrics_port == [{"name": "metrics", "containerPort": 9102}]
    else:
        assert not metrics and not metrics_port
    assert front["spec"]["selector"].items() <= web["spec"]["template"]["metadata"]["labels"].items()
    # The Services select one Deployment each: the webhook's port serves nothing else.
    others = [d for d in of_kind(docs, "Deployment").values() if d is not web]
    selector = front["spec"]["selector"].items()
    assert not any(selector <= d["spec"]["template"]["metadata"]["labels"].items() for d in others)
    budget = one(docs, "PodDisruptionBudget", deployment)
    assert budget["spec"]["selector"] == web["spec"]["selector"]


def settings_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    (config_map,) = of_kind(docs, "ConfigMap").values()
    return dict(config_map["data"])


@pytest.mark.parametrize(("name", "cluster"), [("cluster", "kubernetes"), ("standalone", "standalone")])
def test_settings_are_ones_gpuplane_reads_and_start(name: str, cluster: str, tmp_path: Path) -> None:
    data = settings_env(overlay(name))
    assert data["GPUPLANE_CLUSTER"] == cluster
    assert not set(data) & set(SECRET_KEYS)
    known = (ROOT / "gpuplane" / "settings.py").read_text()
    for key in data:
        assert f'"{key}"' in known, f"{key} is not a setting gpuplane/settings.py reads"
    # gpuplane starts with these values (a typo such as GPUPLANE_ENABLED=yess stops it).
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "DJANGO_", "CELERY_"))},
        **data,
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "DJANGO_SECRET_KEY": "test-only",
        "DJANGO_SETTINGS_MODULE": "gpuplane.settings",
    }
    script = (
        "import django, json; from django.conf import settings; django.setup(); "
        "print(json.dumps([settings.GPUPLANE_CLUSTER, settings.GPUPLANE_ENABLED, "
        "settings.GPUPLANE_BIND_WAIT_SECONDS, settings.ALLOWED_HOSTS]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded_cluster, enabled, wait, hosts = json.loads(done.stdout.strip().splitlines()[-1])
    assert (loaded_cluster, enabled) == (cluster, True)
    assert wait < 10  # below the webhook's timeoutSeconds
    assert {"gpuplane-webhook.gpuplane-system.svc", "localhost"} <= set(hosts)


# -- the webhook configuration --------------------------------------------------------------


def test_webhook_configuration_in_the_cluster_overlay() -> None:
    docs = overlay("cluster")
    config = one(docs, "MutatingWebhookConfiguration", "gpuplane-vmi")
    (hook,) = config["webhooks"]
    assert hook["name"] == "vmi.gpuplane.io"
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Fail", 10)
    assert (hook["sideEffects"], hook["matchPolicy"]) == ("NoneOnDryRun", "Equivalent")
    (rule,) = hook["rules"]
    assert (rule["apiGroups"], rule["operations"], rule["resources"]) == (
        ["kubevirt.io"], ["CREATE"], ["virtualmachineinstances"],
    )  # fmt: skip
    service = hook["clientConfig"]["service"]
    assert service == {"name": "gpuplane-webhook", "namespace": NAMESPACE, "path": "/webhooks/vmi", "port": 443}
    assert service["port"] in [p["port"] for p in one(docs, "Service", service["name"])["spec"]["ports"]]
    # Unfilled, the caBundle is a placeholder that is not base64, so applying it fails at
    # once; it appears exactly once, so `sed s|PLACEHOLDER|$CA_BUNDLE|` fills exactly it.
    assert hook["clientConfig"]["caBundle"] == CA_PLACEHOLDER
    assert render_text(DEPLOY / "overlays" / "cluster").count(CA_PLACEHOLDER) == 1
    with pytest.raises(binascii.Error):
        base64.b64decode(CA_PLACEHOLDER, validate=True)


def test_an_operator_overlay_sets_image_ca_bundle_and_settings(tmp_path: Path) -> None:
    """docs/operations.md, "Run in a cluster": an overlay of the operator's own on top of the cluster one."""
    ca_bundle = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()
    site = tmp_path / "gpuplane-site"
    site.mkdir()
    (site / "kustomization.yaml").write_text(
        f"""apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {os.path.relpath(DEPLOY / "overlays" / "cluster", site)}
images:
  - name: ghcr.io/gpuplane/gpuplane
    newName: registry.example.com/gpuplane
    newTag: "1.2.3"
configMapGenerator:
  - name: gpuplane-settings
    behavior: merge
    literals:
      - GPUPLANE_DEFAULT_BUDGET=deny
patches:
  - target:
      kind: MutatingWebhookConfiguration
      name: gpuplane-vmi
    patch: |-
      - op: replace
        path: /webhooks/0/clientConfig/caBundle
        value: {ca_bundle}
"""
    )
    docs = render(site)
    (hook,) = one(docs, "MutatingWebhookConfiguration", "gpuplane-vmi")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == ca_bundle
    images = {c["image"] for d in of_kind(docs, "Deployment").values() for c in pod_containers(d)}
    assert images == {"registry.example.com/gpuplane:1.2.3"}
    data = settings_env(docs)
    assert data["GPUPLANE_DEFAULT_BUDGET"] == "deny" and data["GPUPLANE_CLUSTER"] == "kubernetes"
    (config_map,) = of_kind(docs, "ConfigMap").values()
    refs = {
        ref["configMapRef"]["name"]
        for d in of_kind(docs, "Deployment").values()
        for c in pod_containers(d)
        for ref in c["envFrom"]
    }
    assert refs == {config_map["metadata"]["name"]}
    assert render_text(site).count(CA_PLACEHOLDER) == 0


def test_the_old_single_file_manifest_is_gone() -> None:
    assert not (DEPLOY / "webhook.yaml").exists()
    assert (DEPLOY / "gunicorn.conf.py").is_file() and (DEPLOY / "demo" / "cluster.yaml").is_file()

"""deploy/ on a real kube-apiserver: what ``kubectl apply -k deploy/overlays/cluster`` sends is
accepted as it stands, by the server's own validation (built-in kinds, the CRDs' OpenAPI
schemas and CEL rules, RBAC escalation checks), with strict field validation as kubectl asks.

Objects that change nothing for the other tests are applied for real (server-side apply);
the workloads and the webhook configuration with a server-side dry run: no controller runs
Deployments here, and a registered VMI webhook pointing at a Service with no pods would
refuse every other test's VMIs.
"""

from __future__ import annotations

import base64
import json
import subprocess
from typing import Any

import pytest
import yaml

from harness.controlplane import ApiError, ControlPlane, tool
from harness.manifests import DEPLOY, overlay, render

#: Kinds sent with dryRun=All only.
#: Kinds applied as a dry run only: the rest of the session's tests must not run with them live.
DRY_RUN = {
    "Deployment",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "PodDisruptionBudget",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
}


CA_PLACEHOLDER = "FILL_ME_FROM_manage.py_webhook_cert"


def as_an_operator_sets_it(plane: ControlPlane, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The one value deploy/ leaves to the operator (docs/webhook.md): the webhook's CA bundle,
    here the test control plane's CA. The placeholder itself is not base64: a server refuses it."""
    ca = base64.b64encode(plane.pki.ca_file.read_bytes()).decode()
    text = json.dumps(docs).replace(CA_PLACEHOLDER, ca)
    return list(json.loads(text))


def test_the_ca_placeholder_is_refused_as_it_stands(control_plane: ControlPlane) -> None:
    (config,) = [d for d in overlay("cluster") if d["kind"] == "MutatingWebhookConfiguration"]
    assert CA_PLACEHOLDER in json.dumps(config)
    with pytest.raises(ApiError, match="base64"):
        control_plane.apply(config, dry_run=True)


@pytest.mark.parametrize("name", ["cluster", "standalone"])
def test_the_overlay_applies_cleanly(control_plane: ControlPlane, name: str) -> None:
    docs = as_an_operator_sets_it(control_plane, overlay(name))
    assert docs
    refused = []
    for doc in docs:
        try:
            stored = control_plane.apply(doc, dry_run=doc["kind"] in DRY_RUN)
        except ApiError as exc:
            refused.append(f"{doc['kind']} {doc['metadata']['name']}: {exc}")
            continue
        assert stored["metadata"]["name"] == doc["metadata"]["name"]
    assert not refused, "\n".join(refused)


def test_kubectl_applies_the_overlay_server_side(control_plane: ControlPlane) -> None:
    """The same through kubectl itself (built beside the control plane), as an operator runs it."""
    rendered = yaml.safe_dump_all(as_an_operator_sets_it(control_plane, overlay("cluster")))
    done = subprocess.run(
        [str(tool("kubectl")), "--kubeconfig", str(control_plane.kubeconfig()), "apply", "--server-side",
         "--dry-run=server", "--field-manager=gpuplane-tests", "-f", "-"],
        input=rendered, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "customresourcedefinition.apiextensions.k8s.io/gpus.gpuplane.io serverside-applied" in done.stdout


def test_a_broken_deployment_is_refused_by_the_server(control_plane: ControlPlane) -> None:
    """The dry run is no formality: the server refuses what it would refuse for real."""
    deployment: dict[str, Any] = next(d for d in overlay("cluster") if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["image"] = ""
    with pytest.raises(ApiError) as refused:
        control_plane.apply(deployment, dry_run=True)
    assert refused.value.code == 422
    assert "spec.template.spec.containers[0].image" in str(refused.value)


def test_the_crds_alone_apply(control_plane: ControlPlane) -> None:
    for doc in render(DEPLOY / "base" / "crds"):
        control_plane.apply(doc)

"""The Kubernetes manifests in deploy/, rendered as ``kubectl apply -k`` would render them
(``kubectl kustomize``), and looked up by kind and name.

Used by tests/project/test_deploy.py and the control-plane tests. kubectl is the one built beside the
test control plane from pinned modules (``make kube-bin``; harness/controlplane/).
"""

from __future__ import annotations

import base64
import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

from harness.controlplane import tool

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@functools.cache
def _render_text(path: str) -> str:
    done = subprocess.run(
        [str(tool("kubectl")), "kustomize", path], capture_output=True, text=True, timeout=120, check=False
    )  # fmt: skip
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return done.stdout


def render_text(path: Path | str) -> str:
    return _render_text(str(path))


def render(path: Path | str) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k path`` would send (fresh copies)."""
    return [d for d in yaml.safe_load_all(render_text(path)) if d]


def overlay(name: str) -> list[dict[str, Any]]:
    return render(DEPLOY / "overlays" / name)


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert name in found, f"no {kind} {name} in {sorted(found)}"
    return found[name]


def pod_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def register_webhook(plane: Any, url: str) -> dict[str, Any]:
    """deploy/'s MutatingWebhookConfiguration, applied to ``plane`` (a control plane) pointed at
    ``url`` with the test CA's bundle: the two values an operator sets (docs/webhook.md)."""
    (config,) = [d for d in overlay("cluster") if d["kind"] == "MutatingWebhookConfiguration"]
    hook = config["webhooks"][0]
    hook["clientConfig"] = {
        "url": f"{url}/webhooks/vmi",
        "caBundle": base64.b64encode(plane.pki.ca_file.read_bytes()).decode(),
    }
    return dict(plane.apply(config))

"""Apply gpuplane's CRDs server-side, then wait until the apiserver serves them: the chart's
pre-upgrade hook (``crds.upgrade``), since Helm installs ``crds/`` once and never upgrades it.

    python deploy/apply_crds.py DIR [--field-manager NAME] [--timeout SECONDS]

Every ``*.yaml`` in DIR (the chart's ``crds/``, mounted from a ConfigMap the chart renders) is
applied with server-side apply, forcing ownership of the fields it sets, as ``kubectl apply
--server-side --force-conflicts`` does; only gpuplane.io CustomResourceDefinitions are accepted.
Then each must report ``Established`` before the run ends, so the new pods start against the new
schema. Credentials: the pod's ServiceAccount in a cluster, else ``KUBECONFIG`` (the tests).
No Django, no database.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

GROUP = "gpuplane.io"


class CrdError(RuntimeError):
    """A file this command will not apply, or a CRD that never became Established."""


def load(directory: Path) -> list[dict[str, Any]]:
    """The CRDs in ``directory``, checked to be gpuplane's own."""
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise CrdError(f"{directory}: no *.yaml files")
    crds = []
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            kind, group = doc.get("kind"), (doc.get("spec") or {}).get("group")
            if kind != "CustomResourceDefinition" or group != GROUP:
                raise CrdError(
                    f"{path.name}: {kind} of group {group!r}; only {GROUP} CustomResourceDefinitions are applied"
                )
            crds.append(doc)
    return crds


def _established(crd: Any) -> bool:
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def apply(crds: Sequence[dict[str, Any]], field_manager: str, timeout: float) -> list[str]:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiextensionsV1Api()
    said = []
    for crd in crds:
        name = crd["metadata"]["name"]
        applied = api.patch_custom_resource_definition(
            name, crd, field_manager=field_manager, force=True, _content_type="application/apply-patch+yaml"
        )
        versions = ", ".join(v.name for v in applied.spec.versions)
        said.append(f"applied {name} (served: {versions})")
    deadline = time.monotonic() + timeout
    for crd in crds:
        name = crd["metadata"]["name"]
        while True:
            current = api.api_client.sanitize_for_serialization(api.read_custom_resource_definition(name))
            if _established(current):
                break
            if time.monotonic() > deadline:
                raise CrdError(f"{name} was not Established within {timeout:.0f} s")
            time.sleep(0.5)
    said.append(f"{len(crds)} CRDs Established")
    return said


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the directory of the CRDs' YAML files")
    parser.add_argument("--field-manager", default="gpuplane-crds", help="the server-side apply field manager")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for Established")
    args = parser.parse_args(argv)
    try:
        for line in apply(load(args.directory), args.field_manager, args.timeout):
            print(line, flush=True)
    except CrdError as exc:
        print(f"apply_crds: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

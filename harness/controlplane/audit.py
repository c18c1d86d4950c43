"""The apiserver's audit log: one line per resource request, which a test reads to ask
"which calls did gpuplane make" (and as whom, and what RBAC authorized)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "users": ["system:kube-controller-manager", "system:apiserver"]},
        {"level": "None", "nonResourceURLs": ["/*"]},
        {"level": "Metadata"},
    ],
}


@dataclass(frozen=True)
class Call:
    """One resource request as the audit log saw it."""

    user: str
    group: str
    resource: str  # "gpus" or "gpus/status"
    verb: str
    namespace: str
    name: str
    code: int

    @property
    def rbac(self) -> tuple[str, str, str]:
        """What RBAC authorized: (API group, resource[/subresource], verb)."""
        return (self.group, self.resource, self.verb)


class AuditLog:
    """The audit policy and log file under ``directory``, and the calls logged since a mark."""

    def __init__(self, directory: Path) -> None:
        self.policy = directory / "audit-policy.yaml"
        self.path = directory / "audit.log"
        self._offset = 0

    def write_policy(self) -> None:
        self.policy.write_text(yaml.safe_dump(AUDIT_POLICY))

    def mark(self) -> None:
        """Forget the calls so far: :meth:`calls` returns only those made after this."""
        self._offset = self.path.stat().st_size if self.path.exists() else 0

    def calls(self, wanted: str | None = None) -> list[Call]:
        """Resource requests since :meth:`mark` (one per request: a watch counts once, when
        its response started), optionally of the user named ``wanted``."""
        seen: set[str] = set()
        found: list[Call] = []
        if not self.path.exists():
            return found
        with self.path.open() as handle:
            handle.seek(self._offset)
            for line in handle:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written
                ref = event.get("objectRef")
                if not ref or event.get("auditID") in seen:
                    continue
                seen.add(event["auditID"])
                username = event.get("user", {}).get("username", "")
                if wanted and username != wanted:
                    continue
                resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
                found.append(
                    Call(
                        username, ref.get("apiGroup", ""), resource, event.get("verb", ""),
                        ref.get("namespace", ""), ref.get("name", ""),
                        int(event.get("responseStatus", {}).get("code", 0)),
                    )
                )  # fmt: skip
        return found

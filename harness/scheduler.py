"""kube-scheduler and KubeVirt, as far as the pin tests need them: the virt-launcher pod
KubeVirt makes for a VMI, and whether the scheduler's NodeAffinity and TaintToleration
filters let that pod onto a node. Shared by tests/webhooks/test_pin.py, tests/engine/test_taints.py and
tests/webhooks/test_bind_selector.py."""

from __future__ import annotations

import copy
from typing import Any

from harness.shapes import real

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def launcher_for(vmi: dict[str, Any]) -> dict[str, Any]:
    """The virt-launcher pod KubeVirt would create for ``vmi`` (template.go): the captured
    pod with the VMI's nodeSelector (plus kubevirt.io/schedulable), affinity and tolerations."""
    pod = real("virt-launcher-pod.yaml")
    spec = vmi.get("spec", {})
    pod["spec"]["nodeSelector"] = {**spec.get("nodeSelector", {}), "kubevirt.io/schedulable": "true"}
    pod["spec"].pop("affinity", None)
    if "affinity" in spec:
        pod["spec"]["affinity"] = copy.deepcopy(spec["affinity"])
    pod["spec"]["tolerations"] = [*pod["spec"].get("tolerations", []), *copy.deepcopy(spec.get("tolerations", []))]
    return pod


def _expression_holds(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    op, key, values = expr["operator"], expr["key"], expr.get("values", [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if key not in labels or not labels[key].lstrip("-").isdigit():
        return False  # the scheduler: a label that is not an integer does not match Gt/Lt
    return int(labels[key]) > int(values[0]) if op == "Gt" else int(labels[key]) < int(values[0])


def term_holds(term: dict[str, Any], node: dict[str, Any]) -> bool:
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return False
    labels = node["metadata"].get("labels", {})
    name_ok = all(
        f["key"] == "metadata.name" and ((node["metadata"]["name"] in f["values"]) == (f["operator"] == "In"))
        for f in fields
    )
    return name_ok and all(_expression_holds(e, labels) for e in exprs)


def _tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", "")


def schedulable(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    """kube-scheduler's NodeAffinity (nodeSelector and required affinity) and TaintToleration
    (NoSchedule/NoExecute) filters for ``pod`` on ``node``."""
    labels = node["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
        return False
    required = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(REQUIRED)
    if required is not None and not any(term_holds(t, node) for t in required["nodeSelectorTerms"]):
        return False
    tolerations = pod["spec"].get("tolerations") or []
    return all(
        any(_tolerates(t, taint) for t in tolerations)
        for taint in (node["spec"].get("taints") or [])
        if taint["effect"] in ("NoSchedule", "NoExecute")
    )

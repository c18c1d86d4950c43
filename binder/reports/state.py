"""The cluster state as operators read it: devices, node booking and tenant usage.

``dump_state --json`` prints exactly this, and the admin and the catalog read
the same numbers, all computed by the engine's one ledger from one snapshot.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.utils import timezone

from binder import models
from binder.engine import effective_limits, ledger_for, tenant_usage
from binder.engine import types as e
from binder.mirror.read import read_cluster


def cluster_state(cluster: e.Cluster | None = None) -> dict[str, Any]:
    """The state document (devices, nodes, tenants): lists sorted by namespace then name, integers in units."""
    if cluster is None:
        cluster, _ = read_cluster(timezone.now())
    ledger = ledger_for(cluster)
    devices = [
        {
            "namespace": d.namespace,
            "name": d.name,
            # The held class while Bound or Lost, spec.className while Pending.
            "class": d.class_name,
            "vm": d.vm_name,
            "phase": d.phase.value,
            "node": d.node,
            "reason": d.reason,
            **({"choices": list(d.choices)} if len(d.choices) > 1 else {}),
            **({"borrowed": True} if d.borrowed else {}),
            **({"reclaimFor": d.reclaim_for} if d.reclaim_for else {}),
        }
        for d in sorted(cluster.devices, key=lambda d: d.key)
    ]
    nodes = []
    for node in sorted(cluster.nodes, key=lambda n: n.name):
        resources = set(node.allocatable) | {r for r, units in ledger.booked.get(node.name, {}).items() if units}
        nodes.append(
            {
                "name": node.name,
                "resources": {
                    r: {
                        "allocatable": node.allocatable.get(r, 0),
                        "booked": ledger.booked[node.name][r],
                        "free": ledger.free(node.name, r),
                    }
                    for r in sorted(resources)
                },
            }
        )
    budgets: dict[str, list[e.Budget]] = defaultdict(list)
    for budget in cluster.budgets:
        budgets[budget.namespace].append(budget)
    namespaces = set(models.Namespace.objects.values_list("name", flat=True))
    namespaces |= {d.namespace for d in cluster.devices} | set(budgets)
    tenants = []
    for ns in sorted(namespaces):
        limits = effective_limits(budgets.get(ns, ()), cluster.settings.default_budget)
        tenant: dict[str, Any] = {
            "namespace": ns,
            "usage": tenant_usage(ledger, ns),
            "limits": dict(sorted(limits.per_key.items())),
        }
        if any(b.borrowing for b in budgets.get(ns, ())):
            tenant["borrowing"] = dict(sorted(limits.borrowing.items()))
        borrowed = {k: v for k, v in sorted(ledger.borrowed.get(ns, {}).items()) if v}
        if borrowed:
            tenant["borrowed"] = borrowed
        tenants.append(tenant)
    return {"devices": devices, "nodes": nodes, "tenants": tenants}

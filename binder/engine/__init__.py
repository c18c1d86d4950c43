"""The pure binder engine: placement, set restoration and accounting, with no Django.

Everything that decides where a GPU goes or how much a tenant uses lives here, so it
can be tested with plain objects and reused unchanged by the database-backed passes,
the webhook, the catalog and the usage records.
"""

from binder.engine.accounting import Ledger, build_ledger, ledger_for, tenant_usage
from binder.engine.catalog import GpuOption, gpu_options
from binder.engine.fit import budget_refusal
from binder.engine.launcher import RawUsage, is_launcher, launcher_of, raw_usage, raw_usage_of
from binder.engine.ledger_records import Holding
from binder.engine.limits import Limits, effective_limits, remaining
from binder.engine.placement import ANSWER_BOUND, ANSWER_REFUSED, answer_pass, full_pass
from binder.engine.types import (
    Budget,
    Change,
    ClassStatus,
    Cluster,
    DefaultBudget,
    Device,
    GpuClass,
    Node,
    Outcome,
    PassResult,
    Phase,
    Pod,
    Settings,
    Taint,
    Toleration,
    Vmi,
)

__all__ = [
    "Holding",
    "build_ledger",
    "remaining",
    "ANSWER_BOUND",
    "ANSWER_REFUSED",
    "Budget",
    "Change",
    "ClassStatus",
    "Cluster",
    "DefaultBudget",
    "Device",
    "GpuClass",
    "GpuOption",
    "Ledger",
    "Limits",
    "Node",
    "Outcome",
    "PassResult",
    "Phase",
    "Pod",
    "RawUsage",
    "Settings",
    "Taint",
    "Toleration",
    "Vmi",
    "answer_pass",
    "budget_refusal",
    "effective_limits",
    "full_pass",
    "gpu_options",
    "is_launcher",
    "launcher_of",
    "ledger_for",
    "raw_usage",
    "raw_usage_of",
    "tenant_usage",
]

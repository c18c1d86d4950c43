"""Lost and Pending sets explained for staff pages, as HTML.

The engine (``binder.engine.explain``) says what a set needs and what would fit; this reads
the mirror for it and renders the one block every page shows (the board's panel, the
Lost sets view, the device page), so the three never word it differently.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from binder import apiserver, models
from binder.engine import types as e
from binder.engine.accounting import ledger_for
from binder.engine.explain import Explainer, Explanation, Option, explain_sets
from binder.engine.ledger_records import SetKey
from binder.engine.preview import NodeAction, title
from binder.mirror.read import engine_settings, read_cluster, read_rows


def explanations_now(now: datetime) -> dict[SetKey, Explanation]:
    """Every set with a Lost or Pending device, explained from the mirror as it is now."""
    cluster, _ = read_cluster(now)
    return explain_sets(cluster)


def explanation_of(key: SetKey, now: datetime) -> Explanation | None:
    """One set explained now (a device's page), reading only what its explanation counts.

    That is the set's tenant (its devices, pods, VMIs and budgets: its usage against its
    limits), every node and class (where the set could go), and what books the set's GPU
    resources (those of every class the set may be placed as, its alternatives too) on a
    node: devices placed on a node as a class of those resources, the pods
    requesting them and the VMIs those pods may launch (the launcher rule). Devices and
    pods of other resources, and other tenants' unplaced orders, change none of its
    numbers and are not read: on a large mirror they are most of it. None when the set has
    no Lost or Pending device.
    """
    namespace, vm = key
    tenant = Q(namespace__name=namespace)
    members = models.GpuDevice.objects.filter(tenant, vm_name=vm)
    if not members.exclude(phase=models.Phase.BOUND).exists():
        return None
    classes = tuple(read_rows("GPUClass"))
    # Every class the set may be placed as: an order with alternatives is explained for
    # each of its choices, so each choice's resources must be read.
    wanted: set[str] = set()
    for class_name, alternatives in members.values_list("class_name", "alternative_class_names"):
        wanted.add(class_name)
        wanted.update(name for name in alternatives or () if isinstance(name, str))
    resources = sorted({c.resource_name for c in classes if c.name in wanted})
    booking = [c.name for c in classes if c.resource_name in resources]
    pods = tuple(
        read_rows("Pod", queryset=models.Pod.objects.filter(tenant | Q(gpu_requests__has_any_keys=resources)))
        if resources
        else read_rows("Pod", queryset=models.Pod.objects.filter(tenant))
    )
    launchers = Q(namespace__name__in={p.namespace for p in pods}, name__in={p.owner_vmi for p in pods})
    # A device held as one of its alternatives books that class's resource, not its spec.className's.
    placed = (Q(class_name__in=booking) | Q(status_class_name__in=booking)) & ~Q(node="")
    devices = tuple(read_rows("GPU", queryset=models.GpuDevice.objects.filter(tenant | placed)))
    # Making room: whether the sets placed there are stopped VMs' (a VirtualMachine, no VMI).
    held_by = Q(name__in={d.vm_name for d in devices if d.node})
    cluster = e.Cluster(
        now=now,
        classes=classes,
        nodes=tuple(read_rows("Node")),
        devices=devices,
        budgets=tuple(read_rows("GPUBudget", queryset=models.GpuBudget.objects.filter(tenant))),
        vmis=tuple(read_rows("VirtualMachineInstance", queryset=models.VirtualMachineInstance.objects.filter(
            tenant | launchers | held_by
        ))),
        pods=pods,
        settings=engine_settings(),
        virtual_machines=tuple(read_rows("VirtualMachine", queryset=models.VirtualMachine.objects.filter(held_by))),
    )  # fmt: skip
    return Explainer(cluster, ledger_for(cluster)).explain(key)


#: The node action that undoes each state an option names (binder.engine.explain.Option.state).
UNDOES = {"NotReady": NodeAction.READY, "cordoned": NodeAction.UNCORDON, "draining": NodeAction.UNDRAIN}


def _fit_item(option: Option) -> SafeString:
    """One "would fit" line; a node state staff can change links to that action's preview
    (Ready only in standalone mode: in a cluster the kubelet reports it)."""
    action = UNDOES.get(option.state)
    if action is None or (action is NodeAction.READY and apiserver.cluster_mode()):
        return format_html("{}", option.sentence())
    return format_html(
        '{} <a class="fit-action" data-node="{}" data-action="{}" href="{}">{} {}…</a>',
        option.sentence(),
        option.node,
        action.value,
        reverse("admin:node-action", args=[option.node, action.value]),
        title(action),
        option.node,
    )


def explanation_html(why: Explanation) -> SafeString:
    """The explanation as a block: what it needs (the largest gap, who holds the rest), the
    VMI's node flagged when NotReady, and the options that would fit, fewest changes first."""
    vmi = (
        format_html('<p class="vmi{}">{}</p>', " notready" if why.vmi_node_not_ready else "", why.vmi_note)
        if why.vmi_note
        else ""
    )
    room = format_html('<p class="room">{}</p>', why.room_note) if why.room_note else ""
    steps = (
        format_html(
            '<p class="fit-heading">would fit:</p><ol class="would-fit">{}</ol>',
            format_html_join("", "<li>{}</li>", ((_fit_item(option),) for option in why.fits)),
        )
        if why.fits
        else ""
    )
    return format_html(
        '<div class="explain" data-set="{}/{}"><p class="needs">{}</p>{}{}{}</div>',
        why.namespace,
        why.vm,
        why.summary,
        vmi,
        room,
        steps,
    )

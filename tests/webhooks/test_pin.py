"""The exact pin: the launcher pod must be schedulable where the GPUs are.

On EKS a node named ``ip-172-31-44-68.eu-west-1.compute.internal`` carries
``kubernetes.io/hostname: ip-172-31-44-68``; a pin by node name matches no node and the
launcher stays Pending with its GPUs booked. So every test here applies the webhook's patch
to the VMI, builds the virt-launcher pod from it the way KubeVirt's template service does
(the VMI's nodeSelector plus ``kubevirt.io/schedulable``, its affinity and tolerations, on the
captured launcher pod), and checks that pod against the node as kube-scheduler's
NodeAffinity and TaintToleration filters do. Nodes are the captured
``node-with-gpus.yaml``, renamed.
"""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest
from django.test import Client

from binder import models
from binder.engine import Device, GpuClass, Node, Phase
from binder.mirror.snapshot import load_objects
from harness.factories import new_vmi, review
from harness.scheduler import launcher_for, schedulable, term_holds
from harness.shapes import A10, H100, class_obj, gpu_obj, node_obj
from harness.webhook_calls import allowed_patch, denied, post
from webhooks import admission
from webhooks.admission import Action, MirrorView, ReviewError

EKS_NAME = "ip-172-31-44-68.eu-west-1.compute.internal"
EKS_HOSTNAME = "ip-172-31-44-68"
HOSTNAME = "kubernetes.io/hostname"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


# -- what KubeVirt and the scheduler do (written from their rules, not from gpuplane's code) --


def eks_node(name: str = EKS_NAME, hostname: str | None = EKS_HOSTNAME, **allocatable: int) -> dict[str, Any]:
    """The captured GPU node, renamed the EKS way: its hostname label is not its name."""
    obj = node_obj(name, {H100: allocatable.get("h100", 4), A10: allocatable.get("a10", 4)})
    if hostname is None:
        del obj["metadata"]["labels"][HOSTNAME]
    else:
        obj["metadata"]["labels"][HOSTNAME] = hostname
    return obj


def other_node(name: str = "gpu-other") -> dict[str, Any]:
    return node_obj(name, {H100: 4, A10: 4})


def load(*objects: dict[str, Any]) -> None:
    load_objects([class_obj("h100", H100), class_obj("a10x2", A10, units=2), *objects])


# -- through the webhook, on the database ------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_eks_node_is_pinned_by_its_hostname_label_and_the_launcher_schedules_there(client: Client) -> None:
    node = eks_node()
    load(node, other_node(), gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    body = review(new_vmi("t1", "vm1", ["g0"]))
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"][HOSTNAME] == EKS_HOSTNAME
    pod = launcher_for(patched)
    assert schedulable(pod, node)
    assert not schedulable(pod, other_node())
    # The old pin (the node's name) would have matched no node at all.
    assert not schedulable({**pod, "spec": {**pod["spec"], "nodeSelector": {HOSTNAME: EKS_NAME}}}, node)


@pytest.mark.django_db(transaction=True)
def test_a_pending_set_bound_on_demand_onto_an_eks_node_is_pinned_by_its_label(client: Client) -> None:
    """The node comes from the binder's answer, after the view was read: it is read fresh."""
    node = eks_node()
    load(node, gpu_obj("t1", "g0", "h100", "vm1"))
    body = review(new_vmi("t1", "vm1", ["g0"]))
    patched = allowed_patch(post(client, body), body)
    assert models.GpuDevice.objects.get(name="g0").node == EKS_NAME
    assert patched["spec"]["nodeSelector"][HOSTNAME] == EKS_HOSTNAME
    assert schedulable(launcher_for(patched), node)


@pytest.mark.django_db(transaction=True)
def test_a_node_without_a_hostname_label_is_pinned_by_a_required_affinity_on_its_name(client: Client) -> None:
    node = eks_node(hostname=None)
    load(node, other_node(), gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["affinity"] = {
        "nodeAffinity": {
            REQUIRED: {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]},
                    {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]},
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "x", "operator": "Exists"}]}}
            ],
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    body = review(vmi)
    patched = allowed_patch(post(client, body), body)
    assert HOSTNAME not in patched["spec"].get("nodeSelector", {})
    terms = patched["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    pin = {"key": "metadata.name", "operator": "In", "values": [EKS_NAME]}
    assert len(terms) == 2 and all(pin in t["matchFields"] for t in terms)  # merged into every term
    assert (
        terms[0]["matchExpressions"]
        == vmi["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"][0]["matchExpressions"]
    )
    # What else the VMI said is kept.
    assert patched["spec"]["affinity"]["podAntiAffinity"] == vmi["spec"]["affinity"]["podAntiAffinity"]
    assert patched["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    pod = launcher_for(patched)
    assert schedulable(pod, node) and not schedulable(pod, other_node())


@pytest.mark.django_db(transaction=True)
def test_a_vmi_pinned_to_another_hostname_is_denied_naming_both(client: Client) -> None:
    load(eks_node(), gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["nodeSelector"] = {HOSTNAME: "ip-10-0-0-1"}
    body = review(vmi)
    message = denied(post(client, body), body)
    assert f"{HOSTNAME}=ip-10-0-0-1" in message and EKS_NAME in message and f"{HOSTNAME}={EKS_HOSTNAME}" in message


@pytest.mark.django_db(transaction=True)
def test_a_vmi_pinning_the_same_hostname_itself_is_allowed(client: Client) -> None:
    node = eks_node()
    load(node, gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["nodeSelector"] = {HOSTNAME: EKS_HOSTNAME, "nvidia.com/gpu.present": "true"}
    body = review(vmi)
    patched = allowed_patch(post(client, body), body)
    assert patched["spec"]["nodeSelector"] == {HOSTNAME: EKS_HOSTNAME, "nvidia.com/gpu.present": "true"}
    assert schedulable(launcher_for(patched), node)


@pytest.mark.django_db(transaction=True)
def test_a_vmi_whose_own_node_selector_the_node_lacks_is_denied_naming_the_label(client: Client) -> None:
    load(eks_node(), gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["nodeSelector"] = {"topology.kubernetes.io/zone": "eu-west-1a"}
    body = review(vmi)
    message = denied(post(client, body), body)
    assert "topology.kubernetes.io/zone=eu-west-1a" in message and "no label topology.kubernetes.io/zone" in message


@pytest.mark.django_db(transaction=True)
def test_a_vmi_whose_required_affinity_excludes_the_node_is_denied_naming_the_requirement(client: Client) -> None:
    load(eks_node(), gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["affinity"] = {
        "nodeAffinity": {
            REQUIRED: {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "nvidia.com/gpu.workload.config", "operator": "NotIn", "values": ["vm-passthrough"]}
                        ]
                    }
                ]
            }
        }
    }
    body = review(vmi)
    message = denied(post(client, body), body)
    assert "nodeAffinity" in message and "nvidia.com/gpu.workload.config NotIn [vm-passthrough]" in message


@pytest.mark.django_db(transaction=True)
def test_a_malformed_node_affinity_is_a_400_naming_the_field(client: Client) -> None:
    load(eks_node(), gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=EKS_NAME))
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["affinity"] = {
        "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Near"}]}]}}
    }
    resp = post(client, review(vmi))
    assert resp.status_code == 400
    assert resp.json()["field"].endswith("nodeSelectorTerms[0].matchExpressions[0].operator")


# -- the pure decision ---------------------------------------------------------------------------


def _view(node: Node | None) -> MirrorView:
    return MirrorView(
        namespace="t1",
        devices=(Device("t1", "g0", "h100", "vm1", phase=Phase.BOUND, node=EKS_NAME),),
        classes=(GpuClass("h100", H100),),
        nodes=(node,) if node else (),
    )


def _decide(vmi: dict[str, Any], node: Node | None) -> admission.Verdict:
    return admission.decide(review(vmi), _view(node))


def test_the_pin_uses_the_label_and_a_node_missing_from_the_view_falls_back_to_the_name() -> None:
    labelled = Node(EKS_NAME, labels={HOSTNAME: EKS_HOSTNAME})
    verdict = _decide(new_vmi("t1", "vm1", ["g0"]), labelled)
    assert verdict.action is Action.PATCH
    assert {"op": "add", "path": "/spec/nodeSelector", "value": {HOSTNAME: EKS_HOSTNAME}} in verdict.patch
    unknown = _decide(new_vmi("t1", "vm1", ["g0"]), None)
    assert unknown.action is Action.PATCH
    patched = jsonpatch.apply_patch(new_vmi("t1", "vm1", ["g0"]), list(unknown.patch))
    assert patched["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [EKS_NAME]}]}
    ]


def test_an_unknown_node_with_the_vmis_own_selector_is_denied_as_retryable() -> None:
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["nodeSelector"] = {"a": "b"}
    verdict = _decide(vmi, None)
    assert verdict.action is Action.DENY and "try again" in verdict.message


@pytest.mark.parametrize(
    ("operator", "values", "label", "matches"),
    [
        ("In", ["a", "b"], "b", True),
        ("In", ["a"], None, False),
        ("NotIn", ["a"], None, True),
        ("NotIn", ["a"], "a", False),
        ("Exists", [], "", True),
        ("DoesNotExist", [], "x", False),
        ("Gt", ["7"], "8", True),
        ("Gt", ["7"], "7", False),
        ("Lt", ["7"], "x", False),
    ],
)
def test_node_selector_requirements_match_as_the_scheduler_does(
    operator: str, values: list[str], label: str | None, matches: bool
) -> None:
    expr = {"key": "k", "operator": operator, "values": values}
    node = Node("n1", labels={} if label is None else {"k": label})
    term = admission.Term(expressions=(admission.Requirement("k", operator, tuple(values)),))
    assert admission.term_matches(term, node) is matches
    node_obj_ = {"metadata": {"name": "n1", "labels": dict(node.labels)}}
    assert term_holds({"matchExpressions": [expr]}, node_obj_) is matches


def test_an_empty_required_term_list_matches_no_node() -> None:
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"]["affinity"] = {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": []}}}
    verdict = _decide(vmi, Node(EKS_NAME, labels={HOSTNAME: EKS_HOSTNAME}))
    assert verdict.action is Action.DENY and "no nodeSelectorTerms" in verdict.message


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"nodeSelector": ["a"]}, "request.object.spec.nodeSelector"),
        ({"nodeSelector": {"a": 1}}, "request.object.spec.nodeSelector['a']"),
        ({"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": {}}}}}, "nodeSelectorTerms"),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        REQUIRED: {
                            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "Exists"}]}]
                        }
                    }
                }
            },
            "matchFields[0].operator",
        ),
        ({"tolerations": {}}, "request.object.spec.tolerations"),
    ],
)
def test_malformed_scheduling_fields_are_review_errors_naming_them(spec: dict[str, Any], field: str) -> None:
    vmi = new_vmi("t1", "vm1", ["g0"])
    vmi["spec"].update(spec)
    with pytest.raises(ReviewError) as error:
        admission.parse_review(review(vmi))
    assert error.value.field.endswith(field)

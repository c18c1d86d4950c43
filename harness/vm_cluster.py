"""The VM cluster: the test control plane with the real writer of every field gpuplane reads.

The base control plane (``harness.controlplane``) serves objects the tests write whole,
statuses included. Here nothing a controller writes is written by a test:

- **kube-scheduler** binds pods to nodes (``spec.nodeName``), as user ``system:kube-scheduler``
  with the roles the apiserver bootstraps for it;
- **KubeVirt's virt-controller** (v1.8.2, built from the pinned ``kubevirt.io/kubevirt`` module by
  ``hack/kubevirt-bin.sh``) turns VirtualMachines into VMIs, makes each VMI's virt-launcher pod and
  writes the VMI's status, ``activePods`` included; it runs out of cluster under its own
  ServiceAccount (``kubevirt/kubevirt-controller``, a token from the TokenRequest API) with the RBAC
  KubeVirt generates for it, against every KubeVirt CRD and a KubeVirt object as virt-operator
  leaves them;
- **kwok** (``hack/kwok-bin.sh``) plays the kubelets: it keeps every node Ready (renewing its
  lease) with the allocatable it registered with, runs the pods bound to it, finishes deleting
  pods, and marks a node NotReady when the node carries kwok's own chaos label;
- **kube-controller-manager** adds the node lifecycle and taint-eviction controllers, so a
  NotReady node is tainted and its pods evicted as in a real cluster, and the cluster-role
  aggregation controller, so KubeVirt's ``kubevirt.io:edit`` joins the ``edit`` role tenants have.

One cluster per pytest-xdist worker, started by the first test that needs it; between tests
:meth:`VmCluster.reset` deletes what tests made, keeping KubeVirt's namespace, CRDs, RBAC and
KubeVirt object. gpuplane itself (:class:`Gpuplane`: the sync, the binder and the webhook server,
registered from deploy/, with deploy/'s launcher policy) starts per test, since each test has a
database of its own.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from harness import workers
from harness.controlplane import (
    ADMIN_USER,
    KEPT_NAMESPACES,
    UNION_USER,
    ApiError,
    ControlPlane,
    ControlPlaneError,
    Process,
    Profile,
    kubevirt_dir,
    kwok_dir,
    prefix_range,
    tool,
)
from harness.manifests import overlay, register_webhook
from harness.ports import free_port

SCHEDULER_USER = "system:kube-scheduler"
#: KubeVirt's controller identity, as in-cluster: its ServiceAccount in KubeVirt's namespace.
KUBEVIRT_NAMESPACE = "kubevirt"
KUBEVIRT_CONTROLLER = f"system:serviceaccount:{KUBEVIRT_NAMESPACE}:kubevirt-controller"
#: A tenant: a user bound per test to the ``edit`` role in its namespaces (KubeVirt's own
#: ``kubevirt.io:edit`` aggregates into it), as a platform gives a team.
TENANT_USER = "tenant"
#: The label kwok's node chaos stage (``node-not-ready``) reacts to.
NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
#: What every kwok node offers besides GPUs: what a virt-launcher pod asks of its node.
NODE_BASICS = {"cpu": "64", "memory": "512Gi", "ephemeral-storage": "1Ti", "pods": "110",
               "devices.kubevirt.io/kvm": "1k", "devices.kubevirt.io/tun": "1k",
               "devices.kubevirt.io/vhost-net": "1k"}  # fmt: skip
#: Seconds a pod tolerates a NotReady or unreachable node before the taint evicts it (the
#: DefaultTolerationSeconds admission plugin's default is 300).
TOLERATION_SECONDS = 2

PROFILE = Profile(
    controllers=(
        "namespace-controller",
        "garbage-collector-controller",
        "node-lifecycle-controller",
        "taint-eviction-controller",
        # Aggregates KubeVirt's kubevirt.io:edit into the edit role a tenant is bound to.
        "clusterrole-aggregation-controller",
    ),
    kubevirt=True,
    apiserver_flags=(
        f"--default-not-ready-toleration-seconds={TOLERATION_SECONDS}",
        f"--default-unreachable-toleration-seconds={TOLERATION_SECONDS}",
    ),
    controller_manager_flags=("--node-monitor-period=1s", "--node-monitor-grace-period=20s"),
    users=((SCHEDULER_USER, ()), (TENANT_USER, ())),
    reset_prefixes=(
        "/registry/gpuplane.io/",
        "/registry/kubevirt.io/virtualmachineinstances/",
        "/registry/kubevirt.io/virtualmachines/",
        "/registry/kubevirt.io/virtualmachineinstancemigrations/",
        "/registry/controllerrevisions/",
        "/registry/minions/",
        "/registry/pods/",
        "/registry/events/",
        "/registry/configmaps/",
        "/registry/leases/kube-node-lease/",
        "/registry/validatingadmissionpolicies/",
        "/registry/validatingadmissionpolicybindings/",
        "/registry/mutatingadmissionpolicies/",
        "/registry/mutatingadmissionpolicybindings/",
        "/registry/mutatingwebhookconfigurations/",
    ),
    kept_namespaces=KEPT_NAMESPACES | {KUBEVIRT_NAMESPACE},
)

VMS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"
VMIS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"
PODS = "/api/v1/namespaces/{ns}/pods"
GPUS = "/apis/gpuplane.io/v1alpha1/namespaces/{ns}/gpus"


class VmCluster:
    """The control plane, kube-scheduler, virt-controller and kwok (see the module's docstring)."""

    def __init__(self) -> None:
        self.plane = ControlPlane(profile=PROFILE)

    def start(self) -> VmCluster:
        plane = self.plane
        plane.start()
        kubevirt = kubevirt_dir()
        docs = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUBEVIRT_NAMESPACE}}]
        for name in ("virt-controller-rbac.yaml", "kubevirt-cluster-rbac.yaml"):
            docs += [d for d in yaml.safe_load_all((kubevirt / name).read_text()) if d]
        for doc in docs:
            plane.apply(_clean(doc))
        (cr,) = [d for d in yaml.safe_load_all((kubevirt / "kubevirt-cr.yaml").read_text()) if d]
        path = f"/apis/kubevirt.io/v1/namespaces/{KUBEVIRT_NAMESPACE}/kubevirts/kubevirt"
        plane.request("POST", path.rsplit("/", 1)[0], {k: v for k, v in _clean(cr).items() if k != "status"})
        plane.request("PATCH", path + "/status", {"status": cr["status"]})
        self._start_scheduler()
        self._start_virt_controller()
        self._start_kwok()
        return self

    def _start_scheduler(self) -> None:
        plane = self.plane
        plane.processes["kube-scheduler"] = Process(
            "kube-scheduler",
            [str(tool("kube-scheduler")), f"--kubeconfig={plane.kubeconfig(SCHEDULER_USER)}",
             "--leader-elect=false", "--secure-port=0", "-v=1"],
            plane.dir / "kube-scheduler.log",
        )  # fmt: skip
        plane.processes["kube-scheduler"].start()

    def _start_virt_controller(self) -> None:
        """virt-controller out of cluster as KubeVirt's controller ServiceAccount: a token the
        TokenRequest API issues for it (the ServiceAccount comes with KubeVirt's RBAC)."""
        plane = self.plane
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": 7 * 86400}}  # fmt: skip
        issued = plane.request(
            "POST", f"/api/v1/namespaces/{KUBEVIRT_NAMESPACE}/serviceaccounts/kubevirt-controller/token", request
        )
        kubeconfig = plane.dir / "kubeconfig-virt-controller"
        kubeconfig.write_text(yaml.safe_dump(_kubeconfig(plane, "kubevirt-controller", issued["status"]["token"])))
        kubeconfig.chmod(0o600)
        self.virt_controller_port = free_port()
        crt, key = plane.pki.serving("webhook")  # any pair: it serves its metrics and /leader with it
        plane.processes["virt-controller"] = Process(
            "virt-controller",
            [str(kubevirt_dir() / "virt-controller"), f"--kubeconfig={kubeconfig}",
             "--launcher-image=virt-launcher:test", "--exporter-image=virt-exportserver:test",
             f"--prom-cert-file={crt}", f"--prom-key-file={key}",
             "--listen=127.0.0.1", f"--port={self.virt_controller_port}"],
            plane.dir / "virt-controller.log",
            env={"POD_NAMESPACE": KUBEVIRT_NAMESPACE},  # where virt-controller looks for KubeVirt's object
        )  # fmt: skip
        plane.processes["virt-controller"].start()
        plane._wait("virt-controller", self._virt_controller_leads, timeout=120)

    def _virt_controller_leads(self) -> bool:
        import ssl
        import urllib.request

        context = ssl._create_unverified_context()  # noqa: S323 - loopback, its own throwaway pair
        url = f"https://127.0.0.1:{self.virt_controller_port}/leader"
        with urllib.request.urlopen(url, timeout=2, context=context) as answer:
            return bool(answer.status == 200)

    def _start_kwok(self) -> None:
        plane = self.plane
        stages = kwok_dir() / "stages.yaml"
        plane.processes["kwok"] = Process(
            "kwok",
            [str(kwok_dir() / "kwok"), f"--kubeconfig={plane.kubeconfig(ADMIN_USER)}", f"--config={stages}",
             "--manage-all-nodes=true", f"--server-address=127.0.0.1:{free_port()}",
             "--node-lease-duration-seconds=40", "--cidr=10.244.0.0/16", "--node-ip=10.0.0.2"],
            plane.dir / "kwok.log",
        )  # fmt: skip
        plane.processes["kwok"].start()

    # -- between tests --------------------------------------------------------------------------

    def reset(self) -> None:
        """The control plane's reset, and the tenants' role bindings (KubeVirt's in its own
        namespace stay: virt-controller keeps its leader lease through them)."""
        self.plane.reset()
        listed = self.plane.etcd("kv/range", {**prefix_range("/registry/rolebindings/"), "keys_only": True})
        for item in listed.get("kvs", []):
            namespace = base64.b64decode(item["key"]).decode().split("/")[3]
            if namespace not in PROFILE.kept_namespaces:
                self.plane.etcd("kv/deleterange", {"key": item["key"]})

    def stop(self) -> None:
        for name in ("kwok", "virt-controller", "kube-scheduler"):
            if name in self.plane.processes:
                self.plane.processes[name].stop()
        self.plane.stop()

    def check_running(self) -> None:
        """Each process still running, else a clear error with the end of its log."""
        for name, process in self.plane.processes.items():
            if not process.running():
                raise ControlPlaneError(f"{name} of the VM cluster exited; its log ends:\n{process.tail()}")

    # -- what users and operators do --------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.plane.request(method, path, body, **kwargs)

    def add_node(self, name: str, gpus: dict[str, int], *, hostname: str | None = None,
                 labels: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """A node as a kubelet registers it (kwok then keeps it Ready): its GPUs in capacity and
        allocatable as the device plugin reports them, and ``kubevirt.io/schedulable`` as
        virt-handler labels a node it runs on (virt-controller asks for it)."""
        resources = {**NODE_BASICS, **{resource: str(count) for resource, count in gpus.items()}}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": hostname or name,
                    "kubernetes.io/os": "linux",
                    "kubevirt.io/schedulable": "true",
                    "type": "kwok",
                    **(labels or {}),
                },  # fmt: skip
                "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
            },
            "spec": {},
            "status": {"capacity": dict(resources), "allocatable": dict(resources)},
        }
        return dict(self.request("POST", "/api/v1/nodes", node))

    def wait_nodes_ready(self, *names: str, timeout: float = 60) -> None:
        """Until kwok reports each node Ready and the node lifecycle controller has lifted the
        not-ready taint (kube-scheduler places nothing on a node that still carries it)."""

        def ready(name: str) -> bool:
            node = self.request("GET", f"/api/v1/nodes/{name}")
            conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            taints = [t["key"] for t in node.get("spec", {}).get("taints") or []]
            return conditions.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints

        wait_for(lambda: all(ready(n) for n in names), timeout, f"nodes {names} Ready and untainted")

    def tenant_namespace(self, name: str) -> None:
        """A tenant's namespace, its user bound to ``edit`` there."""
        self.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": name}})  # fmt: skip
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "tenant-edit", "namespace": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT_USER}],
        }
        self.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{name}/rolebindings", binding)

    def vm(self, namespace: str, name: str, devices: list[str], *, running: bool = True,
           node_selector: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """A VirtualMachine as a tenant creates it: its template names the GPU devices."""
        vm = virtual_machine(namespace, name, devices, running=running, node_selector=node_selector)
        return dict(self.request("POST", VMS.format(ns=namespace), vm, identity=TENANT_USER))

    def set_running(self, namespace: str, name: str, running: bool) -> None:
        """``virtctl start`` / ``stop`` as a declarative client does it: the VM's runStrategy."""
        strategy = "Always" if running else "Halted"
        self.request("PATCH", f"{VMS.format(ns=namespace)}/{name}", {"spec": {"runStrategy": strategy}},
                     identity=TENANT_USER)  # fmt: skip

    def vmi(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.request("GET", f"{VMIS.format(ns=namespace)}/{name}"))
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def launchers(self, namespace: str, vmi: str) -> list[dict[str, Any]]:
        """The pods virt-controller made for ``vmi`` (KubeVirt's ``kubevirt.io/created-by`` label
        names the VMI's uid, so look the VMI up first)."""
        pods = self.request("GET", PODS.format(ns=namespace) + "?labelSelector=kubevirt.io%3Dvirt-launcher")["items"]
        return [p for p in pods if any(r.get("kind") == "VirtualMachineInstance" and r.get("name") == vmi
                                       for r in p["metadata"].get("ownerReferences") or [])]  # fmt: skip

    def running_launcher(self, namespace: str, vmi: str, timeout: float = 60) -> dict[str, Any]:
        """Until the VMI's launcher runs and the VMI lists it in ``activePods``; the pod."""
        found: dict[str, Any] = {}

        def running() -> bool:
            current = self.vmi(namespace, vmi)
            active = (current or {}).get("status", {}).get("activePods") or {}
            for pod in self.launchers(namespace, vmi):
                if pod["status"].get("phase") == "Running" and pod["metadata"]["uid"] in active:
                    found.update(pod)
                    return True
            return False

        wait_for(running, timeout, f"the launcher of {namespace}/{vmi} Running and listed in activePods",
                 detail=lambda: self.describe(namespace))  # fmt: skip
        return found

    def gpus(self, namespace: str) -> dict[str, dict[str, Any]]:
        return {g["metadata"]["name"]: g for g in self.request("GET", GPUS.format(ns=namespace))["items"]}

    def order(self, namespace: str, vm: str, count: int, class_name: str = "h100") -> list[str]:
        """``count`` GPUs of ``class_name`` for ``vm`` (``<vm>-gpu<i>``), created one by one as
        their owner creates them; their names."""
        names = [f"{vm}-gpu{i}" for i in range(count)]
        for name in names:
            self.request("POST", GPUS.format(ns=namespace), gpu_object(namespace, name, vm, class_name))
        return names

    def placement(self, namespace: str, names: list[str]) -> set[tuple[str, str]]:
        """Each named GPU's (phase, node) as the API holds it."""
        gpus = self.gpus(namespace)
        return {((gpus[n].get("status") or {}).get("phase", ""), (gpus[n].get("status") or {}).get("node", ""))
                for n in names}  # fmt: skip

    def describe(self, namespace: str) -> str:
        """What a test prints when a wait fails: the namespace's VMIs, pods and GPUs, briefly."""
        lines = []
        for vmi in self.request("GET", VMIS.format(ns=namespace))["items"]:
            status, spec = vmi.get("status", {}), vmi["spec"]
            lines.append(
                f"VMI {vmi['metadata']['name']}: phase={status.get('phase')} node={status.get('nodeName')} "
                f"activePods={status.get('activePods')} nodeSelector={spec.get('nodeSelector')} "
                f"affinity={spec.get('affinity')}"
            )
        for pod in self.request("GET", PODS.format(ns=namespace))["items"]:
            conditions = {c["type"]: c.get("message") or c["status"] for c in pod["status"].get("conditions", [])}
            spec = pod["spec"]
            lines.append(
                f"pod {pod['metadata']['name']}: phase={pod['status'].get('phase')} node={spec.get('nodeName')} "
                f"conditions={conditions} nodeSelector={spec.get('nodeSelector')} affinity={spec.get('affinity')}"
            )
        for name, gpu in sorted(self.gpus(namespace).items()):
            status = gpu.get("status") or {}
            notes = {
                k: v for k, v in (gpu["metadata"].get("annotations") or {}).items() if k.startswith("gpuplane.io/")
            }
            lines.append(f"GPU {name}: {status.get('phase')} on {status.get('node')}: {status.get('reason')} {notes}")
        return "\n".join(lines)

    def install_policies(self) -> None:
        """deploy/'s admission policies as deployed: the launcher policy (a ValidatingAdmissionPolicy),
        the pin and finalizer policies (MutatingAdmissionPolicies), each with its binding; waits
        until a tenant's dry-run pod naming a VMI as controller is refused."""
        for doc in admission_policies():
            self.plane.apply(doc)
        wait_for(lambda: not self._forged_pod_accepted(), 30, "the launcher policy in force")

    def remove_launcher_policy(self) -> None:
        for doc in reversed([d for d in admission_policies() if d["kind"].startswith("Validating")]):
            with contextlib.suppress(ApiError):
                self.request("DELETE", _policy_path(doc))
        wait_for(self._forged_pod_accepted, 30, "the launcher policy gone")

    def _forged_pod_accepted(self) -> bool:
        probe = forged_launcher("default", "policy-probe", "probe", "00000000-0000-0000-0000-000000000000", {})
        try:
            self.request("POST", PODS.format(ns="default") + "?dryRun=All", probe)
        except ApiError as exc:
            if exc.code == 403:
                return False
            raise
        return True


def admission_policies() -> list[dict[str, Any]]:
    """deploy/'s admission policies and their bindings (cluster-scoped: no namespace)."""
    docs = [d for d in overlay("cluster") if "AdmissionPolicy" in d["kind"]]
    for doc in docs:
        doc["metadata"].pop("namespace", None)
    return docs


_POLICY_PLURALS = {
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
    "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
}


def _policy_path(doc: dict[str, Any]) -> str:
    return f"/apis/admissionregistration.k8s.io/v1/{_POLICY_PLURALS[doc['kind']]}/{doc['metadata']['name']}"


def _clean(doc: dict[str, Any]) -> dict[str, Any]:
    """A generated object without the fields a server sets (creationTimestamp: null)."""
    meta = {k: v for k, v in doc.get("metadata", {}).items() if v is not None and k != "creationTimestamp"}
    return {**doc, "metadata": meta}


def _kubeconfig(plane: ControlPlane, user: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": plane.url, "certificate-authority": str(plane.pki.ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    }


def virtual_machine(namespace: str, name: str, devices: list[str], *, running: bool = True,
                    node_selector: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """A VirtualMachine whose VMI names ``devices`` (gpuplane's device names): a container disk
    and no network, the smallest VM virt-controller renders a launcher for."""
    spec: dict[str, Any] = {
        "domain": {
            "devices": {
                "gpus": [{"name": f"gpu{i}", "deviceName": f"gpuplane.io/{d}"} for i, d in enumerate(devices)],
                "disks": [{"name": "root", "disk": {"bus": "virtio"}}],
            },
            "resources": {"requests": {"memory": "1Gi", "cpu": "1"}},
        },
        "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora:42"}}],
        "terminationGracePeriodSeconds": 0,
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runStrategy": "Always" if running else "Halted",
            "template": {"metadata": {"labels": {"kubevirt.io/vm": name}}, "spec": spec},
        },
    }


def gpu_object(namespace: str, name: str, vm: str, class_name: str = "h100") -> dict[str, Any]:
    """A GPU as its owner orders it: a class and the VM it belongs to."""
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GPU", "metadata": {"name": name, "namespace": namespace},
            "spec": {"className": class_name, "vmName": vm}}  # fmt: skip


def forged_launcher(namespace: str, name: str, vmi: str, vmi_uid: str, requests: dict[str, int]) -> dict[str, Any]:
    """A tenant's pod dressed as ``vmi``'s launcher: KubeVirt's label and a controller owner
    reference naming the VMI (its uid copied from the VMI the tenant may read)."""
    limits = {resource: str(count) for resource, count in requests.items()}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": vmi_uid},
            "ownerReferences": [
                {
                    "apiVersion": "kubevirt.io/v1",
                    "kind": "VirtualMachineInstance",
                    "name": vmi,
                    "uid": vmi_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],  # fmt: skip
        },
        "spec": {
            "containers": [
                {"name": "work", "image": "trainer:1", "resources": {"limits": limits, "requests": dict(limits)}}
            ]
        },  # fmt: skip
    }


def raw_pod(namespace: str, name: str, requests: dict[str, int], node_selector: dict[str, str] | None = None) -> dict:
    """A plain pod asking GPUs of kube-scheduler by their raw resource names."""
    limits = {resource: str(count) for resource, count in requests.items()}
    spec: dict[str, Any] = {"containers": [{"name": "work", "image": "trainer:1",
                                            "resources": {"limits": limits, "requests": dict(limits)}}]}  # fmt: skip
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "",
             detail: Callable[[], str] | None = None) -> None:  # fmt: skip
    """Until ``condition()`` holds; an AssertionError naming ``what`` (and ``detail()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{detail()}" if detail else ""))


# -- gpuplane as deployed ---------------------------------------------------------------------------


class Gpuplane:
    """gpuplane's processes as deployed, against one VM cluster and the test's database.

    On PostgreSQL: ``sync_cluster``, a ``celery worker`` on the binder queue and ``celery beat``
    (the periodic resync), each under its own identity, and the webhook server; on SQLite the
    embedded topology: no broker, so full passes run in the sync's process and answer passes in
    the webhook server's, under one identity holding deploy/'s grants together. The webhook is
    registered from deploy/ (TLS, the apiserver's token) and deploy/'s launcher policy installed.
    """

    def __init__(self, cluster: VmCluster, workdir: Path, **settings: str) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.settings = settings
        self.stack = contextlib.ExitStack()
        self.embedded = workers.database_url().startswith("sqlite")

    def env(self, identity: str) -> dict[str, str]:
        plane = self.cluster.plane
        env = {
            **os.environ,
            "DATABASE_URL": workers.database_url(),
            "GPUPLANE_VAR_DIR": str(self.workdir),
            "GPUPLANE_CLUSTER": "kubernetes",
            "GPUPLANE_AUTO_PASS": "true",
            "GPUPLANE_CHECKPOINTS": "false",
            "GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS": "0.2",
            "GPUPLANE_WATCH_SECONDS": "600",
            "GPUPLANE_RESYNC_SECONDS": "1",
            "KUBECONFIG": str(plane.kubeconfig(UNION_USER if self.embedded else identity)),
            **self.settings,
        }
        for name in ("GPUPLANE_KUBE_HOST", "CELERY_BROKER_URL", "POD_NAMESPACE"):
            env.pop(name, None)
        if not self.embedded:
            env.update(CELERY_BROKER_URL=workers.REDIS_URL, GPUPLANE_BROKER_KEY_PREFIX=workers.PREFIX)
        return env

    def start(self) -> Gpuplane:
        plane = self.cluster.plane
        try:
            self._process("sync", [sys.executable, "manage.py", "sync_cluster", "--no-progress"], "gpuplane-sync")
            if not self.embedded:
                self._process("worker", [sys.executable, "-m", "celery", "-A", "gpuplane", "worker", "-Q", "binder",
                                         "--pool", "solo", "-n", "vm-cluster@%h", "--without-gossip",
                                         "--without-mingle", "--without-heartbeat", "-l", "info"],
                              "gpuplane-binder")  # fmt: skip
                self._process("beat", [sys.executable, "-m", "celery", "-A", "gpuplane", "beat", "-l", "info",
                                       "-s", str(self.workdir / "beat-schedule")], "gpuplane-binder")  # fmt: skip
            crt, key = plane.pki.serving("webhook")
            env = self.env("gpuplane-webhook") | {
                "GPUPLANE_TLS_CERT_FILE": str(crt),
                "GPUPLANE_TLS_KEY_FILE": str(key),
                "GPUPLANE_WEBHOOK_AUTH": "token",
                "GPUPLANE_WEBHOOK_TOKEN_FILE": str(plane.dir / "webhook-token"),
            }
            self.url = self.stack.enter_context(
                workers.webhook_server(env, self.workdir, scheme="https", probe_http=False)
            )
            register_webhook(plane, self.url)
            self.cluster.install_policies()
        except BaseException:
            self.stop()
            raise
        return self

    def _process(self, name: str, argv: list[str], identity: str) -> None:
        log = (self.workdir / f"{name}.log").open("w")
        process = subprocess.Popen(argv, cwd=workers.ROOT, env=self.env(identity), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

        def stop() -> None:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait(10)
            log.close()

        self.stack.callback(stop)

    def resync(self) -> None:
        """The periodic full pass a deployment's ``celery beat`` sends: on PostgreSQL beat runs
        (every second here); the embedded topology has no beat, so the test process runs it."""
        if self.embedded:
            from binder.runtime.passes import run_pass

            run_pass("full")

    def until(self, condition: Callable[[], bool], what: str, timeout: float,
              detail: Callable[[], str] | None = None) -> None:  # fmt: skip
        """Until ``condition()`` holds, running the periodic full pass a deployment runs
        (:meth:`resync`) at most once a second while waiting."""
        last = [0.0]

        def resynced() -> bool:
            if time.monotonic() - last[0] > 1:
                last[0] = time.monotonic()
                self.resync()
            return bool(condition())

        wait_for(resynced, timeout, what, detail=detail)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        self.stack.close()


def pod_path(namespace: str, name: str = "") -> str:
    return PODS.format(ns=namespace) + (f"/{urllib.parse.quote(name)}" if name else "")


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)

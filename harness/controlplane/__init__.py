"""A real Kubernetes control plane for the cluster-mode tests and the benches: etcd,
kube-apiserver and kube-controller-manager, the upstream binaries built from pinned Go modules
(``hack/kube-bin.sh``), as controller-runtime's envtest runs them, and split as envtest splits
its own:

- :mod:`~harness.controlplane.processes`: where the binaries are, and each one as a process
  with its log;
- :mod:`~harness.controlplane.certificates`: a CA of the session's own, the serving and client
  certificates, the ServiceAccount key pair;
- :mod:`~harness.controlplane.etcd`: **etcd** with its data in ``/dev/shm`` and
  ``--unsafe-no-fsync`` (nothing here must survive a crash), on two free loopback ports;
- :mod:`~harness.controlplane.apiserver`: **kube-apiserver** with RBAC on, its own CA and
  serving certificate, a token file with one token per identity (the test's admin in
  ``system:masters``, each ServiceAccount ``deploy/`` gives gpuplane's processes, and
  ``gpuplane-test``: the union of those roles, for tests that run every process in this one),
  the ``ServiceAccount`` admission plugin off (as envtest does: no token controller runs), and
  the requests a test makes;
- :mod:`~harness.controlplane.audit`: the apiserver's audit log of every resource request (what a
  test asks "which calls did gpuplane make" of);
- :mod:`~harness.controlplane.objects`: the CRDs, namespace and RBAC every control plane serves,
  server-side apply, seeding objects with their status, switching a CRD's rules or deploy/'s
  finalizer policy for a block;
- :mod:`~harness.controlplane.plane`: :class:`ControlPlane`, all of them started together with
  **kube-controller-manager** (only the namespace and garbage-collector controllers, so
  deleting a namespace really goes through the namespace controller and owner references
  really are acted on), reset between tests, and the faults a test causes.

The names below are what the tests and the benches import.
"""

from harness.controlplane.apiserver import ADMIN_USER, IDENTITIES, SYSTEM_NAMESPACE, UNION_USER, ApiError, ApiServer
from harness.controlplane.audit import Call
from harness.controlplane.certificates import Pki
from harness.controlplane.etcd import prefix_range
from harness.controlplane.objects import SERVER_SET
from harness.controlplane.plane import BASE, KEPT_NAMESPACES, ControlPlane, Profile
from harness.controlplane.processes import ControlPlaneError, Process, kubevirt_dir, kwok_dir, tool

__all__ = [
    "ADMIN_USER",
    "BASE",
    "IDENTITIES",
    "KEPT_NAMESPACES",
    "SERVER_SET",
    "SYSTEM_NAMESPACE",
    "UNION_USER",
    "ApiError",
    "ApiServer",
    "Call",
    "ControlPlane",
    "ControlPlaneError",
    "Pki",
    "Process",
    "Profile",
    "kubevirt_dir",
    "kwok_dir",
    "prefix_range",
    "tool",
]

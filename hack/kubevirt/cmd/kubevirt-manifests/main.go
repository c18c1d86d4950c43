// Command kubevirt-manifests writes, into the directory it is given, what virt-operator would have
// installed before virt-controller starts, each built by the function virt-operator calls:
//
//   - virtualmachineinstances.kubevirt.io.yaml: the VirtualMachineInstance CRD alone
//     (components.NewVirtualMachineInstanceCrd), which the base test control plane installs;
//   - crds.yaml: every KubeVirt CRD (all of components.New*Crd), for the test cluster that runs
//     virt-controller (its informers wait for each of them);
//   - virt-controller-rbac.yaml: virt-controller's ServiceAccount, Role, ClusterRole and bindings
//     (rbac.GetAllController), so it runs with exactly the rights KubeVirt gives it;
//   - kubevirt-cluster-rbac.yaml: KubeVirt's cluster roles (rbac.GetAllCluster), among them
//     kubevirt.io:edit, which aggregates into the edit role a tenant is given;
//   - kubevirt-cr.yaml: the KubeVirt object, with the status virt-operator leaves once every
//     component is ready (phase Deployed, its Created and Available conditions): virt-controller
//     reads its configuration only from a KubeVirt object that has a phase.
//
// Nothing here is written by hand: a newer KubeVirt changes these files by changing go.sum.
package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	extv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	virtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/rbac"
	operatorutil "kubevirt.io/kubevirt/pkg/virt-operator/util"
	"sigs.k8s.io/yaml"
)

// The namespace KubeVirt is installed in (virt-operator's default).
const namespace = "kubevirt"

func main() {
	if len(os.Args) != 2 {
		fail(fmt.Errorf("usage: kubevirt-manifests DIR"))
	}
	dir := os.Args[1]
	makers := []func() (*extv1.CustomResourceDefinition, error){
		components.NewVirtualMachineInstanceCrd,
		components.NewVirtualMachineCrd,
		components.NewPresetCrd,
		components.NewReplicaSetCrd,
		components.NewVirtualMachineInstanceMigrationCrd,
		components.NewKubeVirtCrd,
		components.NewVirtualMachinePoolCrd,
		components.NewVirtualMachineSnapshotCrd,
		components.NewVirtualMachineSnapshotContentCrd,
		components.NewVirtualMachineRestoreCrd,
		components.NewVirtualMachineExportCrd,
		components.NewVirtualMachineBackupCrd,
		components.NewVirtualMachineBackupTrackerCrd,
		components.NewVirtualMachineInstancetypeCrd,
		components.NewVirtualMachineClusterInstancetypeCrd,
		components.NewVirtualMachinePreferenceCrd,
		components.NewVirtualMachineClusterPreferenceCrd,
		components.NewMigrationPolicyCrd,
		components.NewVirtualMachineCloneCrd,
	}
	var crds []runtime.Object
	for i, make := range makers {
		crd, err := make()
		if err != nil {
			fail(err)
		}
		if i == 0 {
			write(filepath.Join(dir, "virtualmachineinstances.kubevirt.io.yaml"), crd)
		}
		crds = append(crds, crd)
	}
	write(filepath.Join(dir, "crds.yaml"), crds...)
	write(filepath.Join(dir, "virt-controller-rbac.yaml"), rbac.GetAllController(namespace, false)...)
	write(filepath.Join(dir, "kubevirt-cluster-rbac.yaml"), rbac.GetAllCluster()...)
	write(filepath.Join(dir, "kubevirt-cr.yaml"), deployedKubeVirt())
}

// deployedKubeVirt is the KubeVirt object as virt-operator leaves it once its components are
// ready: the defaults KubeVirt's own resource generator writes (tools/resource-generator's
// newKubeVirtCR), then the status virt-operator's KubeVirt controller sets (phase Deployed and
// the conditions of util.UpdateConditionsCreated and util.UpdateConditionsAvailable).
func deployedKubeVirt() *virtv1.KubeVirt {
	replicas := uint8(1)
	kv := &virtv1.KubeVirt{
		TypeMeta:   metav1.TypeMeta{APIVersion: virtv1.GroupVersion.String(), Kind: "KubeVirt"},
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: "kubevirt"},
		Spec: virtv1.KubeVirtSpec{
			ImagePullPolicy: "IfNotPresent",
			Configuration: virtv1.KubeVirtConfiguration{
				ImagePullPolicy: "IfNotPresent",
				Hypervisors:     []virtv1.HypervisorConfiguration{{Name: virtv1.KvmHypervisorName}},
			},
			Infra: &virtv1.ComponentConfig{Replicas: &replicas},
		},
	}
	operatorutil.UpdateConditionsCreated(kv)
	kv.Status.Phase = virtv1.KubeVirtPhaseDeployed
	operatorutil.UpdateConditionsAvailable(kv)
	return kv
}

func write(path string, objects ...runtime.Object) {
	var out bytes.Buffer
	for _, obj := range objects {
		data, err := yaml.Marshal(obj)
		if err != nil {
			fail(err)
		}
		out.WriteString("---\n")
		out.Write(data)
	}
	if err := os.WriteFile(path, out.Bytes(), 0o644); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kubevirt-manifests:", err)
	os.Exit(1)
}

// Command kubevirt-crds prints KubeVirt's VirtualMachineInstance CustomResourceDefinition as YAML,
// built by the same function virt-operator calls when it installs KubeVirt
// (components.NewVirtualMachineInstanceCrd, with the OpenAPI validation KubeVirt generates from its
// API types). The test control plane installs this output, so the VMIs our tests create, and the
// webhook's JSONPatch applied to them, are validated by KubeVirt's own schema.
package main

import (
	"fmt"
	"os"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"sigs.k8s.io/yaml"
)

func main() {
	crd, err := components.NewVirtualMachineInstanceCrd()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubevirt-crds:", err)
		os.Exit(1)
	}
	out, err := yaml.Marshal(crd)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubevirt-crds:", err)
		os.Exit(1)
	}
	if _, err := os.Stdout.Write(out); err != nil {
		fmt.Fprintln(os.Stderr, "kubevirt-crds:", err)
		os.Exit(1)
	}
}

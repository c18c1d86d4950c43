// Command virt-controller is KubeVirt's virt-controller, built from the pinned kubevirt.io/kubevirt
// module exactly as KubeVirt's own cmd/virt-controller builds it (a main calling watch.Execute). The
// test cluster runs it out of cluster against the test kube-apiserver, under KubeVirt's own
// ServiceAccount and RBAC, so the fields it writes (a VMI's status.activePods, its phase and node,
// the launcher pods it creates) are written by KubeVirt, never by a test.
package main

import (
	"kubevirt.io/kubevirt/pkg/virt-controller/watch"
)

func main() {
	watch.Execute()
}

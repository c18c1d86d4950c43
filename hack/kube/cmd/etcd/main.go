// Command etcd is upstream etcd's server, built from the version k8s.io/kubernetes pins,
// so the test control plane runs the etcd that release was tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }

#!/usr/bin/env bash
# Writes KubeVirt's VirtualMachineInstance CRD, as virt-operator installs it, from the pinned
# kubevirt.io/kubevirt module in hack/kubevirt, into a cache outside the repository keyed by that
# module's go.sum hash. Does nothing when it is there.
#
#   hack/kubevirt-crd.sh        build and run the generator if the CRD is missing; print its path
#   GPUPLANE_KUBE_CACHE=DIR     the cache's parent (default ~/.cache/gpuplane/kube-bin); the CRD goes
#                               beside the binaries' directories, under kubevirt-<key>/
#
# A module of its own (not one more tool in hack/kube's single build): KubeVirt builds against
# Kubernetes' v0.34 libraries, which cannot share a build with v1.37. Progress goes to stderr; the
# last line on stdout is the CRD's path.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
module="$here/kubevirt"
KUBEVIRT_VERSION="v1.8.2"  # kubevirt.io/kubevirt, as pinned in hack/kubevirt/go.mod

key="$(sha256sum "$module/go.sum" | cut -c1-16)"
cache="${GPUPLANE_KUBE_CACHE:-$HOME/.cache/gpuplane/kube-bin}/kubevirt-$key"
crd="$cache/virtualmachineinstances.kubevirt.io.yaml"
if [ -s "$crd" ]; then
  echo "$crd"
  exit 0
fi

# shellcheck source=hack/go-env.sh
. "$here/go-env.sh"
need_go "kubevirt-crd: the cluster tests need KubeVirt's VMI CRD, generated from kubevirt.io/kubevirt ${KUBEVIRT_VERSION}: install Go >= 1.26 (https://go.dev/doc/install)"
started=$(date +%s)
echo "kubevirt-crd: generating the VirtualMachineInstance CRD of kubevirt.io/kubevirt ${KUBEVIRT_VERSION} into $cache" >&2
cd "$module"
go mod download
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
go build -trimpath -ldflags "-s -w" -o "$tmp/" ./cmd/kubevirt-crds
"$tmp/kubevirt-crds" > "$tmp/crd.yaml"
grep -q '^  name: virtualmachineinstances.kubevirt.io$' "$tmp/crd.yaml" || {
  echo "kubevirt-crd: the generator's output names no virtualmachineinstances.kubevirt.io CRD" >&2
  exit 1
}
mkdir -p "$cache"
mv "$tmp/crd.yaml" "$crd"
echo "kubevirt-crd: generated in $(( $(date +%s) - started )) s: $crd ($(wc -c < "$crd") bytes)" >&2
echo "$crd"

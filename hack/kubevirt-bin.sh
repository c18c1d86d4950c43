#!/usr/bin/env bash
# Builds KubeVirt's virt-controller and the manifests virt-operator would install before it (every
# KubeVirt CRD, virt-controller's RBAC, the KubeVirt object as virt-operator leaves it) from the
# pinned kubevirt.io/kubevirt module in hack/kubevirt, into a cache outside the repository keyed
# by the hash of that module's go.sum and commands. Does nothing when they are there.
#
#   hack/kubevirt-bin.sh        build if missing; print the directory holding them
#   GPUPLANE_KUBE_CACHE=DIR     the cache's parent (default ~/.cache/gpuplane/kube-bin); the files go
#                               beside the control plane's, under kubevirt-<key>/
#
# A module of its own (not one more tool in hack/kube's single build): KubeVirt builds against
# Kubernetes' v0.34 libraries, which cannot share a build with v1.37. Progress goes to stderr; the
# last line on stdout is the cache directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
module="$here/kubevirt"
KUBEVIRT_VERSION="v1.8.2"  # kubevirt.io/kubevirt, as pinned in hack/kubevirt/go.mod
FILES=(virt-controller virtualmachineinstances.kubevirt.io.yaml crds.yaml virt-controller-rbac.yaml kubevirt-cluster-rbac.yaml kubevirt-cr.yaml)

# go.sum pins what is built; the commands' own source (the generator) changes the output too.
key="$(cat "$module/go.sum" "$module"/cmd/*/main.go | sha256sum | cut -c1-16)"
cache="${GPUPLANE_KUBE_CACHE:-$HOME/.cache/gpuplane/kube-bin}/kubevirt-$key"
built() {
  local file
  for file in "${FILES[@]}"; do [ -s "$cache/$file" ] || return 1; done
}
if built; then
  echo "$cache"
  exit 0
fi

# shellcheck source=hack/go-env.sh
. "$here/go-env.sh"
need_go "kubevirt-bin: the cluster tests need KubeVirt's CRDs and virt-controller, built from kubevirt.io/kubevirt ${KUBEVIRT_VERSION}: install Go >= 1.26 (https://go.dev/doc/install)"
one_builder "$cache"
if built; then  # built by the caller we waited for
  echo "$cache"
  exit 0
fi
started=$(date +%s)
echo "kubevirt-bin: building virt-controller and KubeVirt's manifests of kubevirt.io/kubevirt ${KUBEVIRT_VERSION} into $cache" >&2
cd "$module"
go mod download
mkdir -p "${cache%/*}"
tmp="$(mktemp -d "${cache%/*}/.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# KubeVirt's own version stamps (hack/version.sh), so virt-controller logs the pinned release.
ldflags="-s -w -X 'kubevirt.io/client-go/version.gitVersion=${KUBEVIRT_VERSION}' -X 'kubevirt.io/client-go/version.gitTreeState=clean'"
go build -trimpath -ldflags "$ldflags" -o "$tmp/" ./cmd/virt-controller ./cmd/kubevirt-manifests
"$tmp/kubevirt-manifests" "$tmp"
rm "$tmp/kubevirt-manifests"
grep -q '^  name: virtualmachineinstances.kubevirt.io$' "$tmp/virtualmachineinstances.kubevirt.io.yaml" || {
  echo "kubevirt-bin: the generator's output names no virtualmachineinstances.kubevirt.io CRD" >&2
  exit 1
}
rm -rf "$cache"
mv "$tmp" "$cache"
trap - EXIT
echo "kubevirt-bin: built in $(( $(date +%s) - started )) s; $(du -sh "$cache" | cut -f1) in $cache" >&2
echo "$cache"

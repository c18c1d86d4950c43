#!/usr/bin/env bash
# Builds the test control plane's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) and the chart's tools (helm, promtool) from the Go module in hack/kube,
# pinned by its committed go.sum, into a cache outside the repository keyed by go.sum's hash.
# Does nothing when they are there.
#
#   hack/kube-bin.sh          build if missing; print the directory holding the binaries
#   KUBEBUILDER_ASSETS=DIR    envtest's convention: binaries found there are used as they are,
#                             and only the ones missing there are built
#   GPUPLANE_KUBE_CACHE=DIR   where the cache lives (default ~/.cache/gpuplane/kube-bin)
#
# Progress goes to stderr; the last line on stdout is the cache directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
module="$here/kube"
KUBE_VERSION="v1.37.2"
HELM_VERSION="v4.3.2"        # helm.sh/helm/v4, as pinned in go.mod
PROMETHEUS_MODULE="v0.316.0"  # github.com/prometheus/prometheus, as pinned in go.mod: Prometheus 3.16.0
PROMETHEUS_VERSION="3.16.0"
TOOLS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm promtool)

key="$(sha256sum "$module/go.sum" | cut -c1-16)"
cache="${GPUPLANE_KUBE_CACHE:-$HOME/.cache/gpuplane/kube-bin}/$key"

have_all() {
  local dir="$1"; shift
  local tool
  for tool in "$@"; do [ -x "$dir/$tool" ] || return 1; done
}

if [ -n "${KUBEBUILDER_ASSETS:-}" ] && have_all "$KUBEBUILDER_ASSETS" "${TOOLS[@]}"; then
  echo "kube-bin: using KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS" >&2
  echo "$KUBEBUILDER_ASSETS"
  exit 0
fi
if have_all "$cache" "${TOOLS[@]}"; then
  echo "$cache"
  exit 0
fi

# shellcheck source=hack/go-env.sh
. "$here/go-env.sh"
need_go "kube-bin: the cluster tests need etcd and kube-apiserver: install Go >= 1.26 (https://go.dev/doc/install) or point KUBEBUILDER_ASSETS at envtest's binaries (setup-envtest use 1.37.x)"
one_builder "$cache"
if have_all "$cache" "${TOOLS[@]}"; then  # built by the caller we waited for
  echo "$cache"
  exit 0
fi
started=$(date +%s)
echo "kube-bin: building ${TOOLS[*]} ${KUBE_VERSION} with $(go version | cut -d' ' -f3) into $cache" >&2
echo "kube-bin: (a cold build takes several minutes on 2 cores: module download, then compile; later runs reuse the Go caches)" >&2
cd "$module"
echo "kube-bin: downloading modules (go mod download)" >&2
go mod download
echo "kube-bin: modules ready after $(( $(date +%s) - started )) s; compiling" >&2

# The version stamps upstream's hack/lib/version.sh sets, so `kube-apiserver --version` says v1.37.2.
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(date -u -d "@${SOURCE_DATE_EPOCH:-0}" +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X '$pkg.gitVersion=${KUBE_VERSION}' -X '$pkg.gitMajor=1' -X '$pkg.gitMinor=${minor}'"
  ldflags+=" -X '$pkg.gitTreeState=clean' -X '$pkg.buildDate=${build_date}' -X '$pkg.gitCommit=module-${KUBE_VERSION}'"
done
# And the stamps helm's and Prometheus's own Makefiles set, so `helm version` and `promtool --version`
# name the pinned releases.
ldflags+=" -X 'helm.sh/helm/v4/internal/version.version=${HELM_VERSION}' -X 'helm.sh/helm/v4/internal/version.gitTreeState=clean'"
ldflags+=" -X 'github.com/prometheus/common/version.Version=${PROMETHEUS_VERSION}' -X 'github.com/prometheus/common/version.Branch=module'"
ldflags+=" -X 'github.com/prometheus/common/version.Revision=module-${PROMETHEUS_MODULE}' -X 'github.com/prometheus/common/version.BuildDate=${build_date}'"

tmp="$(mktemp -d "${cache%/*}.tmp.XXXXXX" 2>/dev/null || { mkdir -p "${cache%/*}"; mktemp -d "${cache%/*}/.tmp.XXXXXX"; })"
trap 'rm -rf "$tmp"' EXIT
# One `go build` for every tool: the packages they share compile once.
go build -trimpath -ldflags "$ldflags" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl \
  helm.sh/helm/v4/cmd/helm \
  github.com/prometheus/prometheus/cmd/promtool \
  ./cmd/etcd
mkdir -p "${cache%/*}"
rm -rf "$cache"
mv "$tmp" "$cache"
trap - EXIT
echo "kube-bin: built in $(( $(date +%s) - started )) s; $(du -sh "$cache" | cut -f1) in $cache" >&2
"$cache/kube-apiserver" --version >&2
"$cache/helm" version --short >&2
"$cache/promtool" --version 2>&1 | head -1 >&2
echo "$cache"

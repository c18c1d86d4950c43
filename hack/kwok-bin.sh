#!/usr/bin/env bash
# Builds kwok (sigs.k8s.io/kwok, pinned in hack/kwok) and copies the stage files its module ships
# (node/fast, node/heartbeat-with-lease, node/chaos, pod/fast: what makes nodes Ready, keeps them
# so, marks a labelled node NotReady, and runs pods) into a cache outside the repository keyed by
# that module's go.sum hash. Does nothing when they are there.
#
#   hack/kwok-bin.sh            build if missing; print the directory holding kwok and stages.yaml
#   GPUPLANE_KUBE_CACHE=DIR     the cache's parent (default ~/.cache/gpuplane/kube-bin); the files go
#                               under kwok-<key>/
#
# Progress goes to stderr; the last line on stdout is the cache directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
module="$here/kwok"
KWOK_VERSION="v0.8.0"  # sigs.k8s.io/kwok, as pinned in hack/kwok/go.mod
STAGES=(node/fast node/heartbeat-with-lease node/chaos pod/fast)

key="$(sha256sum "$module/go.sum" | cut -c1-16)"
cache="${GPUPLANE_KUBE_CACHE:-$HOME/.cache/gpuplane/kube-bin}/kwok-$key"
built() { [ -x "$cache/kwok" ] && [ -s "$cache/stages.yaml" ]; }
if built; then
  echo "$cache"
  exit 0
fi

# shellcheck source=hack/go-env.sh
. "$here/go-env.sh"
need_go "kwok-bin: the VM lifecycle tests need kwok ${KWOK_VERSION} to play the kubelets: install Go >= 1.26 (https://go.dev/doc/install)"
one_builder "$cache"
if built; then  # built by the caller we waited for
  echo "$cache"
  exit 0
fi
started=$(date +%s)
echo "kwok-bin: building kwok ${KWOK_VERSION} into $cache" >&2
cd "$module"
go mod download
mkdir -p "${cache%/*}"
tmp="$(mktemp -d "${cache%/*}/.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
go build -trimpath -ldflags "-s -w" -o "$tmp/" sigs.k8s.io/kwok/cmd/kwok
# The stages as kwok's module ships them, one multi-document file for kwok's --config.
source_dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
for stage in "${STAGES[@]}"; do
  for file in "$source_dir/$stage"/*.yaml; do
    [ "$(basename "$file")" = kustomization.yaml ] && continue
    echo "---"
    cat "$file"
  done
done > "$tmp/stages.yaml"
grep -q "name: node-heartbeat-with-lease" "$tmp/stages.yaml" || { echo "kwok-bin: no node heartbeat stage in $source_dir" >&2; exit 1; }
rm -rf "$cache"
mv "$tmp" "$cache"
trap - EXIT
echo "kwok-bin: built in $(( $(date +%s) - started )) s; $(du -sh "$cache" | cut -f1) in $cache" >&2
echo "$cache"

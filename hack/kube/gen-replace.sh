#!/usr/bin/env bash
# Regenerates go.mod's replace block from k8s.io/kubernetes's own go.mod as the module proxy
# serves it: every staging module (k8s.io/X => ./staging/src/k8s.io/X) pinned to the matching
# published v0.MINOR.PATCH. Run after changing KUBE_VERSION, then `go mod tidy`.
set -euo pipefail
cd "$(dirname "$0")"
KUBE_VERSION="${KUBE_VERSION:-v1.37.2}"
STAGING_VERSION="v0.${KUBE_VERSION#v1.}"
modfile="$(GOTOOLCHAIN=local GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@${KUBE_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
{
  sed '/^\/\/ BEGIN generated replace/,$d' go.mod
  echo "// BEGIN generated replace (gen-replace.sh from k8s.io/kubernetes@${KUBE_VERSION}'s go.mod)"
  echo "replace ("
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$modfile" | awk -v v="$STAGING_VERSION" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} > go.mod.new
mv go.mod.new go.mod

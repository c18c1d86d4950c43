# Sourced by the scripts that build Go tools (hack/kube-bin.sh, hack/kubevirt-bin.sh, hack/kwok-bin.sh): find the
# go command (PATH, else where Debian and go.dev's tarball put it) and set the pinned-build
# environment, or stop with the caller's message saying what needs Go.
#
#   need_go "what needs it: install Go >= 1.26 ..."
need_go() {
  if ! command -v go >/dev/null 2>&1; then
    for candidate in /usr/local/go/bin /usr/lib/go/bin; do
      [ -x "$candidate/go" ] && PATH="$candidate:$PATH" && break
    done
  fi
  if ! command -v go >/dev/null 2>&1; then
    echo "$1" >&2
    exit 1
  fi
  # The toolchain on this machine, the modules as go.sum pins them, static binaries.
  export GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=0
}

# Callers building the same cache at once (make test beside a bench, two worktrees) wait for one
# another instead of compiling the same packages twice on the same cores: the caller takes a lock
# beside the cache, held until it exits, then checks again whether the one before it finished.
#
#   one_builder "$cache"     returns once this process holds the cache's build lock
one_builder() {
  local lock="${1%/*}/.${1##*/}.lock"
  mkdir -p "${1%/*}"
  exec 9>"$lock"
  if ! flock -n 9; then
    echo "${0##*/}: another build of ${1##*/} is running; waiting for it" >&2
    flock 9
  fi
}

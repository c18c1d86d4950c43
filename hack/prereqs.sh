#!/usr/bin/env bash
# What `make test` and `make test-postgres` need besides Python (the Makefile finds that):
# checked in the first seconds, so a fresh machine stops with one line naming what is
# missing and the command that installs it, instead of failing minutes into the suite.
#   hack/prereqs.sh            the SQLite suite: Chromium for the browser tests
#   hack/prereqs.sh postgres   the same, plus PostgreSQL and Redis on 127.0.0.1 (also when
#                              DATABASE_URL names PostgreSQL)
# Run as root where apt-get is available, it installs Chromium itself (Debian's package,
# as .ci/run does). GPUPLANE_CHROMIUM names another binary to check (harness/browsing.py
# drives /usr/bin/chromium).
set -euo pipefail

chromium="${GPUPLANE_CHROMIUM:-/usr/bin/chromium}"
missing() {
  echo "make: $1 is missing ($2); install it with: $3" >&2
  exit 1
}

if [ ! -x "$chromium" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "prereqs: installing chromium from Debian for the browser tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || true
  fi
  [ -x "$chromium" ] || missing "$chromium" "the browser tests drive it" "sudo apt-get install -y chromium"
fi

if [ "${1:-}" = postgres ] || [[ "${DATABASE_URL:-}" == postgres* ]]; then
  port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
  port_open 5432 || missing "PostgreSQL on 127.0.0.1:5432" "make test-postgres runs the suite on it" "sudo hack/services.sh"
  port_open 6379 || missing "Redis on 127.0.0.1:6379" "the worker and webhook tests queue passes on it" "sudo hack/services.sh"
fi

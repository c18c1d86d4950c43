#!/usr/bin/env bash
# Starts the services the integration tests use, on this machine, when they are not running:
#   PostgreSQL (the Debian cluster, with a `trust` line for postgres@127.0.0.1 so the tests
#   connect without a password) and Redis (no persistence). Installs redis-server from
#   Debian when it is missing. Idempotent: a running service is left alone.
# Used by .ci/run and `make services`; run as root (it edits pg_hba.conf and starts daemons).
set -euo pipefail

apt_install() {
  [ -n "${_apt_updated:-}" ] || { apt-get update -qq; _apt_updated=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)"
  if [ -z "$version" ]; then
    echo "services: installing PostgreSQL from Debian"
    apt_install postgresql
    version="$(ls /etc/postgresql | sort -V | tail -n1)"
  fi
  hba="/etc/postgresql/$version/main/pg_hba.conf"
  rule="host all postgres 127.0.0.1/32 trust"
  if ! grep -qxF "$rule" "$hba"; then
    # First matching line wins: the trust line goes above Debian's scram-sha-256 lines.
    sed -i "1i # gpuplane tests: postgres@127.0.0.1 without a password (hack/services.sh)\n$rule" "$hba"
  fi
  echo "services: starting PostgreSQL $version"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start
  for _ in $(seq 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  pg_isready -q -h 127.0.0.1 -p 5432 || { echo "services: PostgreSQL did not become ready" >&2; exit 1; }
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "services: installing redis-server from Debian"
  apt_install redis-server
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "services: starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 60); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.5; done
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null || { echo "services: Redis did not become ready" >&2; exit 1; }
fi
echo "services: PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379 are up"

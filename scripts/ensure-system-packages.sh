#!/usr/bin/env bash
# System packages the project needs beyond Python: redis-server (required), iproute2 (for the
# multi-host test over network namespaces, optional), tcmalloc (optional: the launcher preloads it
# into workers, see dejavu_engine/process.py), and Docker's engine, docker-compose and debootstrap
# (for the container deployment test, tests/infra/test_compose_deployment.py, optional). Installed with
# apt-get when we may; a failure to install an optional package only skips its test.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
has_tcmalloc() { compgen -G "/usr/lib*/libtcmalloc_minimal.so.4" >/dev/null || compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null; }
has_tcmalloc || missing+=(libtcmalloc-minimal4)
containers=()
command -v dockerd >/dev/null 2>&1 || containers+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || containers+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || containers+=(debootstrap)
[ ${#missing[@]} -eq 0 ] && [ ${#containers[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  echo "installing ${missing[*]} ${containers[*]} with apt-get" >&2
  apt-get update -q >/dev/null
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    # The Debian package starts a system service; DejaVu starts its own servers.
    (service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
  fi
  if [ ${#containers[@]} -gt 0 ]; then
    if apt-get install -y -q --no-install-recommends "${containers[@]}" >/dev/null; then
      # The container test starts dockerd itself when none runs, and stops what it started.
      if [[ " ${containers[*]} " == *" docker.io "* ]]; then
        (service docker stop || systemctl stop docker docker.socket || true) >/dev/null 2>&1
      fi
    else
      echo "note: could not install ${containers[*]}: the container deployment test will be skipped" >&2
    fi
  fi
  exit 0
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server is required: install it (Debian/Ubuntu: 'sudo apt-get install redis-server'," \
       "macOS: 'brew install redis') and run make again." >&2
  exit 1
fi
command -v ip >/dev/null 2>&1 || echo "note: iproute2 is missing, so the multi-host test will be skipped" >&2
if [ ${#containers[@]} -gt 0 ]; then
  echo "note: ${containers[*]} missing, so the container deployment test may be skipped" >&2
fi
has_tcmalloc || echo "note: tcmalloc is missing (Debian: libtcmalloc-minimal4), so workers use the default allocator" >&2

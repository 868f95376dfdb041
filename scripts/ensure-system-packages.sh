#!/usr/bin/env bash
# System packages the project needs beyond Python: redis-server (required), iproute2 (for the
# multi-host test over network namespaces, optional), tcmalloc (optional: the launcher preloads it
# into workers, see dejavu_engine/process.py). Installed with apt-get when we may.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
has_tcmalloc() { compgen -G "/usr/lib*/libtcmalloc_minimal.so.4" >/dev/null || compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null; }
has_tcmalloc || missing+=(libtcmalloc-minimal4)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian package starts a system service; DejaVu starts its own servers.
  (service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
  exit 0
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server is required: install it (Debian/Ubuntu: 'sudo apt-get install redis-server'," \
       "macOS: 'brew install redis') and run make again." >&2
  exit 1
fi
command -v ip >/dev/null 2>&1 || echo "note: iproute2 is missing, so the multi-host test will be skipped" >&2
has_tcmalloc || echo "note: tcmalloc is missing (Debian: libtcmalloc-minimal4), so workers use the default allocator" >&2

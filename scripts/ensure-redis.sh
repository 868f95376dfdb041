#!/usr/bin/env bash
# Make sure a redis-server binary is on PATH; install it with apt-get when we may.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends redis-server >/dev/null
  # The Debian package starts a system service; DejaVu starts its own servers.
  (service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
  exit 0
fi
echo "redis-server is required: install it (Debian/Ubuntu: 'sudo apt-get install redis-server'," \
     "macOS: 'brew install redis') and run make again." >&2
exit 1

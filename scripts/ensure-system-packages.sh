#!/usr/bin/env bash
# System packages the project needs beyond Python, installed with apt-get when we may (root on Debian/Ubuntu).
#
#   ensure-system-packages.sh run   what running needs: redis-server (required), a C++ compiler for the native
#                                   kernels (without one the workers use torch's attention) and tcmalloc (the launcher
#                                   preloads it into workers, see dejavu_engine/process.py)
#   ensure-system-packages.sh test  what some tests use as well: iproute2 (the multi-host test over network namespaces)
#                                   and Docker's engine, docker-compose and debootstrap (the container deployment test,
#                                   tests/infra/test_compose_deployment.py) and chromium (the status page's browser test,
#                                   tests/system/test_dashboard.py); a failure to install one only skips its test
set -euo pipefail
mode="${1:-run}"
case "$mode" in run | test) ;; *) echo "usage: $0 run|test" >&2; exit 2 ;; esac

has_tcmalloc() { compgen -G "/usr/lib*/libtcmalloc_minimal.so.4" >/dev/null || compgen -G "/usr/lib/*/libtcmalloc_minimal.so.4" >/dev/null; }
has_compiler() { command -v "${CXX:-c++}" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1; }

missing=()
optional=()
if [ "$mode" = run ]; then
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  has_compiler || optional+=(g++)
  has_tcmalloc || optional+=(libtcmalloc-minimal4)
else
  command -v ip >/dev/null 2>&1 || optional+=(iproute2)
  command -v dockerd >/dev/null 2>&1 || optional+=(docker.io)
  command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || optional+=(docker-compose)
  command -v debootstrap >/dev/null 2>&1 || optional+=(debootstrap)
  command -v chromium >/dev/null 2>&1 || optional+=(chromium)
fi
[ ${#missing[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  echo "installing ${missing[*]} ${optional[*]} with apt-get" >&2
  apt-get update -q >/dev/null
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    # The Debian package starts a system service; DejaVu starts its own servers.
    (service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
  fi
  if [ ${#optional[@]} -gt 0 ]; then
    if apt-get install -y -q --no-install-recommends "${optional[@]}" >/dev/null; then
      # The container test starts dockerd itself when none runs, and stops what it started.
      if [[ " ${optional[*]} " == *" docker.io "* ]]; then
        (service docker stop || systemctl stop docker docker.socket || true) >/dev/null 2>&1
      fi
    else
      echo "note: could not install ${optional[*]}: what needs them is skipped or falls back" >&2
    fi
  fi
  exit 0
fi

if ! command -v redis-server >/dev/null 2>&1 && [ "$mode" = run ]; then
  echo "redis-server is required: install it (Debian/Ubuntu: 'sudo apt-get install redis-server'," \
       "macOS: 'brew install redis') and run make again." >&2
  exit 1
fi
for package in "${optional[@]}"; do
  case "$package" in
    g++) echo "note: no C++ compiler, so the workers use torch's attention instead of the native kernels" >&2 ;;
    libtcmalloc-minimal4) echo "note: tcmalloc is missing (Debian: libtcmalloc-minimal4), so workers use the default allocator" >&2 ;;
    iproute2) echo "note: iproute2 is missing, so the multi-host test will be skipped" >&2 ;;
    chromium) echo "note: chromium is missing, so the status page's browser test will be skipped" >&2 ;;
    *) echo "note: $package is missing, so the container deployment test may be skipped" >&2 ;;
  esac
done

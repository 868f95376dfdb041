#!/usr/bin/env bash
# Serve DIR (a wheelhouse, see wheelhouse.sh) on http://127.0.0.1:PORT/ while COMMAND runs, then stop the
# server by its PID. Builds that run with `--network host` reach it, and pip reads its directory listing
# as --find-links. The port is fixed (WHEELHOUSE_PORT, default 38517) because the URL is a build argument:
# a new URL would invalidate Docker's build cache.
#
# Usage: serve-wheels.sh DIR COMMAND [ARG...]
set -euo pipefail

if [ "$#" -lt 2 ]; then
    echo "usage: $0 DIR COMMAND [ARG...]" >&2
    exit 2
fi
dir=$1
shift
port=${WHEELHOUSE_PORT:-38517}
python=${PYTHON:-python3}
url="http://127.0.0.1:$port/"

if "$python" -c "import socket, sys; socket.create_connection(('127.0.0.1', $port), 1)" 2>/dev/null; then
    echo "serve-wheels.sh: 127.0.0.1:$port is already taken; set WHEELHOUSE_PORT to a free port" >&2
    exit 1
fi
"$python" -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    "$python" -c "import urllib.request as u; u.urlopen('$url', timeout=1)" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "serve-wheels.sh: the wheel server did not start" >&2; exit 1; }
    sleep 0.1
done
WHEELHOUSE_URL=$url "$@"

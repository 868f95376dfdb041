#!/usr/bin/env bash
# Schemathesis against the real serving stack (issue 34's evidence): `dejavu up` on the default model (controller,
# one colocated token worker, a Redis of its own; a 512-position context, so a generated max_tokens ends soon),
# fuzzed from its own /openapi.json for MAX_TIME seconds with the not_a_server_error check. Prints Schemathesis' summary and writes its JSON report beside this script.
# Usage: run.sh [MAX_TIME_S]
set -u
max_time=${1:-300}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
port=8100 redis_port=16500
export XDG_RUNTIME_DIR=$(mktemp -d)
redis-server --port $redis_port --save '' --appendonly no > /dev/null 2>&1 &
redis=$!
sleep 0.5
DEJAVU_ENGINE__MAX_CONTEXT=512 "$root/.venv/bin/dejavu" up --port $port --redis-url redis://127.0.0.1:$redis_port/0 > "$XDG_RUNTIME_DIR/up.log" 2>&1 &
launcher=$!
for _ in $(seq 300); do curl -sf localhost:$port/ready > /dev/null && break; sleep 1; done
"$root/.venv/bin/st" run "http://127.0.0.1:$port/openapi.json" --checks not_a_server_error \
  --phases examples,coverage,fuzzing --max-examples 60 --max-time "$max_time" --seed 20241 --workers 2 \
  --request-timeout 120 --generation-database none --suppress-health-check all --no-color \
  --report json --report-json-path "$here/report.json"
status=$?
kill $launcher; wait $launcher 2> /dev/null
kill $redis; wait $redis 2> /dev/null
grep -o 'logs in [^ ]*' "$XDG_RUNTIME_DIR/up.log"
exit $status

#!/usr/bin/env bash
# Reduced same-window check: vLLM-CPU (prefix caching on) and `dejavu up`, uniform, mixed, shared-prefix.
set -u
out=${1:-/tmp/window-final}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/../../.." && pwd)
py=$HOME/.cache/dejavu-peers/venv-vllm/bin/python
cli=$root/../shared/peers/vllm_cli.py
model=$HOME/.cache/dejavu/SmolLM2-135M-Instruct
export XDG_RUNTIME_DIR=/tmp/window-run; mkdir -p $XDG_RUNTIME_DIR
src=$root/benchmarks/results/window-requests/run.sh
eval "$(sed -n '/^bench() {/,/^}/p' $src)"
eval "$(sed -n '/^ours() {/,/^}/p' $src)"
VLLM_PREFIX_CACHING=1 bash "$root/../shared/peers/serve_vllm.sh" "$model" 8011 > "$out/vllm-server.log" 2>&1 &
vllm=$!
for _ in $(seq 600); do curl -sf localhost:8011/v1/models > /dev/null && break; sleep 1; done
bench vllm-warmup 8011 uniform1 > /dev/null
for wl in uniform mixed prefix; do bench vllm 8011 "$wl"; done
kill "$vllm"; wait "$vllm" 2> /dev/null; pkill -f "vllm_cli.py serve" 2> /dev/null; sleep 5
ours dejavu "uniform1 uniform mixed prefix"
echo done

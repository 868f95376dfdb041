#!/usr/bin/env bash
# second pass of the window: ours at the new default budget on every workload, and vLLM's uniform once warm
set -u
cd /work/main
src=benchmarks/results/window-requests/run.sh
# reuse run.sh's functions
eval "$(sed -n '/^bench() {/,/^}/p' $src)"
eval "$(sed -n '/^ours() {/,/^}/p' $src)"
out=/tmp/window-requests; root=/work/main
py=$HOME/.cache/dejavu-peers/venv-vllm/bin/python; cli=/work/shared/peers/vllm_cli.py; model=$HOME/.cache/dejavu/SmolLM2-135M-Instruct
export XDG_RUNTIME_DIR=/tmp/window-run
ours dejavu256 "uniform uniform1 mixed prefix burst"
VLLM_PREFIX_CACHING=1 bash /work/shared/peers/serve_vllm.sh "$model" 8011 > "$out/vllm-server2.log" 2>&1 &
vllm=$!
for _ in $(seq 600); do curl -sf localhost:8011/v1/models > /dev/null && break; sleep 1; done
bench vllmwarmup 8011 uniform1 > /dev/null
bench vllm2 8011 uniform
bench vllm2 8011 mixed
kill "$vllm"; wait "$vllm" 2> /dev/null; pkill -f "vllm_cli.py serve" 2> /dev/null

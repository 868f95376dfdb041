#!/usr/bin/env bash
# Request scheduling on pipelines of several stages, in one window against vLLM-CPU (prefix caching on): the
# prompt-heavy burst on a disaggregated 1 prompt + 1 token deployment and uniform traffic on two colocated stages,
# each with request scheduling (the default) and with the microbatch cohorts it replaced
# (engine.request_scheduling off), plus the default one-stage deployment; all driven by vLLM's own client.
# Usage: run.sh OUT_DIR   (vLLM's venv from ../shared/peers/serve_vllm.sh must exist)
set -u
out=${1:-/tmp/window-requests}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/../../.." && pwd)
py=${VLLM_VENV:-$HOME/.cache/dejavu-peers/venv-vllm}/bin/python
cli=$root/../shared/peers/vllm_cli.py
model=$HOME/.cache/dejavu/SmolLM2-135M-Instruct
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/window-run}; mkdir -p "$XDG_RUNTIME_DIR"

bench() {  # bench NAME PORT WORKLOAD
  local name=$1 port=$2 wl=$3
  local common="--backend openai --base-url http://127.0.0.1:$port --model SmolLM2-135M-Instruct --tokenizer $model
    --save-result --result-dir $out --seed 0 --result-filename $name-$wl.json"
  case $wl in
  uniform) args="--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 16 --max-concurrency 16 --ignore-eos";;
  uniform1) args="--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 6 --max-concurrency 1 --ignore-eos";;
  mixed) args="--dataset-name random --random-input-len 512 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 40 --max-concurrency 16 --request-rate 0.8";;
  prefix) args="--dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts 40 --max-concurrency 16 --request-rate 1";;
  burst) args="--dataset-name random --random-input-len 1000 --random-output-len 64 --num-prompts 12 --max-concurrency 12 --ignore-eos";;
  esac
  # shellcheck disable=SC2086
  "$py" "$cli" bench serve $common $args > "$out/$name-$wl.txt" 2>&1
  python3 - "$out/$name-$wl.json" "$name" "$wl" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>12s} {sys.argv[3]:>9s} out {d['output_throughput']:7.1f} tok/s  ttft p50 {d['median_ttft_ms']:6.0f} p99 {d['p99_ttft_ms']:6.0f}  tpot p50 {d['median_tpot_ms']:6.1f}  itl p99 {d['p99_itl_ms']:6.0f}  failed {d['failed']}", flush=True)
PY
}

ours() {  # ours NAME "WORKLOADS" [dejavu up args...] -- [ENV...]
  local name=$1 wls=$2; shift 2
  local up=() envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do up+=("$1"); shift; done
  [ $# -gt 0 ] && shift && envs=("$@")
  if ss -ltn | grep -q ':8000 '; then echo "port 8000 busy"; return 1; fi
  env "${envs[@]}" "$root/.venv/bin/dejavu" up --port 8000 "${up[@]}" > "$out/$name-up.log" 2>&1 &
  local launcher=$!
  for _ in $(seq 300); do curl -sf localhost:8000/ready > /dev/null && break; sleep 1; done
  for wl in $wls; do bench "$name" 8000 "$wl"; done
  kill "$launcher"; wait "$launcher" 2> /dev/null
  for _ in $(seq 60); do ss -ltn | grep -q ':8000 ' || break; sleep 1; done
}

VLLM_PREFIX_CACHING=1 bash "$root/../shared/peers/serve_vllm.sh" "$model" 8011 > "$out/vllm-server.log" 2>&1 &
vllm=$!
for _ in $(seq 600); do curl -sf localhost:8011/v1/models > /dev/null && break; sleep 1; done
bench vllm 8011 uniform1  # warm-up
for wl in uniform burst; do bench vllm 8011 "$wl"; done
kill "$vllm"; wait "$vllm" 2> /dev/null; pkill -f "vllm_cli.py serve" 2> /dev/null; sleep 5

ours dejavu "uniform"
ours disagg "burst" --prompt-depth 1 --token-depth 1
ours disagg-cohorts "burst" --prompt-depth 1 --token-depth 1 -- DEJAVU_ENGINE__REQUEST_SCHEDULING=false
ours colocated2 "uniform" --colocated --token-depth 2
ours colocated2-cohorts "uniform" --colocated --token-depth 2 -- DEJAVU_ENGINE__REQUEST_SCHEDULING=false
echo "results in $out"

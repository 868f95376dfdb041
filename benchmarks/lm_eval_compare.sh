#!/usr/bin/env bash
# lm-evaluation-harness (`lm-eval`, its local-completions model) against DejaVu and against vLLM-CPU, one server
# after the other, on the two small local tasks in tests/data/lm_eval/:
#   dejavu_mc   40 multiple-choice items: loglikelihood requests (/v1/completions with `echo`, `logprobs: 1`,
#               `max_tokens: 1` and token-id prompts), scored acc and acc_norm
#   dejavu_gen  20 greedy generate-until items (one-word answers, stop at a newline), scored exact_match
# Both servers run SmolLM2-135M-Instruct in float32, so the scores should agree closely. The script prints
# them side by side with the per-item agreement (largest loglikelihood difference, same chosen answer, same
# generated text) and keeps lm-eval's results and samples in benchmarks/results/lm-eval/{ours,vllm}/ and the
# printed comparison in benchmarks/results/lm-eval/comparison.txt.
#
#   benchmarks/lm_eval_compare.sh [both|ours|vllm|compare]    (default both; compare: only print the kept results)
#
# lm-eval lives in its own virtualenv (LMEVAL_VENV, default /tmp/lmeval-venv), created on first use with
# lm-eval[api]==0.4.13 and transformers (the Hugging Face tokenizer of the local checkpoint), never in the
# project's .venv. vLLM-CPU comes from ../shared/peers/serve_vllm.sh (its own virtualenv; 2-3 minutes to start).
# Ours runs with a Redis of its own. Ports: REDIS_PORT (16600), OURS_PORT (8300), VLLM_PORT (8311). Every process
# the script starts is stopped by its PID (process group) when it ends, also on failure or Ctrl-C. Never part of
# make test or CI.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODEL=${MODEL:-$HOME/.cache/dejavu/SmolLM2-135M-Instruct}
LMEVAL_VENV=${LMEVAL_VENV:-/tmp/lmeval-venv}
LMEVAL_VERSION=0.4.13
REDIS_PORT=${REDIS_PORT:-16600}
OURS_PORT=${OURS_PORT:-8300}
VLLM_PORT=${VLLM_PORT:-8311}
PEERS=${PEERS:-$ROOT/../shared/peers}
RESULTS=${RESULTS:-$ROOT/benchmarks/results/lm-eval}
TASKS=dejavu_mc,dejavu_gen
READY_TIMEOUT=${READY_TIMEOUT:-600}
WORK=  # server logs and lm_eval output of this run (a fresh temporary folder)
started=()  # PIDs of the process groups this script started (each is its group's leader, via setsid)

log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

# stop_group PID: SIGTERM to the leader (a graceful stop), then the whole group after a grace period.
stop_group() {
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 60); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  kill -TERM -- "-$pid" 2>/dev/null || true
  sleep 2
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {  # the last started first: the server before its Redis
  local i
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do stop_group "${started[i]}"; done
  started=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ensure_lmeval() {
  if "$LMEVAL_VENV/bin/python" -c "import lm_eval, transformers, aiohttp, tenacity" 2>/dev/null; then return; fi
  log "installing lm-eval $LMEVAL_VERSION into $LMEVAL_VENV"
  python3 -m venv "$LMEVAL_VENV"
  "$LMEVAL_VENV/bin/pip" install -q "lm-eval[api]==$LMEVAL_VERSION" transformers
}

# wait_ready PORT PID NAME: until a one-token completion answers 200 (the model is loaded and serving).
wait_ready() {
  local port=$1 pid=$2 name=$3 deadline=$((SECONDS + READY_TIMEOUT))
  while [ $SECONDS -lt $deadline ]; do
    kill -0 "$pid" 2>/dev/null || { log "$name exited before it was ready"; return 1; }
    if curl -sf -o /dev/null -m 30 "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$(basename "$MODEL")\", \"prompt\": \"Hello\", \"max_tokens\": 1}"; then
      return 0
    fi
    sleep 3
  done
  log "$name not ready after ${READY_TIMEOUT}s"
  return 1
}

# run_lmeval NAME PORT: both tasks against the server on PORT; its results and samples go to $RESULTS/NAME/.
run_lmeval() {
  local name=$1 port=$2
  local args="model=$(basename "$MODEL"),base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$MODEL"
  args+=",tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
  args+=",max_length=2048,timeout=300"
  log "lm_eval against $name (:$port)"
  (
    set -x
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE=$WORK/hf-datasets TOKENIZERS_PARALLELISM=false \
      "$LMEVAL_VENV/bin/lm_eval" run --model local-completions --model_args "$args" \
      --include_path tests/data/lm_eval --tasks "$TASKS" --batch_size 1 --seed 1234 \
      --output_path "$WORK/$name" --log_samples
  ) 2>&1 | tee "$WORK/$name-lm_eval.log"
  rm -rf "${RESULTS:?}/$name" && mkdir -p "$RESULTS/$name"
  local f
  for f in $(find "$WORK/$name" -name 'results_*.json' -o -name 'samples_*.jsonl'); do
    # lm-eval names its files after the run's time; keep stable names
    local base
    base=$(basename "$f" | sed -E 's/_[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9.:-]+\.json/.json/')
    cp "$f" "$RESULTS/$name/$base"
  done
  [ -f "$RESULTS/$name/results.json" ] || { log "lm_eval wrote no results for $name"; return 1; }
}

run_ours() {
  log "starting redis-server on :$REDIS_PORT and DejaVu on :$OURS_PORT"
  setsid redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$WORK/redis.log" 2>&1 &
  local redis=$!
  started+=("$redis")
  mkdir -p "$WORK/xdg-ours" && chmod 700 "$WORK/xdg-ours"
  XDG_RUNTIME_DIR=$WORK/xdg-ours setsid "$ROOT/.venv/bin/dejavu" up --model "$MODEL" --dtype float32 \
    --port "$OURS_PORT" --redis-url "redis://127.0.0.1:$REDIS_PORT/0" >"$WORK/ours-server.log" 2>&1 &
  local ours=$!
  started+=("$ours")
  wait_ready "$OURS_PORT" "$ours" DejaVu || { tail -30 "$WORK/ours-server.log" >&2; return 1; }
  run_lmeval ours "$OURS_PORT"
  cleanup
}

run_vllm() {
  log "starting vLLM-CPU on :$VLLM_PORT (2-3 minutes)"
  VLLM_PREFIX_CACHING=1 setsid bash "$PEERS/serve_vllm.sh" "$MODEL" "$VLLM_PORT" >"$WORK/vllm-server.log" 2>&1 &
  local vllm=$!
  started+=("$vllm")
  wait_ready "$VLLM_PORT" "$vllm" vLLM || { tail -30 "$WORK/vllm-server.log" >&2; return 1; }
  run_lmeval vllm "$VLLM_PORT"
  cleanup
}

# compare: both servers' scores side by side, and their per-item agreement; also kept in $RESULTS/comparison.txt.
compare() {
  "$LMEVAL_VENV/bin/python" - "$RESULTS" <<'EOF' | tee "$RESULTS/comparison.txt"
import json
import sys
from pathlib import Path

results = Path(sys.argv[1])
names = ("ours", "vllm")
runs = {n: json.loads((results / n / "results.json").read_text()) for n in names if (results / n / "results.json").exists()}
if len(runs) < 2:
    sys.exit(f"need both results: found {sorted(runs)} under {results}")
print(f"{'task':<12} {'metric':<22} {'DejaVu':>8} {'vLLM-CPU':>9}")
for task in sorted(runs["ours"]["results"]):
    for key, value in sorted(runs["ours"]["results"][task].items()):
        if key == "sample_len" or "stderr" in key or not isinstance(value, (int, float)):
            continue
        print(f"{task:<12} {key:<22} {value:>8.3f} {runs['vllm']['results'][task][key]:>9.3f}")


def samples(name: str, task: str) -> dict[int, dict]:
    (path,) = (results / name).glob(f"samples_{task}*.jsonl")
    return {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}


ours, vllm = samples("ours", "dejavu_mc"), samples("vllm", "dejavu_mc")
pairs = [(a, b) for d in ours for a, b in zip(ours[d]["filtered_resps"], vllm[d]["filtered_resps"], strict=True)]
diffs = [abs(float(a[0]) - float(b[0])) for a, b in pairs]
same_greedy = sum(a[1] == b[1] for a, b in pairs)
same_pick = sum(ours[d]["acc"] == vllm[d]["acc"] and ours[d]["acc_norm"] == vllm[d]["acc_norm"] for d in ours)
print(f"dejavu_mc:  {len(diffs)} loglikelihoods, largest |difference| {max(diffs):.2e} nats, "
      f"mean {sum(diffs) / len(diffs):.2e}; same is_greedy on {same_greedy}/{len(pairs)}; "
      f"same acc and acc_norm on {same_pick}/{len(ours)} items")
ours, vllm = samples("ours", "dejavu_gen"), samples("vllm", "dejavu_gen")
same_text = sum(ours[d]["resps"] == vllm[d]["resps"] for d in ours)
print(f"dejavu_gen: identical generated text on {same_text}/{len(ours)} items")
for d in sorted(ours):
    if ours[d]["resps"] != vllm[d]["resps"]:
        print(f"  doc {d}: DejaVu {ours[d]['resps'][0][0]!r}  vLLM {vllm[d]['resps'][0][0]!r}")
EOF
}

mode=${1:-both}
case "$mode" in both | ours | vllm) WORK=$(mktemp -d /tmp/lm-eval-compare.XXXXXX) ;; esac
case "$mode" in
  both) ensure_lmeval; run_ours; run_vllm; compare ;;
  ours) ensure_lmeval; run_ours ;;
  vllm) ensure_lmeval; run_vllm ;;
  compare) compare ;;
  *) echo "usage: $0 [both|ours|vllm|compare]" >&2; exit 2 ;;
esac
[ -z "$WORK" ] || log "server logs and lm_eval output in $WORK"

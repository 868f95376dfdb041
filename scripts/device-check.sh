#!/usr/bin/env bash
# The engine on a CUDA GPU, in one call of a lent GPU machine (the `device` tool), prepared here first.
#
#   scripts/device-check.sh prepare   # here: wheels the GPU image lacks, SmolLM2's config, into .device/
#   scripts/device-check.sh run       # there (the repository root, $OUT set): tests and benchmark on cuda
#
# The device tool's call: command "bash scripts/device-check.sh run", carry [".device"], timeout_s 540.
# What comes back under $OUT: tests.txt (the device-generic engine tests on the GPU: each family against
# transformers, whole and split into stages, on both of the stage's paths; batching, paging, sampling;
# pytest's junit XML beside it), engine-cuda.json and engine-cuda.txt (`dejavu bench engine --device cuda` on
# a SmolLM2-135M-shaped checkpoint with random weights, ours against transformers in float32 and bfloat16,
# beside the bound of a device-to-device copy), and env.txt (GPU, driver, torch).
#
# The GPU machine reaches no registry and takes a 64 MiB working tree: the real checkpoint (538 MB) cannot
# travel, so the benchmark builds one of the same shapes (benchmarks/random_checkpoint.py; a step's time
# depends on the shapes, not the values) and the tests use the tiny checkpoints they build themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.device
WHEELS=$DIR/wheels
# What the engine imports that the GPU image (Python 3.12, torch, transformers, pytest) does not hold.
NEEDED=(pydantic pydantic-settings redis hiredis cryptography gguf)

prepare() {
  local python=${PYTHON:-.venv/bin/python}
  local model=${MODEL:-$HOME/.cache/dejavu/SmolLM2-135M-Instruct}
  [ -f "$model/config.json" ] || { echo "no $model/config.json: run make setup first" >&2; exit 1; }
  rm -rf "$DIR" && mkdir -p "$WHEELS" "$DIR/smollm2"
  local pyver=${PYVER:-3.12}  # the GPU image's Python (PYVER=3.11: for a dry run here)
  "$python" -m pip download -q --dest "$WHEELS" --only-binary=:all: --python-version "$pyver" --implementation cp \
    --abi "cp${pyver/./}" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -c requirements/constraints.txt "${NEEDED[@]}" 2> >(grep -v "^WARNING: Location" >&2)
  # What the image holds already stays the image's.
  for held in numpy PyYAML pyyaml tqdm typing_extensions requests urllib3 idna certifi charset_normalizer; do
    rm -f "$WHEELS/$held"-*.whl
  done
  cp "$model/config.json" "$DIR/smollm2/"
  du -sh "$DIR"
  echo "prepared $DIR: device run with command 'bash scripts/device-check.sh run', carry ['$DIR']"
}

run() {
  local out=${OUT:-/tmp/device-check} device=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of this script on a CPU
  mkdir -p "$out"
  local python=${PYTHON:-python3}
  # Into the image's own environment (the machine is given back bare after the call): the wheels, then the
  # engine's three packages editable, as `make setup` installs them (tests/ has packages of the same names,
  # which a plain PYTHONPATH would let shadow them under pytest).
  "$python" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e libs/common -e libs/dejavulib -e libs/engine
  export HF_HUB_OFFLINE=1
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    "$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
  } > "$out/env.txt" 2>&1 || true
  cat "$out/env.txt"
  local rc=0 modules
  # The device-generic modules, as tests/engine/conftest.py lists them (the others need the whole project).
  modules=$(cd tests && "$python" -c "from engine.conftest import DEVICE_GENERIC as m; print(*sorted(m))")
  # shellcheck disable=SC2046  # one argument per module
  "$python" -m pytest $(printf 'tests/engine/%s.py ' $modules) --engine-device "$device" -m "not model" -p no:cacheprovider -q \
    --timeout 240 --junitxml "$out/tests.xml" > "$out/tests.txt" 2>&1 || rc=$?
  tail -n 25 "$out/tests.txt"
  "$python" benchmarks/random_checkpoint.py --like "$DIR/smollm2" --out /tmp/smollm2-random > /dev/null
  "$python" benchmarks/bench_engine.py --device "$device" --model /tmp/smollm2-random --no-preload \
    ${BENCH_ARGS:---prompt-len 256 1000 --batches 1 16} --dtypes float32 bfloat16 --out "$out/engine-$device.json" \
    2>&1 | grep -v "^Loading\|it/s]" > "$out/engine-$device.txt" || rc=$?
  cat "$out/engine-$device.txt"
  return $rc
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# bench3.sh NAME PORT: uniform, mixed-length and shared-prefix traffic, vLLM's client, against one server
set -u
name=$1; port=$2
py=/root/.cache/dejavu-peers/venv-vllm/bin/python
cli=/work/shared/peers/vllm_cli.py
model=/root/.cache/dejavu/SmolLM2-135M-Instruct
out=/tmp/bench3/$name; mkdir -p $out
common="--backend openai --base-url http://127.0.0.1:$port --model SmolLM2-135M-Instruct --tokenizer $model --save-result --result-dir $out --seed 0"
$py $cli bench serve $common --dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 16 --max-concurrency 16 --ignore-eos --result-filename uniform.json > $out/uniform.txt 2>&1
$py $cli bench serve $common --dataset-name random --random-input-len 512 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 40 --max-concurrency 16 --request-rate 0.8 --result-filename mixed.json > $out/mixed.txt 2>&1
$py $cli bench serve $common --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts 40 --max-concurrency 16 --request-rate 1 --result-filename prefix.json > $out/prefix.txt 2>&1
echo done $name

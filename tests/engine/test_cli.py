"""``dejavu generate`` as a real process: JSON shape and one-line errors for bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dejavu_common.tokenizer import Tokenizer


def dejavu(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the dejavu command in a child process (waited for, so it is gone when this returns)."""
    env = {**os.environ, "DEJAVU_ENGINE__TORCH_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dejavu_cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_generate_json_output(tiny_checkpoints: dict[str, Path]) -> None:
    done = dejavu(
        "generate",
        "--model",
        str(tiny_checkpoints["llama"]),
        "--prompt",
        "Hello world",
        "--max-tokens",
        "6",
        "--stages",
        "2",
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "3",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"token_ids", "text", "finish_reason", "prompt_tokens", "timings"}
    assert set(result["timings"]) == {"prefill_s", "decode_s_per_token"}
    assert 1 <= len(result["token_ids"]) <= 6 and result["finish_reason"] in ("stop", "length")
    assert result["prompt_tokens"] == len(Tokenizer.from_pretrained(tiny_checkpoints["llama"]).encode("Hello world"))
    again = json.loads(
        dejavu(
            "generate",
            "--model",
            str(tiny_checkpoints["llama"]),
            "--prompt",
            "Hello world",
            "--max-tokens",
            "6",
            "--temperature",
            "0.9",
            "--top-k",
            "20",
            "--seed",
            "3",
            "--json",
        ).stdout
    )
    assert again["token_ids"] == result["token_ids"]  # same seed, 1 stage instead of 2: same tokens


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "-3"], "max tokens"),
        (["--stages", "4"], "stages"),
        (["--max-tokens", "300"], "exceeds the context"),
        (["--top-p", "0"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--model", "/nonexistent/model"], "not found"),
    ],
)
def test_bad_arguments_give_one_line_errors(args: list[str], message: str, tiny_checkpoints: dict[str, Path]) -> None:
    model = [] if "--model" in args else ["--model", str(tiny_checkpoints["gpt2"])]
    done = dejavu("generate", "--prompt", "Hello", *model, *args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr


def test_long_prompt_is_rejected(tiny_checkpoints: dict[str, Path]) -> None:
    done = dejavu("generate", "--model", str(tiny_checkpoints["opt"]), "--prompt", "fox " * 400, "--max-tokens", "1")
    assert done.returncode != 0 and "exceeds the context" in done.stderr and len(done.stderr.splitlines()) == 1


def test_bench_unknown_name_lists_the_available_ones() -> None:
    done = dejavu("bench", "no-such-benchmark")
    assert done.returncode != 0 and "available:" in done.stderr and "engine" in done.stderr


def test_generate_in_bfloat16(tiny_checkpoints: dict[str, Path]) -> None:
    """``--dtype bfloat16`` reaches the engine: the greedy tokens are those of a bfloat16 pipeline."""
    from dejavu_common.messages import SamplingSpec
    from dejavu_engine.generate import Request, generate_batch
    from dejavu_engine.pipeline import Pipeline

    folder = tiny_checkpoints["llama"]
    done = dejavu(
        "generate",
        "--model",
        str(folder),
        "--prompt",
        "Hello world",
        "--max-tokens",
        "5",
        "--dtype",
        "bfloat16",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    prompt = Tokenizer.from_pretrained(folder).encode("Hello world")
    pipeline = Pipeline(folder, 1, dtype="bfloat16")
    request = Request(tuple(prompt), SamplingSpec(max_tokens=5, temperature=0), pipeline.spec.eos_token_ids)
    (expected,), _ = generate_batch(pipeline, [request])
    assert json.loads(done.stdout)["token_ids"] == list(expected.token_ids)

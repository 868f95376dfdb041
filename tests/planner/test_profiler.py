"""``dejavu profile`` on the real engine and the default model, then planning with what it measured."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dejavu_cli.commands import plan, profile
from dejavu_planner.profile import Profile

pytestmark = pytest.mark.model


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command", required=True)
    profile.register(subparsers)
    plan.register(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


def test_profile_measures_the_default_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import ensure_default_model

    out = tmp_path / "smollm2.json"
    argv = ["profile", "--out", str(out), "--layers", "2", "--threads", "1", "--batches", "1,2"]
    argv += ["--prompt-lens", "8,32", "--decode-context", "16", "--decode-steps", "2", "--repeats", "1"]
    assert run([*argv, "--token-batches", "3,1"]) == 0
    measured = Profile.load(out)
    assert measured.prompt_time.x == (1.0, 2.0) and measured.token_time.x == (1.0, 3.0)

    folder = ensure_default_model(Settings())
    config = json.loads((folder / "config.json").read_text())
    assert measured.layers == config["num_hidden_layers"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert measured.kv_bytes_per_token_per_layer == 2 * config["num_key_value_heads"] * head_dim * 4  # float32
    # W0 * L accounts for every weight once: close to the float32 checkpoint's size on disk.
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert measured.weight_bytes_per_layer * measured.layers == pytest.approx(on_disk, rel=0.05)
    assert all(v > 0 for row in measured.prompt_time.values for v in row)
    assert all(v > 0 for v in measured.token_time.values)
    assert measured.stream_overhead >= 1.0
    assert measured.head_time is not None and measured.co_runners == 0
    assert measured.member_time >= 0.0  # three one-row microbatches against one of three rows
    assert measured.measured_depth == 1 and measured.machine_memory_bytes > 0

    assert run(["plan", "--profile", str(out), "-D", "4", "--prompt-len", "32", "--requests", "50"]) == 0
    assert "DejaVu" in capsys.readouterr().out


def test_profile_with_a_co_runner_times_the_head_apart(tmp_path: Path) -> None:
    """--co-runners starts a decoding process for the measurement and stops it afterwards; the head is
    timed on the model's last stage even when only the first layers are profiled."""
    import multiprocessing

    out = tmp_path / "shared.json"
    argv = ["profile", "--out", str(out), "--layers", "2", "--threads", "1", "--batches", "1,2"]
    argv += ["--prompt-lens", "8", "--decode-context", "16", "--decode-steps", "2", "--repeats", "1"]
    assert run([*argv, "--co-runners", "1"]) == 0
    measured = Profile.load(out)
    assert measured.co_runners == 1 and "1 other process" in measured.source
    assert measured.head_time is not None and all(v > 0 for v in measured.head_time.values)
    assert multiprocessing.active_children() == []  # the co-runner was joined

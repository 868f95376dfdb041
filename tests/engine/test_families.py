"""Each family's forward equals transformers' own forward, whole or split into stages; a family or a feature the
engine does not implement is refused, naming what is missing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

from dejavu_engine.families import family_for
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from engine.tiny_models import FAMILIES

PROMPT, DECODE = 9, 5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: dict[str, Path]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """family -> (token ids [1, PROMPT + DECODE], HF logits for every position)."""
    out = {}
    generator = torch.Generator().manual_seed(1)
    for family, folder in tiny_checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ids = torch.randint(3, 300, (1, PROMPT + DECODE), generator=generator)
        with torch.no_grad():
            out[family] = (ids, model(ids).logits)
    return out


@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_transformers(
    family: str,
    stages: int,
    path: str,
    device: str,
    tiny_checkpoints: dict[str, Path],
    reference: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """On ``device``: ``host``, the stage as this host builds it (on a CPU, oneDNN-packed GEMMs and the native
    kernels where they build); ``generic``, the device-generic path alone (dense weights, torch's attention),
    which is what a CUDA device runs."""
    ids, expected = reference[family]
    generic = path == "generic"
    pipeline = Pipeline(tiny_checkpoints[family], stages, device, pack_gemms=not generic, native_attention=not generic)
    caches = pipeline.allocate(1, PROMPT + DECODE)
    geometry = BatchGeometry((0,), PROMPT)
    prefill = pipeline.forward(ids[:, :PROMPT], caches, geometry, all_logits=True)
    assert prefill.device.type == torch.device(device).type  # computed there, from token ids on the host
    torch.testing.assert_close(prefill.cpu(), expected[:, :PROMPT], atol=TOLERANCE, rtol=0)
    for t in range(PROMPT, PROMPT + DECODE):  # teacher forcing: feed the reference token
        geometry = geometry.advance()
        logits = pipeline.forward(ids[:, t : t + 1], caches, geometry)
        torch.testing.assert_close(logits[:, 0].cpu(), expected[:, t], atol=TOLERANCE, rtol=0)


def _refusal(config: PretrainedConfig | dict[str, Any]) -> str:
    with pytest.raises(ValueError) as refused:
        family_for(config if isinstance(config, dict) else config.to_dict())
    return str(refused.value)


@pytest.mark.parametrize(
    ("config", "missing"),
    [
        (MixtralConfig(), r"'mixtral': the engine lacks a mixture-of-experts MLP"),
        (Qwen2MoeConfig(), r"'qwen2_moe': the engine lacks a mixture-of-experts MLP"),
        (Gemma3Config(), r"'gemma3': the engine lacks Gemma 3's vision tower \(its text model, .*gemma3_text"),
        (Gemma2Config(use_bidirectional_attention=True), r"gemma2: bidirectional attention"),
        (Phi3Config(partial_rotary_factor=0.75), r"phi3: a partial rotary embedding \(partial_rotary_factor 0.75\)"),
        (LlamaConfig(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}), r"rope type 'proportional'"),
        (LlamaConfig(hidden_act="gelu"), r"llama: activation 'gelu' is not supported"),
        (
            Phi3Config().to_dict() | {"rope_parameters": {"rope_type": "su", "short_factor": [1.0] * 48}},
            r"phi3: rope type 'longrope' needs 'long_factor'",
        ),
    ],
)
def test_an_unsupported_family_or_feature_is_refused_naming_what_is_missing(
    config: PretrainedConfig | dict[str, Any], missing: str
) -> None:
    assert re.search(missing, _refusal(config))


def test_a_window_that_never_drops_a_key_is_full_attention() -> None:
    """A sliding window of at least the model's positions changes nothing, and Qwen's window applies only with
    ``use_sliding_window``."""
    assert family_for(Phi3Config(sliding_window=4096, max_position_embeddings=4096).to_dict()).spec.model_type == "phi3"
    assert family_for(Qwen2Config(sliding_window=64).to_dict()).spec.model_type == "qwen2"


def test_a_stage_refuses_an_unsupported_checkpoint_before_loading_weights(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "gelu"
    shutil.copytree(tiny_checkpoints["mistral"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
    (folder / "model.safetensors").unlink()  # refused from config.json alone
    with pytest.raises(ValueError, match=r"mistral: activation 'gelu' is not supported"):
        Stage(folder, (0, 1))

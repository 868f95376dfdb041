"""Scaled rotary embeddings (Llama 3.x's ``llama3``, ``linear``, ``dynamic`` NTK, YaRN; Phi-3's ``longrope``) equal
transformers, whole and split into stages, on both of a stage's paths.

``dynamic`` and ``longrope`` change with the length of the sequence, so the reference is transformers generating
each sequence alone with its cache (a prefill, then one token per call), and the engine runs both sequences in one
left-padded batch: one row is past the pretraining length from its prompt on, the other crosses it while it
decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dejavu_engine.families import family_for
from dejavu_engine.families.llama import Llama
from dejavu_engine.families.rope import Rotary
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.weights import load_config
from engine.tiny_models import LAYERS, ROPE_VARIANTS, build_checkpoint

PROMPTS = (12, 7)  # past dynamic's 8 and longrope's 10 positions from the prompt on; crossing them in decode
DECODE = 5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rope-checkpoints")
    return {
        name: build_checkpoint(family, root / name, overrides=overrides)
        for name, (family, overrides) in ROPE_VARIANTS.items()
    }


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """variant -> (each sequence's token ids, transformers' logits at each of its positions as it generates it
    alone: prompt in one call, then one token per call)."""
    out = {}
    generator = torch.Generator().manual_seed(3)
    for name, folder in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        sequences, logits = [], []
        for length in PROMPTS:
            ids = torch.randint(3, 300, (1, length + DECODE), generator=generator)
            with torch.no_grad():
                step = model(ids[:, :length], use_cache=True)
                per_call, cache = [step.logits[0]], step.past_key_values
                for t in range(length, length + DECODE):
                    step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                    per_call.append(step.logits[0])
                    cache = step.past_key_values
            sequences.append(ids[0])
            logits.append(torch.cat(per_call))
        out[name] = (sequences, logits)
    return out


@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_scaled_rotary_matches_transformers(
    variant: str,
    stages: int,
    path: str,
    device: str,
    checkpoints: dict[str, Path],
    reference: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]],
) -> None:
    sequences, expected = reference[variant]
    generic = path == "generic"
    pipeline = Pipeline(checkpoints[variant], stages, device, pack_gemms=not generic, native_attention=not generic)
    geometry, ids = _batch(sequences)
    caches = pipeline.allocate(len(PROMPTS), geometry.cur_len + DECODE)
    prefill = pipeline.forward(ids, caches, geometry, all_logits=True).cpu()
    for row, length in enumerate(PROMPTS):
        real = prefill[row, geometry.pad_lens[row] :]
        torch.testing.assert_close(real, expected[row][:length], atol=TOLERANCE, rtol=0)
    for step in range(DECODE):
        geometry = geometry.advance()
        tokens = torch.stack([s[length + step] for s, length in zip(sequences, PROMPTS, strict=True)]).view(-1, 1)
        logits = pipeline.forward(tokens, caches, geometry)[:, 0].cpu()
        want = torch.stack([expected[row][length + step] for row, length in enumerate(PROMPTS)])
        torch.testing.assert_close(logits, want, atol=TOLERANCE, rtol=0)


def _batch(sequences: list[torch.Tensor]) -> tuple[BatchGeometry, torch.Tensor]:
    """The prompts of ``sequences`` left-padded into one batch."""
    geometry = BatchGeometry.for_prompts(PROMPTS)
    ids = torch.zeros(len(PROMPTS), geometry.cur_len, dtype=torch.long)
    for row, (length, sequence) in enumerate(zip(PROMPTS, sequences, strict=True)):
        ids[row, geometry.pad_lens[row] :] = sequence[:length]
    return geometry, ids


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_length_dependent_rotary_through_a_paged_pool(
    variant: str,
    device: str,
    checkpoints: dict[str, Path],
    reference: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]],
) -> None:
    """The rows' own lengths hold through a paged pool too: the prefill straight into the blocks (each prompt's
    context on its own) and the paged decode kernel (each row's context in the step's groups)."""
    sequences, expected = reference[variant]
    stage = Stage(checkpoints[variant], (0, LAYERS), device)
    pool = stage.block_pool(block_size=4, max_blocks=32, slab_blocks=8)
    geometry, ids = _batch(sequences)
    cache = pool.cache(stage.kv_layout(len(PROMPTS), geometry.cur_len + DECODE), geometry.pad_lens)
    logits = stage.prefill(StageIO(input_ids=ids), cache.holding(geometry.cur_len), geometry).logits
    assert logits is not None
    want = torch.stack([expected[row][length - 1] for row, length in enumerate(PROMPTS)])
    torch.testing.assert_close(logits[:, 0].cpu(), want, atol=TOLERANCE, rtol=0)
    for step in range(DECODE):
        geometry = geometry.advance()
        tokens = torch.stack([s[length + step] for s, length in zip(sequences, PROMPTS, strict=True)]).view(-1, 1)
        logits = stage.decode_groups(StageIO(input_ids=tokens), [(cache, geometry)]).logits
        assert logits is not None
        want = torch.stack([expected[row][length + step] for row, length in enumerate(PROMPTS)])
        torch.testing.assert_close(logits[:, 0].cpu(), want, atol=TOLERANCE, rtol=0)
    cache.free()


def _hf_frequencies(folder: Path, seq_len: int | torch.Tensor | None) -> tuple[torch.Tensor, float]:
    config = AutoConfig.from_pretrained(folder)
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_frequencies_and_scaling_are_transformers_own_bit_for_bit(variant: str, checkpoints: dict[str, Path]) -> None:
    family = family_for(load_config(checkpoints[variant]))
    assert isinstance(family, Llama)
    rope = family.rope
    assert rope.kind == variant
    want, scaling = _hf_frequencies(checkpoints[variant], None)
    assert torch.equal(rope.inv_freq, want) and rope.scaling == scaling
    if variant == "dynamic":  # transformers passes the length as max(position_ids) + 1: an int64 tensor
        for seq_len in (9, 13, 300):
            scaled, _ = _hf_frequencies(checkpoints[variant], torch.tensor(seq_len))
            got = rope.inv_freq_for(seq_len, torch.device("cpu"))
            assert got is not None and torch.equal(got, scaled) and not torch.equal(got, want)
        assert rope.inv_freq_for(8, torch.device("cpu")) is None  # within max_position_embeddings
    elif variant == "longrope":
        long, _ = _hf_frequencies(checkpoints[variant], rope.original_max + 1)
        got = rope.inv_freq_for(rope.original_max + 1, torch.device("cpu"))
        assert got is not None and torch.equal(got, long) and not torch.equal(long, want)
        assert rope.inv_freq_for(rope.original_max, torch.device("cpu")) is None
    else:
        assert rope.inv_freq_for(10_000, torch.device("cpu")) is None


def test_the_table_and_a_call_s_angles_are_transformers_rotary_module(checkpoints: dict[str, Path]) -> None:
    """YaRN scales cos and sin (its attention factor): the table rows are transformers' rotary module's output,
    bit for bit, in both dtypes."""
    model = AutoModelForCausalLM.from_pretrained(checkpoints["yarn"]).eval()
    rope = family_for(load_config(checkpoints["yarn"])).rope  # type: ignore[attr-defined]
    assert rope.scaling > 1.0
    position_ids = torch.arange(300).unsqueeze(0)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dtype), position_ids)
        table_cos, table_sin = rope.table(300, torch.device("cpu"), dtype)
        half = rope.dim // 2
        assert torch.equal(table_cos[:300], cos[0])
        assert torch.equal(table_sin[:300, half:], sin[0, :, half:])
        assert torch.equal(table_sin[:300, :half], -sin[0, :, :half])  # rotate_half's sign lives in the table


def _config(rope: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"max_position_embeddings": 64, **extra} | rope


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (  # transformers 4's layout: rope_scaling with "type", rope_theta at the top level
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500.0},
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
        ),
        (  # the pretraining length at the top level wins, as in transformers
            {
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                "original_max_position_embeddings": 16,
            },
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
    ],
)
def test_older_configs_read_the_same(old: dict[str, Any], new: dict[str, Any]) -> None:
    a, b = Rotary(_config(old), 16), Rotary(_config(new), 16)
    assert a.kind == b.kind and torch.equal(a.inv_freq, b.inv_freq)
    assert not torch.equal(a.inv_freq, Rotary(_config({}), 16).inv_freq)


def test_phi3_names_longrope_su() -> None:
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    su = Rotary(_config({"rope_scaling": {"type": "su", **factors}}), 8, {"su": "longrope"}, 4096)
    assert su.kind == "longrope" and su.original_max == 4096

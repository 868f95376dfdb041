"""Stage slicing: only its own weights, tied heads, the KV layout, one position per decode step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dejavu_common.partition import split_layers
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from engine.tiny_models import FAMILIES, LAYERS

TOKEN_EMBEDDING = {
    "llama": "model.embed_tokens.weight",
    "opt": "model.decoder.embed_tokens.weight",
    "gpt2": "transformer.wte.weight",
    "bloom": "transformer.word_embeddings.weight",
}
LAYER_OF = re.compile(r"\.(?:layers|h)\.(\d+)\.")
FIRST_STAGE_ONLY = re.compile(r"embed|wte|wpe|word_embeddings|project_in")


def checkpoint_bytes(folder: Path) -> dict[str, int]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name).nbytes for name in f.keys()}  # noqa: SIM118


def expected_share(sizes: dict[str, int], layers: tuple[int, int], last: bool, tied_name: str | None) -> int:
    """Bytes a stage over ``layers`` must hold, derived from the checkpoint's names alone."""
    first = layers[0] == 0
    total = 0
    for name, size in sizes.items():
        match = LAYER_OF.search(name)
        if match:
            total += size if layers[0] <= int(match.group(1)) < layers[1] else 0
        elif FIRST_STAGE_ONLY.search(name):
            total += size if first else 0
        else:
            total += size if last else 0
    if tied_name is not None and last and not first:
        total += sizes[tied_name]
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_holds_exactly_its_share_of_the_weights(
    family: str, device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    folder = tiny_checkpoints[family]
    sizes = checkpoint_bytes(folder)
    for stages in (1, 2, 3):
        pipeline = Pipeline(folder, stages, device)
        tied = TOKEN_EMBEDDING[family] if pipeline.spec.tie_word_embeddings else None
        for stage in pipeline.stages:
            assert stage.param_bytes == expected_share(sizes, stage.layers, stage.is_last, tied), stage.layers
        if stages == 1:
            assert pipeline.stages[0].param_bytes == sum(sizes.values())


def test_tied_head_loads_the_embedding_on_the_last_stage(tiny_checkpoints: dict[str, Path]) -> None:
    folder = tiny_checkpoints["gpt2"]
    assert "lm_head.weight" not in checkpoint_bytes(folder)
    last = Stage(folder, (LAYERS - 1, LAYERS))
    assert set(last.weights) >= {TOKEN_EMBEDDING["gpt2"]} and "transformer.wpe.weight" not in last.weights


def test_split_layers_is_balanced_and_contiguous() -> None:
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]
    for bad in (0, 31):
        with pytest.raises(ValueError):
            split_layers(30, bad)


def test_kv_layout_and_a_decode_step_writes_exactly_one_position(
    device: str, tiny_checkpoints: dict[str, Path]
) -> None:
    stage = Stage(tiny_checkpoints["llama"], (1, 3), device)
    spec = stage.spec
    cache = stage.allocate_cache(batch=2, max_len=12)
    assert cache.k.shape == (2, 2, spec.num_kv_heads, 12, spec.head_dim) == cache.layout.shape
    assert cache.layout.layer_range == (1, 3)
    geometry = BatchGeometry.for_prompts([5, 3])
    hidden = torch.randn(2, 5, spec.hidden_size)
    stage.prefill(StageIO(hidden=hidden), cache, geometry)
    assert cache.k[:, :, :, 5:].abs().sum() == 0 and cache.k[:, :, :, :5].abs().sum() > 0
    before_k, before_v = cache.k.clone(), cache.v.clone()
    stage.decode(StageIO(hidden=torch.randn(2, 1, spec.hidden_size)), cache, geometry.advance())
    for now, before in ((cache.k, before_k), (cache.v, before_v)):
        changed = (now != before).any(dim=(0, 1, 2, 4)).nonzero().flatten().tolist()
        assert changed == [5]  # one shared position for all layers, rows and heads
        assert (now[:, :, :, 5] != 0).all()


def test_layer_hook_runs_after_each_layer_with_global_indices(device: str, tiny_checkpoints: dict[str, Path]) -> None:
    stage = Stage(tiny_checkpoints["opt"], (1, 3), device)
    cache = stage.allocate_cache(1, 4)
    seen: list[tuple[int, float]] = []

    def hook(layer: int) -> None:  # the layer's KV must already be written when the hook runs
        seen.append((layer, float(cache.k[cache.local(layer)].abs().sum())))

    stage.prefill(StageIO(hidden=torch.randn(1, 4, stage.spec.hidden_size)), cache, BatchGeometry((0,), 4), hook)
    assert [layer for layer, _ in seen] == [1, 2]
    assert all(total > 0 for _, total in seen)


def test_stage_rejects_wrong_inputs(tiny_checkpoints: dict[str, Path]) -> None:
    folder = tiny_checkpoints["bloom"]
    first, second = Stage(folder, (0, 1)), Stage(folder, (1, 3))
    cache = first.allocate_cache(1, 4)
    with pytest.raises(ValueError, match="input_ids"):
        first.forward(StageIO(hidden=torch.randn(1, 2, 64)), cache, BatchGeometry((0,), 2))
    with pytest.raises(ValueError, match="layers"):
        second.forward(StageIO(hidden=torch.randn(1, 2, 64)), cache, BatchGeometry((0,), 2))
    with pytest.raises(ValueError, match="max_len"):
        first.forward(StageIO(input_ids=torch.ones(1, 5, dtype=torch.long)), cache, BatchGeometry((0,), 5))
    with pytest.raises(ValueError, match="exactly one token"):
        first.decode(StageIO(input_ids=torch.ones(1, 2, dtype=torch.long)), cache, BatchGeometry((0,), 2))
    with pytest.raises(ValueError):
        Stage(folder, (2, 5))
    with pytest.raises(ValueError):
        StageIO()


def test_a_geometry_restricted_to_some_rows_keeps_their_pads_and_names_their_cache_rows() -> None:
    geometry = BatchGeometry.for_prompts([5, 9, 3, 9])
    assert geometry.only((0, 1, 2, 3)) is geometry  # every row: unchanged
    some = geometry.only((1, 3))
    assert (some.pad_lens, some.rows, some.cache_rows, some.cur_len) == ((0, 0), (1, 3), (1, 3), 9)
    assert some.advance().rows == (1, 3) and geometry.cache_rows == (0, 1, 2, 3)
    for bad in ((), (4,), (2, 1)):
        with pytest.raises(ValueError):
            geometry.only(bad)
    with pytest.raises(ValueError, match="every cache row"):
        some.only((1,))

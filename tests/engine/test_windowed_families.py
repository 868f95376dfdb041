"""Sliding-window attention and Gemma 2/3 equal transformers on tiny random checkpoints with a window of a few
positions (prompts longer than it, generation past it): Mistral and Phi-3 with ``sliding_window`` on every layer,
Qwen2 with ``use_sliding_window`` from ``max_window_layers`` on, Gemma 2 (soft-capped attention and final logits,
alternating windowed layers) and Gemma 3 (q/k norms, a local rotary base, a scaled global one). Every attention
path a stage runs applies the window: contiguous caches (a padded batch, a ragged prefill, decode steps), paged
caches, and passes of per-request slices (decodes, whole prompts, a chunk over its cached prefix), whole and split
into stages, on the host's path and the device-generic one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from dejavu_engine import native
from dejavu_engine.families import family_for
from dejavu_engine.geometry import BatchGeometry, Slice
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavulib.paged import BlockPool
from engine.tiny_models import LAYERS, build_checkpoint

TOLERANCE = 1e-4
WINDOW = 6
# family -> config overrides: a window narrower than the prompts.
WINDOWED: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}
_GEMMA_SHAPE: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 24,  # not head_dim, so that a scale of head_dim ** -0.5 would show
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
# Soft caps low enough to bend these random weights' logits; Gemma 2's default layers (windowed, full, windowed).
GEMMA: dict[str, Any] = {
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config(**_GEMMA_SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    ),
    "gemma3_text": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **_GEMMA_SHAPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
}
FAMILIES = (*WINDOWED, *GEMMA)
LENGTHS = (17, 11)  # a padded batch of two prompts, both past the window
STEPS = 7


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    folders = {family: build_checkpoint(family, root / family, overrides=o) for family, o in WINDOWED.items()}
    for family, (model_class, config) in GEMMA.items():
        torch.manual_seed(0)
        model = model_class(config).to(torch.float32).eval()
        with torch.no_grad():  # random weights; norms away from Gemma's zeros, so that (1 + weight) counts
            for name, param in model.named_parameters():
                param.uniform_(-0.5, 0.5) if "norm" in name else param.normal_(0.0, 0.15)
        model.save_pretrained(root / family, safe_serialization=True)
        folders[family] = root / family
    return folders


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, Any]:
    return {
        family: AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        for family, folder in checkpoints.items()
    }


def _sequences(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n + STEPS,), generator=generator).tolist() for n in LENGTHS]


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _stages(folder: Path, stages: int, path: str, device: str) -> list[Stage]:
    generic = path == "generic"
    return Pipeline(folder, stages, device, pack_gemms=not generic, native_attention=not generic).stages


def test_the_windowed_layers_are_read_from_the_config(checkpoints: dict[str, Path]) -> None:
    """transformers' own reading: every layer of Mistral and Phi-3, Qwen2's from ``max_window_layers`` on; a window
    of at least the model's positions drops nothing."""
    from dejavu_engine.weights import load_config

    layers = {family: sorted(family_for(load_config(folder)).windowed_layers) for family, folder in checkpoints.items()}
    every = list(range(LAYERS))
    assert layers == {"mistral": every, "phi3": every, "qwen2": [1, 2], "gemma2": [0, 2], "gemma3_text": [0, 2]}
    wide = load_config(checkpoints["mistral"]) | {"sliding_window": 256}
    assert family_for(wide).windowed_layers == frozenset()


def _run(stages: list[Stage], caches: list[Any], ids: torch.Tensor, geometry: BatchGeometry, **kw: Any) -> Any:
    io = StageIO(input_ids=ids)
    for stage, cache in zip(stages, caches, strict=True):
        io = stage.forward(io, cache, geometry, **kw)
    return io.logits


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_batch_prefills_and_decodes_past_the_window_as_transformers(
    family: str,
    stages: int,
    path: str,
    paged: bool,
    device: str,
    checkpoints: dict[str, Path],
    models: dict[str, Any],
) -> None:
    """Left-padded prompts (a ragged prefill on the host's path), then decode steps one token per row; each row's
    logits equal transformers' over that row's sequence alone."""
    seqs = _sequences(5)
    expected = [_reference(models[family], seq) for seq in seqs]
    pipeline = _stages(checkpoints[family], stages, path, device)
    geometry = BatchGeometry.for_prompts(list(LENGTHS))
    ids = torch.zeros(len(LENGTHS), geometry.cur_len, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        ids[row, geometry.pad_lens[row] :] = torch.tensor(seqs[row][:n])
    span = geometry.cur_len + STEPS
    if paged:
        pools = [s.block_pool(block_size=4, max_blocks=64, slab_blocks=8) for s in pipeline]
        caches: list[Any] = [
            pool.cache(s.kv_layout(len(LENGTHS), span), geometry.pad_lens).holding(geometry.cur_len)
            for s, pool in zip(pipeline, pools, strict=True)
        ]
    else:
        caches = [s.allocate_cache(len(LENGTHS), span) for s in pipeline]
    logits = _run(pipeline, caches, ids, geometry)
    for row, n in enumerate(LENGTHS):
        torch.testing.assert_close(logits[row, -1].cpu(), expected[row][n - 1], atol=TOLERANCE, rtol=0)
    for step in range(STEPS):
        geometry = geometry.advance()
        feed = torch.tensor([[seq[n + step]] for seq, n in zip(seqs, LENGTHS, strict=True)])
        logits = _run(pipeline, caches, feed, geometry)
        for row, n in enumerate(LENGTHS):
            torch.testing.assert_close(logits[row, 0].cpu(), expected[row][n + step], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_all_logits_of_a_prompt_equal_transformers(
    family: str, stages: int, path: str, device: str, checkpoints: dict[str, Path], models: dict[str, Any]
) -> None:
    """Every position of one unpadded prompt (the plain prefill) and the decode steps after it."""
    seq = _sequences(6)[0]
    expected = _reference(models[family], seq)
    pipeline = Pipeline(checkpoints[family], stages, device, pack_gemms=path == "host", native_attention=path == "host")
    caches = pipeline.allocate(1, len(seq))
    geometry = BatchGeometry((0,), LENGTHS[0])
    prefill = pipeline.forward(torch.tensor([seq[: LENGTHS[0]]]), caches, geometry, all_logits=True)
    torch.testing.assert_close(prefill[0].cpu(), expected[: LENGTHS[0]], atol=TOLERANCE, rtol=0)
    for t in range(LENGTHS[0], len(seq)):
        geometry = geometry.advance()
        logits = pipeline.forward(torch.tensor([[seq[t]]]), caches, geometry)
        torch.testing.assert_close(logits[0, 0].cpu(), expected[t], atol=TOLERANCE, rtol=0)


class _Blocks:
    """One request's blocks of a pool, taken in order as its positions grow."""

    def __init__(self, pool: BlockPool, first: int) -> None:
        self.pool, self.next, self.ids = pool, first, []

    def holding(self, end: int) -> tuple[int, ...]:
        while len(self.ids) * self.pool.geometry.block_size < end:
            self.ids.append(self.next)
            self.next += 1
        self.pool.ensure(self.ids)
        return tuple(self.ids)


@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_passes_of_slices_apply_the_window(
    family: str, stages: int, path: str, device: str, checkpoints: dict[str, Path], models: dict[str, Any]
) -> None:
    """Request A's prompt in chunks (5, 1, 6, then 5 over its cached prefix), B's whole prompt in A's last chunk's
    pass, then decode passes of both past the window: every token's logits equal transformers'."""
    a, b = _sequences(7)
    expected = {"a": _reference(models[family], a), "b": _reference(models[family], b)}
    pipeline = _stages(checkpoints[family], stages, path, device)
    pools = [s.block_pool(block_size=4, max_blocks=32, slab_blocks=8) for s in pipeline]
    blocks = {name: [_Blocks(pool, first) for pool in pools] for name, first in (("a", 0), ("b", 16))}
    seqs = {"a": a, "b": b}

    def run(feeds: list[tuple[str, int, int]]) -> None:
        io = StageIO(input_ids=torch.tensor([[t for name, s, n in feeds for t in seqs[name][s : s + n]]]))
        for k, (stage, pool) in enumerate(zip(pipeline, pools, strict=True)):
            pieces = [Slice(blocks[name][k].holding(s + n), s, n) for name, s, n in feeds]
            io = stage.forward_slices(io, pool, pieces, all_logits=True)
        got = io.logits[0].cpu().split([n for _, _, n in feeds])
        for logits, (name, s, n) in zip(got, feeds, strict=True):
            torch.testing.assert_close(logits, expected[name][s : s + n], atol=TOLERANCE, rtol=0)

    run([("a", 0, 5)])
    run([("a", 5, 1)])
    run([("a", 6, 6)])
    run([("a", 12, 5), ("b", 0, LENGTHS[1])])
    for step in range(STEPS):
        run([("a", LENGTHS[0] + step, 1), ("b", LENGTHS[1] + step, 1)])


def test_a_windowed_stage_decodes_natively_and_prefills_through_torch(checkpoints: dict[str, Path]) -> None:
    """Where the host has the kernels: a stage with a windowed layer decodes in the native kernels (each row's span
    cut to the window in its windowed layers) and prefills through torch (the prefill kernels take no window);
    Qwen2's layer 0 attends fully, so a stage of it alone prefills natively too. Gemma 2 soft-caps every layer's
    logits: torch's attention throughout."""
    kernels = native.load() is not None
    full, windowed = Stage(checkpoints["qwen2"], (0, 1)), Stage(checkpoints["qwen2"], (1, LAYERS))
    assert windowed.windowed and windowed.native_attention == kernels and windowed.paged_attention == kernels
    assert not windowed.prefills_into_blocks and not windowed.native_slices
    assert not full.windowed and full.native_attention == kernels and full.prefills_into_blocks == kernels
    assert not Stage(checkpoints["gemma2"], (1, 2)).native_attention
    gemma3 = Stage(checkpoints["gemma3_text"], (0, LAYERS))
    assert gemma3.native_attention == kernels and not gemma3.prefills_into_blocks
    if kernels:  # a decode step's windowed spans start at most WINDOW positions before its end
        geometry = BatchGeometry((0, 9), 20)
        ctx = windowed.family.context(geometry, 1, torch.device("cpu"), torch.float32)
        cache = windowed.allocate_cache(2, 20)
        ctx = windowed._natively(ctx, [ctx], [cache])
        assert ctx.spans is not None and ctx.window_spans is not None
        assert ctx.spans[:, 2:].tolist() == [[0, 20], [9, 20]]
        assert ctx.window_spans[:, 2:].tolist() == [[20 - WINDOW, 20], [20 - WINDOW, 20]]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_decode_of_two_microbatches_applies_the_window(
    family: str,
    stages: int,
    path: str,
    paged: bool,
    device: str,
    checkpoints: dict[str, Path],
    models: dict[str, Any],
) -> None:
    """Two microbatches of one prompt each (17 and 11 tokens), then decode steps of both in one call per stage
    (:meth:`Stage.decode_groups`): each row attends within the window over its own cache."""
    seqs = _sequences(8)
    expected = [_reference(models[family], seq) for seq in seqs]
    pipeline = _stages(checkpoints[family], stages, path, device)
    pools = [s.block_pool(block_size=4, max_blocks=64, slab_blocks=8) for s in pipeline]
    groups = []
    for seq, n in zip(seqs, LENGTHS, strict=True):
        geometry = BatchGeometry((0,), n)
        if paged:
            caches: list[Any] = [
                pool.cache(s.kv_layout(1, n + STEPS), (0,)).holding(n) for s, pool in zip(pipeline, pools, strict=True)
            ]
        else:
            caches = [s.allocate_cache(1, n + STEPS) for s in pipeline]
        _run(pipeline, caches, torch.tensor([seq[:n]]), geometry)
        groups.append([caches, geometry])
    for step in range(STEPS):
        for group in groups:
            group[1] = group[1].advance()
        io = StageIO(input_ids=torch.tensor([[seq[n + step]] for seq, n in zip(seqs, LENGTHS, strict=True)]))
        for k, stage in enumerate(pipeline):
            io = stage.decode_groups(io, [(caches[k], geometry) for caches, geometry in groups])
        for row, n in enumerate(LENGTHS):
            torch.testing.assert_close(io.logits[row, 0].cpu(), expected[row][n + step], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_rounds_as_transformers_in_bfloat16(family: str, device: str, checkpoints: dict[str, Path]) -> None:
    """In bfloat16, split in 2 stages on the device-generic path (torch's ops, as transformers runs them), a prompt
    and decode steps past the window give transformers' bfloat16 logits (its SDPA attention; Gemma 2's eager one,
    which soft-caps) to the last bit on the CPU: every rounding is the same."""
    if torch.device(device).type != "cpu":
        pytest.skip("transformers' reference runs on the CPU: another device's bfloat16 attention rounds otherwise")
    implementation = "eager" if family == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        checkpoints[family], attn_implementation=implementation, dtype=torch.bfloat16
    ).eval()
    seq = _sequences(9)[0]
    with torch.no_grad():
        expected = model(torch.tensor([seq])).logits[0].float()
    pipeline = Pipeline(checkpoints[family], 2, device, "bfloat16", pack_gemms=False, native_attention=False)
    caches = pipeline.allocate(1, len(seq))
    geometry = BatchGeometry((0,), LENGTHS[0])
    prefill = pipeline.forward(torch.tensor([seq[: LENGTHS[0]]]), caches, geometry, all_logits=True)
    torch.testing.assert_close(prefill[0], expected[: LENGTHS[0]], atol=0, rtol=0)
    for t in range(LENGTHS[0], len(seq)):
        geometry = geometry.advance()
        logits = pipeline.forward(torch.tensor([[seq[t]]]), caches, geometry)
        torch.testing.assert_close(logits[0, 0], expected[t], atol=0, rtol=0)

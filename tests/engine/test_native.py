"""The native kernels compute what torch's attention (and float64) computes: decode rows over contiguous or paged
caches, whole prompts, prompt chunks over their cached prefix in a paged cache, the writes into blocks, the
pointwise ops; and a stage using them computes what a stage without them computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dejavu_engine import native
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from engine.tiny_models import FAMILIES


def reference(q, k_new, v_new, k_caches, v_caches, rows, scale):
    """Torch's attention of each row alone, after writing its new K/V (on copies of the caches)."""
    k_caches = [k.clone() for k in k_caches]
    v_caches = [v.clone() for v in v_caches]
    outs = []
    for r, (g, i, start, end) in enumerate(rows.tolist()):
        k_caches[g][i, :, end - 1] = k_new[r]
        v_caches[g][i, :, end - 1] = v_new[r]
        k = k_caches[g][i : i + 1, :, start:end]
        v = v_caches[g][i : i + 1, :, start:end]
        out = F.scaled_dot_product_attention(q[r : r + 1].unsqueeze(2), k, v, scale=scale, enable_gqa=True)
        outs.append(out[0, :, 0])
    return torch.stack(outs), k_caches, v_caches


# head_dim 64 and 128 take the vectorised path on AVX2 hosts, 24 the generic one.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 24), (8, 2, 128)])
def test_rows_of_many_caches_attend_as_each_alone(heads: int, kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(heads * head_dim)
    sizes, max_len = [1, 3, 2], 40
    k_caches = [torch.randn(b, kv_heads, max_len, head_dim, generator=generator) for b in sizes]
    v_caches = [torch.randn(b, kv_heads, max_len, head_dim, generator=generator) for b in sizes]
    spans = [(0, 0, 0, 1), (1, 0, 3, 17), (1, 1, 0, 17), (1, 2, 16, 17), (2, 0, 5, 40), (2, 1, 0, 33)]
    rows = torch.tensor(spans, dtype=torch.long)
    q = torch.randn(len(spans), heads, head_dim, generator=generator) * 4  # peaked softmaxes too
    k_new = torch.randn(len(spans), kv_heads, head_dim, generator=generator)
    v_new = torch.randn(len(spans), kv_heads, head_dim, generator=generator)
    expected, k_after, v_after = reference(q, k_new, v_new, k_caches, v_caches, rows, 0.1)
    out = native.decode_attention(q, k_new, v_new, k_caches, v_caches, rows, 0.1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    for mine, theirs in zip(k_caches + v_caches, k_after + v_after, strict=True):
        assert torch.equal(mine, theirs)  # the new K/V landed where each row's span ends, nothing else moved


@pytest.mark.parametrize(
    ("span", "message"),
    [((0, 0, 0, 41), "bad span"), ((0, 0, 5, 5), "bad span"), ((1, 0, 0, 4), "no group"), ((0, 2, 0, 4), "no row")],
)
def test_a_span_outside_the_caches_is_refused_before_anything_is_read(span: tuple[int, ...], message: str) -> None:
    k = torch.zeros(2, 1, 40, 8)
    v = torch.zeros(2, 1, 40, 8)
    rows = torch.tensor([span], dtype=torch.long)
    with pytest.raises(RuntimeError, match=message):
        native.decode_attention(torch.zeros(1, 1, 8), torch.ones(1, 1, 8), torch.ones(1, 1, 8), [k], [v], rows, 1.0)
    assert not k.any() and not v.any()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bloom"])  # ALiBi biases stay on torch's path
def test_a_stage_decodes_the_same_with_and_without_the_kernel(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    folder = tiny_checkpoints[family]
    fast, plain = Stage(folder, (0, 2)), Stage(folder, (0, 2), native_attention=False)
    assert fast.native_attention and not plain.native_attention
    lengths = [[9, 4], [3], [6, 6, 2]]
    outputs = []
    for stage in (fast, plain):
        groups, tokens = [], []
        for prompt_lens in lengths:
            geometry = BatchGeometry.for_prompts(prompt_lens)
            cache = stage.allocate_cache(len(prompt_lens), geometry.cur_len + 3)
            seeded = torch.Generator().manual_seed(3)
            ids = torch.randint(3, 300, (len(prompt_lens), geometry.cur_len), generator=seeded)
            stage.prefill(StageIO(input_ids=ids), cache, geometry)
            groups.append((cache, geometry))
            tokens += [[7 + len(prompt_lens)]] * len(prompt_lens)
        steps = []
        for _ in range(3):
            groups = [(cache, geometry.advance()) for cache, geometry in groups]
            out = stage.decode_groups(StageIO(input_ids=torch.tensor(tokens)), groups)
            steps.append(out.hidden)
        outputs.append(steps)
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_host_that_cannot_build_the_kernel_decodes_with_torch(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoints: dict[str, Path]
) -> None:
    def no_compiler() -> None:
        raise OSError("g++: not found")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_build", no_compiler)
    stage = Stage(tiny_checkpoints["llama"], (0, 2))
    assert not stage.native_attention
    geometry = BatchGeometry.for_prompts([4])
    cache = stage.allocate_cache(1, 6)
    stage.prefill(StageIO(input_ids=torch.tensor([[5, 6, 7, 8]])), cache, geometry)
    out = stage.decode(StageIO(input_ids=torch.tensor([[9]])), cache, geometry.advance())
    assert out.hidden is not None and torch.isfinite(out.hidden).all()


@pytest.fixture
def kernels() -> None:
    """Skips a test of the kernels themselves where they cannot be built (no compiler)."""
    if native.load() is None:
        pytest.skip("native kernels cannot be built here")


def paged_reference(q, k_new, v_new, k_slabs, v_slabs, tables, spans, scale):
    """Each row's K/V gathered position by position through its table after every row's write (on
    copies of the slabs), then softmax attention in float64."""
    k_slabs = [k.clone() for k in k_slabs]
    v_slabs = [v.clone() for v in v_slabs]
    slab_blocks, kv_heads, block_size, _ = k_slabs[0].shape
    g = q.shape[1] // kv_heads

    def slot(r: int, pos: int) -> tuple[int, int, int]:
        b = int(tables[r, pos // block_size])
        return b // slab_blocks, b % slab_blocks, pos % block_size

    for r, (_, end) in enumerate(spans.tolist()):
        s, i, o = slot(r, end - 1)
        k_slabs[s][i, :, o] = k_new[r]
        v_slabs[s][i, :, o] = v_new[r]
    outs = []
    for r, (start, end) in enumerate(spans.tolist()):
        where = [slot(r, pos) for pos in range(start, end)]
        k = torch.stack([k_slabs[s][i, :, o] for s, i, o in where], dim=1).double().repeat_interleave(g, 0)
        v = torch.stack([v_slabs[s][i, :, o] for s, i, o in where], dim=1).double().repeat_interleave(g, 0)
        p = (torch.einsum("hd,hnd->hn", q[r].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hn,hnd->hd", p, v).float())
    return torch.stack(outs), k_slabs, v_slabs


def paged_case(heads, kv_heads, head_dim, block_size, spans, *, slab_blocks=40, seed=0):
    """Random q, new K/V and two slabs; each row's touched blocks get distinct ids drawn at random from
    both slabs (so a row's blocks are not contiguous), the blocks it does not touch -1."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(end for _, end in spans) // block_size + 1
    k_slabs = [torch.randn(slab_blocks, kv_heads, block_size, head_dim, generator=generator) for _ in range(2)]
    v_slabs = [torch.randn(slab_blocks, kv_heads, block_size, head_dim, generator=generator) for _ in range(2)]
    ids = iter(torch.randperm(2 * slab_blocks, generator=generator).tolist())
    tables = torch.full((len(spans), max_blocks), -1, dtype=torch.long)
    for r, (start, end) in enumerate(spans):
        for lb in range(start // block_size, (end - 1) // block_size + 1):
            tables[r, lb] = next(ids)
    q = torch.randn(len(spans), heads, head_dim, generator=generator) * 4  # peaked softmaxes too
    k_new = torch.randn(len(spans), kv_heads, head_dim, generator=generator)
    v_new = torch.randn(len(spans), kv_heads, head_dim, generator=generator)
    return q, k_new, v_new, k_slabs, v_slabs, tables, torch.tensor(spans, dtype=torch.long)


# head_dim 64 and 128 take the vectorised path on AVX2 hosts, 32 the generic one.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(6, 3, 64, 16), (4, 4, 64, 4), (6, 3, 32, 4), (4, 4, 32, 16), (8, 2, 128, 16)],
)
@pytest.mark.usefixtures("kernels")
def test_paged_rows_attend_as_each_alone(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    # One position; left padding (start not block-aligned) ending mid-block; ending on a block's end;
    # one position mid-block; long, from 0; rows of different lengths in one call.
    spans = [(0, 1), (5, 37), (0, 32), (13, 14), (3, 50), (0, 47)]
    case = paged_case(heads, kv_heads, head_dim, block_size, spans, seed=heads * head_dim + block_size)
    k_slabs, v_slabs, tables = case[3], case[4], case[5]
    used = tables[tables >= 0]
    assert (used < 40).any() and (used >= 40).any()  # both slabs are read
    expected, k_after, v_after = paged_reference(*case, 0.1)
    out = native.paged_decode_attention(*case, 0.1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    for mine, theirs in zip(k_slabs + v_slabs, k_after + v_after, strict=True):
        assert torch.equal(mine, theirs)  # the new K/V landed where each row's span ends, nothing else moved


@pytest.mark.usefixtures("kernels")
def test_paged_new_kv_land_in_their_slot_and_nowhere_else() -> None:
    kv_heads, head_dim, block_size, slab_blocks = 2, 64, 4, 16
    spans = [(0, 1), (2, 9), (4, 8), (1, 16), (6, 7), (0, 13)] * 2  # enough (row, kv head) items for both threads
    k_slabs = [torch.zeros(slab_blocks, kv_heads, block_size, head_dim) for _ in range(2)]
    v_slabs = [torch.zeros(slab_blocks, kv_heads, block_size, head_dim) for _ in range(2)]
    tables = torch.full((len(spans), 4), -1, dtype=torch.long)
    ids = iter(torch.randperm(2 * slab_blocks, generator=torch.Generator().manual_seed(1)).tolist())
    for r, (start, end) in enumerate(spans):
        for lb in range(start // block_size, (end - 1) // block_size + 1):
            tables[r, lb] = next(ids)
    k_new = torch.arange(1, len(spans) * kv_heads * head_dim + 1, dtype=torch.float32).view(len(spans), kv_heads, -1)
    v_new = -k_new
    q = torch.zeros(len(spans), 2 * kv_heads, head_dim)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native.paged_decode_attention(q, k_new, v_new, k_slabs, v_slabs, tables, torch.tensor(spans), 1.0)
    finally:
        torch.set_num_threads(threads)
    # The layout as documented: (slab s, index i, kv head kh, position o, dim e) is flat element
    # ((i * kv_heads + kh) * block_size + o) * head_dim + e of slab s.
    k_flat = [k.flatten() for k in k_slabs]
    v_flat = [v.flatten() for v in v_slabs]
    for r, (_, end) in enumerate(spans):
        b = int(tables[r, (end - 1) // block_size])
        s, i, o = b // slab_blocks, b % slab_blocks, (end - 1) % block_size
        for kh in range(kv_heads):
            at = ((i * kv_heads + kh) * block_size + o) * head_dim
            assert torch.equal(k_flat[s][at : at + head_dim], k_new[r, kh])
            assert torch.equal(v_flat[s][at : at + head_dim], v_new[r, kh])
    written = len(spans) * kv_heads * head_dim
    assert sum(int(k.count_nonzero()) for k in k_slabs) == written
    assert sum(int(v.count_nonzero()) for v in v_slabs) == written


def _bad(case: tuple, **change) -> tuple:
    names = ("q", "k_new", "v_new", "k_slabs", "v_slabs", "tables", "spans")
    return tuple(change.get(name, value) for name, value in zip(names, case, strict=True))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tables": torch.tensor([[4, -1, 9], [2, 3, 5]])}, "logical block 1 is block -1"),
        ({"tables": torch.tensor([[4, 6, 9], [2, 3, 16]])}, "logical block 2 is block 16"),
        ({"tables": torch.tensor([[4, 6, 9], [-2, 3, 5]])}, "logical block 0 is block -2"),
        ({"spans": torch.tensor([[1, 10], [0, 13]])}, "bad span"),  # past the table's 3 blocks of 4
        ({"spans": torch.tensor([[1, 10], [5, 5]])}, "bad span"),
        ({"spans": torch.tensor([[-1, 10], [0, 9]])}, "bad span"),
        ({"spans": torch.tensor([[1, 10]])}, "spans"),
        ({"spans": torch.tensor([[1, 10], [0, 9]], dtype=torch.int32)}, "spans"),
        ({"tables": torch.tensor([[4, 6, 9], [2, 3, 5]], dtype=torch.int32)}, "tables"),
        ({"tables": torch.tensor([4, 6, 9])}, "tables"),
        ({"q": torch.zeros(2, 4, 8, dtype=torch.float64)}, "float32 or bfloat16 only"),
        ({"q": torch.zeros(2, 8, 4).transpose(1, 2)}, "q:"),
        ({"q": torch.zeros(2, 3, 8)}, "multiple of kv_heads"),
        ({"q": torch.zeros(2, 4, 16)}, "head_dim"),
        ({"k_new": torch.zeros(2, 2, 8, dtype=torch.float64)}, "new k is Double"),
        ({"v_new": torch.zeros(2, 2, 8, dtype=torch.bfloat16)}, "new v is BFloat16, not Float"),
        ({"v_new": torch.zeros(2, 1, 8)}, "new k/v"),
        ({"k_slabs": [torch.zeros(8, 2, 4, 8, dtype=torch.float64)] * 2}, "a k slab is Double"),
        ({"v_slabs": [torch.zeros(8, 2, 4, 8, dtype=torch.bfloat16)] * 2}, "one dtype"),
        ({"v_slabs": [torch.zeros(8, 2, 4, 8), torch.zeros(9, 2, 4, 8)]}, "shape of the first"),
        ({"k_slabs": [torch.zeros(8, 2, 4, 8)], "v_slabs": [torch.zeros(8, 2, 4, 8)]}, "logical block 2 is block 9"),
        ({"k_slabs": [], "v_slabs": []}, "at least one"),
    ],
)
@pytest.mark.usefixtures("kernels")
def test_paged_bad_arguments_are_refused_before_anything_is_written(change: dict, message: str) -> None:
    # Two slabs of 8 blocks of 4 positions, 2 kv heads of 8 dims, 4 q heads; tables of 3 blocks.
    k_slabs = [torch.zeros(8, 2, 4, 8) for _ in range(2)]
    v_slabs = [torch.zeros(8, 2, 4, 8) for _ in range(2)]
    tables = torch.tensor([[4, 6, 9], [2, 3, 5]])
    spans = torch.tensor([[1, 10], [0, 9]])
    case = (torch.zeros(2, 4, 8), torch.ones(2, 2, 8), torch.ones(2, 2, 8), k_slabs, v_slabs, tables, spans)
    native.paged_decode_attention(*case, 1.0)  # the unchanged case is fine
    for slab in k_slabs + v_slabs:
        slab.zero_()
    with pytest.raises(RuntimeError, match=message):
        native.paged_decode_attention(*_bad(case, **change), 1.0)
    assert not any(slab.any() for slab in k_slabs + v_slabs)


def _bf16(case: tuple) -> tuple:
    return tuple(
        [t.bfloat16() for t in x] if isinstance(x, list) else x.bfloat16() if x.is_floating_point() else x for x in case
    )


# bfloat16: keys, values and queries are read as they are stored (widened exactly), scores and sums are
# float32 (on a CPU with bfloat16 dot products each unnormalised probability is rounded to bfloat16 before it
# weighs the values, as torch does: see the next tests), and the output is rounded once; so the kernel is
# within about one bfloat16 rounding (2^-8 relative) of float64 attention over the same bfloat16 values, and
# the new K/V are stored bit for bit.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (6, 3, 32, 4)])
@pytest.mark.usefixtures("kernels")
def test_paged_bfloat16_rows_attend_as_float64_over_the_same_values(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    spans = [(0, 1), (5, 37), (0, 32), (13, 14), (3, 50), (0, 47)]
    case = _bf16(paged_case(heads, kv_heads, head_dim, block_size, spans, seed=7 * head_dim + block_size))
    expected, k_after, v_after = paged_reference(*case, 0.1)
    out = native.paged_decode_attention(*case, 0.1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=2**-8)
    for mine, theirs in zip(case[3] + case[4], k_after + v_after, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.usefixtures("kernels")
def test_bfloat16_rows_of_many_caches_attend_as_each_alone() -> None:
    generator = torch.Generator().manual_seed(5)
    sizes, max_len, heads, kv_heads, head_dim = [1, 3], 40, 9, 3, 64
    k_caches = [torch.randn(b, kv_heads, max_len, head_dim, generator=generator).bfloat16() for b in sizes]
    v_caches = [torch.randn(b, kv_heads, max_len, head_dim, generator=generator).bfloat16() for b in sizes]
    rows = torch.tensor([(0, 0, 0, 1), (1, 0, 3, 17), (1, 2, 0, 40)], dtype=torch.long)
    q = (torch.randn(3, heads, head_dim, generator=generator) * 4).bfloat16()
    k_new = torch.randn(3, kv_heads, head_dim, generator=generator).bfloat16()
    v_new = torch.randn(3, kv_heads, head_dim, generator=generator).bfloat16()
    expected, k_after, v_after = reference(
        q.double(),
        k_new.double(),
        v_new.double(),
        [k.double() for k in k_caches],
        [v.double() for v in v_caches],
        rows,
        0.1,
    )
    out = native.decode_attention(q, k_new, v_new, k_caches, v_caches, rows, 0.1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=2**-8)
    for mine, theirs in zip(k_caches + v_caches, k_after + v_after, strict=True):
        assert torch.equal(mine.double(), theirs)


def _sdpa_rows(q, k_rows, v_rows, scale):
    """Each row's one query through torch's SDPA over its own keys and values (``[kv_heads, n, head_dim]``),
    in q's dtype."""
    return torch.stack(
        [
            F.scaled_dot_product_attention(qr[:, None].unsqueeze(0), k[None], v[None], scale=scale, enable_gqa=True)[
                0, :, 0
            ]
            for qr, k, v in zip(q, k_rows, v_rows, strict=True)
        ]
    )


# Where the CPU has bfloat16 dot products (AVX512-BF16), bfloat16 decode rounds each unnormalised probability to
# bfloat16 before it weighs the values, as torch's CPU attention does; the bounds are those of the prefill test
# below (elsewhere the kernel keeps float32 probabilities, which the float64 tests above bound).
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.usefixtures("kernels")
def test_bfloat16_decode_rounds_where_torch_does(paged: bool) -> None:
    if "avx512_bf16" not in native._cpu_flags().split():
        pytest.skip("no bfloat16 dot products on this CPU")
    spans = [(0, 300), (5, 37), (3, 50), (0, 47), (13, 14), (7, 260)]
    q, k_new, v_new, k_slabs, v_slabs, tables, spans_t = _bf16(paged_case(9, 3, 64, 16, spans, slab_blocks=60, seed=3))
    _, k_after, v_after = paged_reference(q, k_new, v_new, k_slabs, v_slabs, tables, spans_t, 0.125)
    slab_blocks, _, block_size, _ = k_slabs[0].shape

    def rows_of(slabs):  # each row's positions [start, end), gathered through its table: [kv_heads, n, head_dim]
        out = []
        for r, (start, end) in enumerate(spans):
            ids = [int(tables[r, p // block_size]) for p in range(start, end)]
            out.append(torch.stack([slabs[b // slab_blocks][b % slab_blocks, :, p % block_size]
                                    for b, p in zip(ids, range(start, end), strict=True)], dim=1))  # fmt: skip
        return out

    k_rows, v_rows = rows_of(k_after), rows_of(v_after)
    if paged:
        out = native.paged_decode_attention(q, k_new, v_new, k_slabs, v_slabs, tables, spans_t, 0.125)
    else:  # each row its own contiguous cache of its positions, the last one left for the kernel to write
        k_caches = [k.unsqueeze(0).clone() for k in k_rows]
        v_caches = [v.unsqueeze(0).clone() for v in v_rows]
        for cache in k_caches + v_caches:
            cache[0, :, -1] = 0
        rows = torch.tensor([(i, 0, 0, k.shape[1]) for i, k in enumerate(k_rows)], dtype=torch.long)
        out = native.decode_attention(q, k_new, v_new, k_caches, v_caches, rows, 0.125)
        assert all(torch.equal(c[0], k) for c, k in zip(k_caches + v_caches, k_rows + v_rows, strict=True))
    assert out.dtype == torch.bfloat16
    out, theirs = out.float(), _sdpa_rows(q, k_rows, v_rows, 0.125).float()
    exact = _sdpa_rows(q.double(), [k.double() for k in k_rows], [v.double() for v in v_rows], 0.125).float()
    assert (out == theirs).float().mean() > 0.9
    assert (out - theirs).abs().max() <= 2**-8 * max(float(v.float().abs().max()) for v in v_rows)
    assert (out - exact).abs().mean() <= 1.1 * (theirs - exact).abs().mean()


def prefill_case(heads, kv_heads, head_dim, lengths, *, gap=0, seed=0):
    """q, k, v as strided views of one fused projection ``[tokens, heads + 2 kv_heads, head_dim]`` (as the
    engine passes them), and the segments: prompts of ``lengths`` back to back, ``gap`` tokens in none after
    the first."""
    generator = torch.Generator().manual_seed(seed)
    segments, offset = [], 0
    for i, length in enumerate(lengths):
        segments.append((offset, length))
        offset += length + (gap if i == 0 else 0)
    fused = torch.randn(offset, heads + 2 * kv_heads, head_dim, generator=generator) * 2
    q, k, v = fused[:, :heads], fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :]
    return q, k, v, torch.tensor(segments, dtype=torch.long)


def prefill_reference(q, k, v, segments, scale):
    """Each segment alone through torch's SDPA (is_causal), in q's dtype; 0 for tokens in no segment."""
    out = torch.zeros_like(q)
    for offset, length in segments.tolist():
        part = [t[offset : offset + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*part, is_causal=True, scale=scale, enable_gqa=True)
        out[offset : offset + length] = attended[0].transpose(0, 1)
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (8, 2, 128), (6, 3, 24)])
@pytest.mark.usefixtures("kernels")
def test_prefill_segments_attend_causally_over_their_own_tokens(heads: int, kv_heads: int, head_dim: int) -> None:
    q, k, v, segments = prefill_case(heads, kv_heads, head_dim, [1, 5, 17, 40, 33, 70], gap=3, seed=head_dim)
    out = native.prefill_attention(q, k, v, segments, 0.1)
    assert out.shape == q.shape and out.is_contiguous()
    expected = prefill_reference(q.double(), k.double(), v.double(), segments, 0.1)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    assert not out[1:4].any()  # the gap's tokens belong to no prompt


# bfloat16: queries, keys and values are read as stored, scores and sums are float32, and each unnormalised
# probability is rounded to bfloat16 before it weighs the values, as torch's CPU flash attention does; so the
# kernel equals torch's bfloat16 attention on almost every output, differs elsewhere by less than one bfloat16
# step of the values it sums (those sums cancel: the result can be far smaller than its terms), and is as
# close to float64 attention over the same values as torch is. On a CPU with bfloat16 dot products, head dims
# that are a multiple of 32 (up to 128) run on them (odd segment lengths pair a last token with zeros); 16 and
# 24 take the widening loops. A gap's tokens (in no segment) hold NaN here, and nothing of them may leak.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "lengths"),
    [
        (9, 3, 64, [256]),
        (9, 3, 64, [3, 40, 129, 16]),
        (8, 2, 128, [1, 33, 70, 5]),
        (6, 3, 32, [17, 64, 2]),
        (4, 2, 96, [31, 48]),
        (4, 2, 16, [9, 40]),
        (6, 3, 24, [3, 40]),
    ],
)
@pytest.mark.usefixtures("kernels")
def test_bfloat16_prefill_rounds_where_torch_does(heads: int, kv_heads: int, head_dim: int, lengths: list[int]) -> None:
    case = prefill_case(heads, kv_heads, head_dim, lengths, gap=3, seed=head_dim + len(lengths))
    q, k, v, segments = (t.bfloat16() if t.is_floating_point() else t for t in case)
    gap = slice(lengths[0], lengths[0] + 3)
    for t in (q, k, v):
        t[gap] = float("nan")
    out = native.prefill_attention(q, k, v, segments, head_dim**-0.5)
    assert out.dtype == torch.bfloat16
    assert not out[gap].any()
    out, theirs = out.float(), prefill_reference(q, k, v, segments, head_dim**-0.5).float()
    exact = prefill_reference(q.double(), k.double(), v.double(), segments, head_dim**-0.5).float()
    covered = torch.ones(len(q), dtype=torch.bool)
    covered[gap] = False
    out, theirs, exact = out[covered], theirs[covered], exact[covered]
    assert (out == theirs).float().mean() > 0.9
    assert (out - theirs).abs().max() <= 2**-8 * v[covered].float().abs().max()
    assert (out - exact).abs().mean() <= 1.1 * (theirs - exact).abs().mean()


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([(0, 5), (4, 3)], "in an earlier segment"),
        ([(0, 5), (6, 3)], "not within"),
        ([(2, 0)], "not within"),
        ([(-1, 2)], "not within"),
    ],
)
@pytest.mark.usefixtures("kernels")
def test_prefill_bad_segments_are_refused(segments: list[tuple[int, int]], message: str) -> None:
    q, k, v, _ = prefill_case(4, 2, 16, [8])
    with pytest.raises(RuntimeError, match=message):
        native.prefill_attention(q, k, v, torch.tensor(segments, dtype=torch.long), 0.1)


@pytest.mark.usefixtures("kernels")
def test_prefill_tensors_of_two_dtypes_are_refused() -> None:
    q, k, v, segments = prefill_case(4, 2, 16, [8])
    with pytest.raises(RuntimeError, match="one dtype"):
        native.prefill_attention(q, k.bfloat16(), v, segments, 0.1)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bloom"])  # ALiBi biases stay on torch's path
@pytest.mark.parametrize("prompt_lens", [[11], [7, 7], [9, 4, 1]])  # alone, unpadded batch, ragged (padded)
def test_a_stage_prefills_the_same_with_and_without_the_kernel(
    family: str, prompt_lens: list[int], tiny_checkpoints: dict[str, Path]
) -> None:
    folder = tiny_checkpoints[family]
    fast, plain = Stage(folder, (0, 2)), Stage(folder, (0, 2), native_attention=False)
    geometry = BatchGeometry.for_prompts(prompt_lens)
    ids = torch.randint(3, 300, (len(prompt_lens), geometry.cur_len), generator=torch.Generator().manual_seed(4))
    outputs = []
    for stage in (fast, plain):
        cache = stage.allocate_cache(len(prompt_lens), geometry.cur_len)
        hidden = stage.prefill(StageIO(input_ids=ids), cache, geometry).hidden
        outputs.append((hidden, cache.k, cache.v))
    (hidden, k, v), (hidden_plain, k_plain, v_plain) = outputs
    torch.testing.assert_close(hidden, hidden_plain, atol=1e-4, rtol=0)
    for mine, theirs in zip(k + v, k_plain + v_plain, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("flags", "dtype", "from_len"),
    [
        ("fpu avx512f avx512_bf16", torch.bfloat16, None),  # AVX512-BF16 dot products, no matrix units
        ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", torch.bfloat16, native.AMX_TORCH_PREFILL_FROM),
        ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", torch.float32, None),  # AMX has no float32 tiles
        ("fpu avx2 fma", torch.float32, None),
    ],
)
def test_long_bfloat16_prompts_go_to_torch_on_amx_only(
    flags: str, dtype: torch.dtype, from_len: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_cpu_flag_set", lambda: frozenset(flags.split()))
    assert native.torch_prefill_from(dtype) == from_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("from_len", [1, 7, None], ids=["all-torch", "split", "all-kernel"])
def test_prompts_split_between_the_kernel_and_torch_attend_as_either_alone(
    dtype: torch.dtype, from_len: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose prompts go partly to torch's flash attention (from ``from_len`` tokens on) computes what the
    kernel computes for every prompt, each prompt over its own tokens, from q/k/v views of one projection."""
    from dejavu_engine.attention import _prefill_native

    generator = torch.Generator().manual_seed(6)
    lengths, heads, kv_heads, head_dim = [5, 12, 1, 9], 6, 2, 32
    n = sum(lengths)
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(1, n, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    segments = list(zip(offsets, lengths, strict=True))
    monkeypatch.setattr(native, "torch_prefill_from", lambda _dtype: None)
    want = _prefill_native(q, k, v, segments, None)
    monkeypatch.setattr(native, "torch_prefill_from", lambda _dtype: from_len)
    got = _prefill_native(q, k, v, segments, None)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


def _torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


# 576 and 1536 are SmolLM2's widths (whole vectors); 37 leaves a tail to the scalar loop.
@pytest.mark.parametrize("shape", [(16, 1, 576), (1, 300, 576), (3, 7, 37), (5, 1536)])
def test_pointwise_ops_compute_what_torch_computes(kernels: None, shape: tuple[int, ...]) -> None:
    """bfloat16: transformers' values, each rounded where torch rounds (where a float32 difference below, in
    the order of a sum or e^x's last bit, tips a rounding: one step, two after the next rounding). float32:
    within float32 rounding of them, and no further from float64 than torch."""
    from dejavu_engine.families.llama import rms_norm

    seeded = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=seeded) * 3
    w = torch.randn(shape[-1], generator=seeded)
    gate_up = torch.randn((*shape[:-1], 2 * shape[-1]), generator=seeded) * 4
    for dtype in (torch.bfloat16, torch.float32):
        xd, wd, gd = x.to(dtype), w.to(dtype), gate_up.to(dtype)
        got_norm, want_norm = native.rms_norm(xd, wd, 1e-5), rms_norm(xd, wd, 1e-5)
        got_glu, want_glu = native.silu_mul(gd), _torch_swiglu(gd)
        assert got_norm.dtype == got_glu.dtype == dtype and got_glu.shape == (*shape[:-1], shape[-1])
        if dtype == torch.bfloat16:
            for got, want in ((got_norm, want_norm), (got_glu, want_glu)):
                assert (got == want).float().mean() >= 0.999
                torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-30)
            continue
        torch.testing.assert_close(got_norm, want_norm, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_glu, want_glu, rtol=1e-6, atol=1e-6)
        exact = _torch_swiglu(gate_up.double())
        assert (got_glu.double() - exact).abs().max() <= 2 * (want_glu.double() - exact).abs().max() + 1e-12


def test_pointwise_ops_keep_nan_and_refuse_what_does_not_fit(kernels: None) -> None:
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    out = native.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()  # one bad value spoils its row only
    assert torch.isnan(native.silu_mul(torch.cat([x, x], dim=-1))[1, 5])
    with pytest.raises(RuntimeError, match="contiguous"):
        native.rms_norm(torch.ones(32, 4).t(), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.rms_norm(torch.ones(2, 32), torch.ones(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        native.rms_norm(torch.ones(2, 32), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="even"):
        native.silu_mul(torch.ones(2, 33))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.silu_mul(torch.ones(2, 32, dtype=torch.float64))


def _hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, cos and sin as HF builds them (the sign of rotate_half
    in the function, not the table)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# head_dim 64 and 128 are whole vectors; 80 leaves half of 40 (a tail of 8 to the scalar loop), 8 is all tail.
@pytest.mark.parametrize("head_dim", [64, 128, 80, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_in_place_is_transformers_arithmetic(kernels: None, head_dim: int, dtype: torch.dtype) -> None:
    """The in-place kernel rounds each product before the sum, as transformers does: equal to its arithmetic bit
    for bit in both dtypes, on the first ``heads`` heads of a fused projection, the others (v) untouched."""
    from dejavu_engine.families.llama import Llama

    seeded = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, batch, n = 9, 3, 2, 37
    qkv = torch.randn(batch, n, heads + 2 * kv_heads, head_dim, generator=seeded).to(dtype) * 3
    angles = torch.rand(batch, n, 1, head_dim // 2, generator=seeded) * 100
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    signed_sin = torch.cat((-sin[..., : head_dim // 2], sin[..., head_dim // 2 :]), -1)  # the engine's table
    want = _hf_rotary(qkv[:, :, : heads + kv_heads], cos, sin)
    got = qkv.clone()
    assert native.rope_(got, cos, signed_sin, heads + kv_heads) is got
    assert torch.equal(got[:, :, : heads + kv_heads], want)
    assert torch.equal(got[:, :, heads + kv_heads :], qkv[:, :, heads + kv_heads :])
    # The family takes it where the stage has the kernels; the fallback fuses one product (a last-bit difference).
    family = Llama({"num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": heads * head_dim,
                    "num_hidden_layers": 1, "vocab_size": 8})  # fmt: skip
    family.kernels = native.load()
    assert torch.equal(family.rotary(qkv.clone(), cos, signed_sin, heads + kv_heads), want)
    family.kernels = None
    fallback = family.rotary(qkv.clone(), cos, signed_sin, heads + kv_heads)
    torch.testing.assert_close(fallback, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 0)


def test_rotary_embedding_refuses_what_does_not_fit(kernels: None) -> None:
    qkv, table = torch.zeros(2, 5, 4, 8), torch.zeros(2, 5, 1, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        native.rope_(qkv.transpose(1, 2), table, table, 2)
    with pytest.raises(RuntimeError, match="cos and sin"):
        native.rope_(qkv, table[:, :4], table[:, :4], 2)
    with pytest.raises(RuntimeError, match="rotates 5 heads of 4"):
        native.rope_(qkv, table, table, 5)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.rope_(qkv, table.bfloat16(), table.bfloat16(), 2)
    with pytest.raises(RuntimeError, match="even"):
        native.rope_(torch.zeros(2, 5, 4, 7), torch.zeros(10, 7), torch.zeros(10, 7), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("kernels")
def test_paged_write_puts_each_token_in_its_block_and_nothing_else(dtype: torch.dtype) -> None:
    """A prefill's K/V (strided views of a fused projection, prompts back to back) land where the pool's own
    scatter (``PagedKVCache.unpack``) puts them, left padding and blocks split across two slabs included."""
    from dejavulib.layout import KVLayout
    from dejavulib.paged import BlockGeometry, BlockPool

    kv_heads, head_dim, block_size, heads = 2, 16, 4, 6
    lengths, max_len = [9, 4, 1, 12], 12
    pads = [max_len - n for n in lengths]
    name = "float32" if dtype == torch.float32 else "bfloat16"
    layout = KVLayout(layers=1, batch=len(lengths), kv_heads=kv_heads, max_len=max_len, head_dim=head_dim, dtype=name)
    pools = [BlockPool(BlockGeometry.of(layout, block_size), max_blocks=16, slab_blocks=4) for _ in range(2)]
    caches = [pool.cache(layout, pads).holding(max_len) for pool in pools]
    assert len(pools[0].k_slabs) > 1  # the prompts' blocks span slabs
    for slab in [s for pool in pools for s in pool.k_slabs + pool.v_slabs]:
        slab.fill_(float("nan"))  # what earlier owners of the blocks left: a padded row's first block is cleared
    seeded = torch.Generator().manual_seed(5)
    qkv = torch.randn(sum(lengths), heads + 2 * kv_heads, head_dim, generator=seeded).to(dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    offsets = [sum(lengths[:r]) for r in range(len(lengths))]
    places = torch.tensor([(o, p, max_len) for o, p in zip(offsets, pads, strict=True)])
    k_slabs, v_slabs = pools[0].layer(0)
    native.paged_write(k, v, k_slabs, v_slabs, caches[0].table, places)
    # The reference: the same positions, left padded into a contiguous [layers, rows, heads, positions, dim] pair.
    dense = torch.zeros(2, 1, len(lengths), kv_heads, max_len, head_dim, dtype=dtype)
    for r, (o, p) in enumerate(zip(offsets, pads, strict=True)):
        dense[0, 0, r, :, p:] = k[o : o + lengths[r]].transpose(0, 1)
        dense[1, 0, r, :, p:] = v[o : o + lengths[r]].transpose(0, 1)
    caches[1].unpack(layout.region(), dense.flatten().view(torch.uint8))
    for mine, theirs in zip(pools[0].k_slabs + pools[0].v_slabs, pools[1].k_slabs + pools[1].v_slabs, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    ("places", "table", "message"),
    [
        ([[0, 0, 8]], [[0, -1]], "logical block 1 is block -1"),
        ([[0, 0, 8]], [[0, 9]], "logical block 1 is block 9"),
        ([[0, 0, 9]], [[0, 1]], "bad positions"),
        ([[0, 3, 3]], [[0, 1]], "bad positions"),
        ([[4, 0, 8]], [[0, 1]], "not within the call's 8"),
        ([[0, 0, 8, 0]], [[0, 1]], "places"),
        ([[0, 0, 8], [0, 0, 4]], [[0, 1]], "a row per row of tables"),
    ],
)
@pytest.mark.usefixtures("kernels")
def test_paged_write_refuses_what_does_not_fit_before_writing(places: list, table: list, message: str) -> None:
    k_slabs, v_slabs = [torch.zeros(8, 2, 4, 16)], [torch.zeros(8, 2, 4, 16)]
    kv = torch.ones(8, 2, 16)
    with pytest.raises(RuntimeError, match=message):
        native.paged_write(kv, kv, k_slabs, v_slabs, torch.tensor(table), torch.tensor(places))
    assert not any(slab.any() for slab in k_slabs + v_slabs)


@pytest.mark.usefixtures("kernels")
def test_paged_write_keeps_a_cached_prefix_before_start() -> None:
    """Without ``clear_before`` (a chunk or a decode step after a cached prefix) the positions of the first
    block before ``start`` keep what they hold; with it (a left-padded prompt) they are cleared."""
    for clear, kept in ((False, 7.0), (True, 0.0)):
        k_slabs, v_slabs = [torch.full((4, 2, 4, 16), 7.0)], [torch.full((4, 2, 4, 16), 7.0)]
        kv = torch.arange(3 * 2 * 16, dtype=torch.float32).view(3, 2, 16)
        native.paged_write(kv, -kv, k_slabs, v_slabs, torch.tensor([[3, 1]]), torch.tensor([[0, 2, 5]]), clear)
        assert (k_slabs[0][3, :, :2] == kept).all() and (v_slabs[0][3, :, :2] == kept).all()
        assert torch.equal(k_slabs[0][3, :, 2:].transpose(0, 1), kv[:2]) and torch.equal(k_slabs[0][1, :, 0], kv[2])
        assert torch.equal(v_slabs[0][1, :, 0], -kv[2]) and (k_slabs[0][1, :, 1:] == 7.0).all()


def paged_prefill_case(heads, kv_heads, head_dim, block_size, segments, *, gap=0, seed=0):
    """q of the segments' tokens back to back (``gap`` tokens in none after the first; a strided view of a fused
    projection), two slabs of random K/V, and for segment ``(length, start)`` a table of distinct blocks drawn at
    random from both slabs for positions ``[0, start + length)``. Returns q, the slabs, the tables and the
    segments ``(offset, length, start)``."""
    generator = torch.Generator().manual_seed(seed)
    rows, offset = [], 0
    for i, (length, start) in enumerate(segments):
        rows.append((offset, length, start))
        offset += length + (gap if i == 0 else 0)
    q = (torch.randn(offset, heads + 2 * kv_heads, head_dim, generator=generator) * 2)[:, :heads]
    slab_blocks = sum(-(-(start + length) // block_size) for length, start in segments)
    shape = (slab_blocks, kv_heads, block_size, head_dim)
    k_slabs = [torch.randn(shape, generator=generator) * 2 for _ in range(2)]
    v_slabs = [torch.randn(shape, generator=generator) for _ in range(2)]
    ids = iter(torch.randperm(2 * slab_blocks, generator=generator).tolist())
    width = max(-(-(start + length) // block_size) for length, start in segments)
    tables = torch.full((len(segments), width), -1, dtype=torch.long)
    for i, (length, start) in enumerate(segments):
        for lb in range(-(-(start + length) // block_size)):
            tables[i, lb] = next(ids)
    return q, k_slabs, v_slabs, tables, torch.tensor(rows, dtype=torch.long)


def _sequence(slabs: list[torch.Tensor], table: torch.Tensor, end: int) -> torch.Tensor:
    """Positions ``[0, end)`` of one sequence read through its table: ``[end, kv_heads, head_dim]``."""
    slab_blocks, _, block_size, _ = slabs[0].shape
    return torch.stack(
        [
            slabs[int(table[p // block_size]) // slab_blocks][
                int(table[p // block_size]) % slab_blocks, :, p % block_size
            ]
            for p in range(end)
        ]
    )


def paged_prefill_reference(q, k_slabs, v_slabs, tables, segments, scale):
    """Each segment's query at position ``p`` over its sequence's keys ``[0, p]``, gathered position by position
    through its table, softmax attention in float64; 0 for tokens in no segment."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // k_slabs[0].shape[1]
    for (offset, length, start), table in zip(segments.tolist(), tables, strict=True):
        k = _sequence(k_slabs, table, start + length).double().repeat_interleave(g, 1)
        v = _sequence(v_slabs, table, start + length).double().repeat_interleave(g, 1)
        for t in range(length):
            p = start + t
            scores = torch.einsum("hd,nhd->hn", q[offset + t].double(), k[: p + 1]) * scale
            out[offset + t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[: p + 1])
    return out


# (length, start): a whole prompt; one token mid-block; a chunk from a block boundary across several; a chunk from
# mid-block; a long chunk over a long prefix; a chunk ending on a block's end.
SEGMENTS = [(5, 0), (1, 9), (20, 16), (7, 3), (40, 50), (13, 3)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 2, 16, 4), (8, 2, 128, 16), (6, 3, 24, 5), (4, 4, 32, 1)],
)
@pytest.mark.usefixtures("kernels")
def test_paged_prefill_chunks_attend_over_their_prefix_and_themselves(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    case = paged_prefill_case(heads, kv_heads, head_dim, block_size, SEGMENTS, gap=2, seed=head_dim + block_size)
    q, k_slabs, tables = case[0], case[1], case[3]
    used, slab_blocks = tables[tables >= 0], k_slabs[0].shape[0]
    assert (used < slab_blocks).any() and (used >= slab_blocks).any()  # both slabs are read
    out = native.paged_prefill_attention(*case, 0.1)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), paged_prefill_reference(*case, 0.1), atol=2e-5, rtol=1e-5)
    assert not out[5:7].any()  # the gap's tokens belong to no segment


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (6, 3, 24, 5)])
@pytest.mark.usefixtures("kernels")
def test_a_chunk_attends_bit_for_bit_as_its_positions_of_the_whole_prompt(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """A chunk's output rows are the whole prompt's rows at its positions, bit for bit, in both dtypes (the same
    keys in the same order and the same causal lengths): computing a prompt in chunks, or after a prefix hit,
    changes no bit of what it attends to."""
    q, k_slabs, v_slabs, tables, segments = paged_prefill_case(heads, kv_heads, head_dim, block_size, SEGMENTS, seed=3)
    q = q.to(dtype)
    k_slabs, v_slabs = [s.to(dtype) for s in k_slabs], [s.to(dtype) for s in v_slabs]
    out = native.paged_prefill_attention(q, k_slabs, v_slabs, tables, segments, 0.125)
    assert out.dtype == dtype
    for (offset, length, start), table in zip(segments.tolist(), tables, strict=True):
        end = start + length
        k, v = _sequence(k_slabs, table, end), _sequence(v_slabs, table, end)
        whole_q = torch.randn(end, heads, head_dim).to(dtype)
        whole_q[start:] = q[offset : offset + length]
        whole = native.prefill_attention(whole_q, k, v, torch.tensor([[0, end]]), 0.125)
        assert torch.equal(out[offset : offset + length], whole[start:])


@pytest.mark.parametrize(
    ("segments", "table", "message"),
    [
        ([[0, 4, 4]], [[0, -1]], "logical block 1 is block -1"),
        ([[0, 4, 4]], [[0, 8]], "logical block 1 is block 8"),
        ([[0, 4, 5]], [[0, 1]], "bad positions"),
        ([[0, 4, -1]], [[0, 1]], "bad positions"),
        ([[4, 5, 0]], [[0, 1, 2]], "not within the call's 8"),
        ([[0, 4, 0], [2, 4, 0]], [[0, 1], [2, 3]], "in an earlier segment"),
        ([[0, 4]], [[0, 1]], "segments"),
        ([[0, 4, 0], [4, 4, 0]], [[0, 1]], "a row per row of tables"),
    ],
)
@pytest.mark.usefixtures("kernels")
def test_paged_prefill_refuses_what_does_not_fit(segments: list, table: list, message: str) -> None:
    k_slabs, v_slabs = [torch.zeros(8, 2, 4, 16)], [torch.zeros(8, 2, 4, 16)]
    q = torch.ones(8, 4, 16)
    with pytest.raises(RuntimeError, match=message):
        native.paged_prefill_attention(q, k_slabs, v_slabs, torch.tensor(table), torch.tensor(segments), 0.1)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.paged_prefill_attention(
            q, k_slabs, [v_slabs[0].bfloat16()], torch.tensor([[0]]), torch.tensor([[0, 4, 0]]), 0.1
        )


def test_a_host_without_a_compiler_loads_the_best_build_made_ahead_that_it_can_run(
    kernels: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The images carry builds per CPU level (``--portable``) and no compiler. A level the CPU lacks is
    skipped, one that does not load is passed over with a warning, and the best one left is used. (This
    host's own build stands in for a level's, under that level's key; the selection is what is tested.)"""
    import shutil

    own_key = native.build_key()
    own = native.cache_dir() / own_key / f"dejavu_kernels_{own_key}.so"
    keys = {"x86-64-v4": "broken0000000000", "x86-64-v3": own_key}
    (tmp_path / "x86-64-v4").mkdir()
    (tmp_path / "x86-64-v4" / "dejavu_kernels_broken0000000000.so").write_bytes(b"not a library")
    (tmp_path / "x86-64-v3").mkdir()
    shutil.copy2(own, tmp_path / "x86-64-v3" / own.name)
    monkeypatch.setattr(native, "prebuilt_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "build_key", lambda march="native": keys.get(march, "unbuilt000000000"))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "_build", lambda *a, **k: pytest.fail("no compiler: nothing is built"))
    every_level = " ".join(sorted(set().union(*(needs for _march, needs in native.PORTABLE))))

    def fresh_load(cpu: str):
        monkeypatch.setattr(native, "_module", None)
        monkeypatch.setattr(native, "_tried", False)
        monkeypatch.setattr(native, "_cpu_flags", lambda: f"flags\t: {cpu}")
        return native.load()

    module = fresh_load(every_level)
    assert module is not None and hasattr(module, "paged_decode_attention")
    assert "do not load here" in caplog.text  # the v4 file, passed over
    v3_only = " ".join(sorted(dict(native.PORTABLE)["x86-64-v3"]))
    assert fresh_load("sse2 avx") is None  # no level this CPU runs was made
    assert fresh_load(v3_only) is not None


def test_a_build_is_keyed_by_its_python_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two environments on one host (a project's virtualenv and another with the same torch) keep builds of
    their own: torch's extension builder names the environment's include paths, so one shared build would be
    rebuilt by each in turn."""
    import sys

    key = native.build_key()
    assert native.build_key() == key and native.build_key("x86-64-v3") != key
    monkeypatch.setattr(sys, "prefix", "/opt/another-venv")
    assert native.build_key() != key

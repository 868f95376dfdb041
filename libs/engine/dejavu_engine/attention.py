"""Attention over a stage's preallocated KV cache, shared by all families.

Masks and positions are built once per forward call (not per layer). Decode attends only over the
filled prefix ``[0, cur_len)`` of the cache, never over ``max_len``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine import native, slices
from dejavu_engine.family import ForwardContext
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.sdpa import layer_mask, sdpa


def positions(geometry: BatchGeometry, n: int, device: torch.device) -> torch.Tensor:
    """Per-row token positions ``[batch, n]`` of the ``n`` new tokens (pad slots clamp to 0)."""
    index = torch.arange(geometry.cur_len - n, geometry.cur_len, device=device)
    pads = torch.tensor(geometry.pad_lens, device=device).unsqueeze(1)
    return (index.unsqueeze(0) - pads).clamp_(min=0)


def allowed(geometry: BatchGeometry, n: int, device: torch.device) -> torch.Tensor:
    """Bool ``[batch, 1, n, cur_len]``: query i may attend key j.

    Keys must be at or before the query and not padding. A padding query also sees itself, so no
    row is fully masked (which would produce NaNs that then flow into the cache's pad slots).
    """
    start, cur_len = geometry.cur_len - n, geometry.cur_len
    keys = torch.arange(cur_len, device=device)
    queries = torch.arange(start, cur_len, device=device).unsqueeze(1)
    pads = torch.tensor(geometry.pad_lens, device=device).view(-1, 1, 1, 1)
    return ((keys <= queries) & (keys >= pads)) | (keys == queries)


def window_allowed(geometry: BatchGeometry, n: int, window: int, device: torch.device) -> torch.Tensor:
    """:func:`allowed` less the keys a sliding window of ``window`` positions drops: query ``i`` sees keys ``j``
    with ``i - window < j <= i`` (transformers' ``sliding_window_overlay``)."""
    keys = torch.arange(geometry.cur_len, device=device)
    queries = torch.arange(geometry.cur_len - n, geometry.cur_len, device=device).unsqueeze(1)
    return allowed(geometry, n, device) & (keys > queries - window)


def bool_mask(geometry: BatchGeometry, n: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """``(mask, causal)`` for families without attention biases; None where SDPA needs no mask."""
    if not geometry.padded:
        if n == 1:
            return None, False
        if n == geometry.cur_len:
            return None, True
    return allowed(geometry, n, device), False


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | Sequence[torch.Tensor],
    v_cache: torch.Tensor | Sequence[torch.Tensor],
    ctx: ForwardContext,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write ``k``/``v`` (``[batch, kv_heads, n, head_dim]``) into the layer's cache at
    ``[ctx.start, ctx.cur_len)`` and attend ``q`` (``[batch, heads, n, head_dim]``) over the filled
    prefix. Returns ``[batch, n, heads * head_dim]``.

    With ``ctx.groups``, ``k_cache``/``v_cache`` hold one layer cache per group, and each group's rows
    attend over their own cache and length only (one attention call per group, or one call of the
    native kernel for every group with ``ctx.spans``). A pass of per-request slices over a paged pool
    (:class:`~dejavu_engine.slices.SliceContext`) attends as :func:`dejavu_engine.slices.attend`.

    In a sliding-window layer (``ctx.local``) every query attends with its own context's ``window_mask`` (in the
    native decode kernel: ``ctx.window_spans``); with ``softcap`` the attention logits are soft-capped
    (:func:`sdpa`): torch's attention only (the stage builds no native context then,
    :meth:`Family.torch_attention`).
    """
    if isinstance(ctx, slices.SliceContext):
        assert not isinstance(k_cache, torch.Tensor) and not isinstance(v_cache, torch.Tensor)
        return slices.attend(q, k, v, k_cache, v_cache, ctx, scale, softcap)
    if ctx.local or softcap is not None:
        assert ctx.mixed is None and not ctx.native_prefill, "native prefill with a window or a soft cap"
        assert softcap is None or ctx.spans is None, "native decode with a soft cap"
    if ctx.mixed is not None:
        return _attend_mixed(q, k, v, k_cache, v_cache, ctx, scale)
    if ctx.spans is not None:
        return _attend_native(q, k, v, k_cache, v_cache, ctx, scale)
    if ctx.segments is not None:
        return _attend_ragged(q, k, v, k_cache, v_cache, ctx, scale, softcap)
    if ctx.groups is not None:
        assert not isinstance(k_cache, torch.Tensor) and not isinstance(v_cache, torch.Tensor)
        outs = [
            attend(q[a:b], k[a:b], v[a:b], kc, vc, replace(group_ctx, local=ctx.local), scale, softcap)
            for (a, b, group_ctx), kc, vc in zip(ctx.groups, k_cache, v_cache, strict=True)
        ]
        return torch.cat(outs)
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if ctx.geometry.rows is None:
        k_cache[:, :, ctx.start : ctx.cur_len].copy_(k)
        v_cache[:, :, ctx.start : ctx.cur_len].copy_(v)
        if ctx.native_prefill:  # whole prompts: each row attends over its own new tokens, read from k/v
            batch, n = q.shape[0], q.shape[2]
            return _prefill_native(q, k, v, [(row * n, n) for row in range(batch)], scale).view(batch, n, -1)
        keys = k_cache[:, :, : ctx.cur_len]
        values = v_cache[:, :, : ctx.cur_len]
    else:  # some rows of the cache only: written in place, read as copies (the native path reads in place)
        index = torch.tensor(ctx.geometry.rows, device=k_cache.device)
        k_cache[index, :, ctx.start : ctx.cur_len] = k
        v_cache[index, :, ctx.start : ctx.cur_len] = v
        keys = k_cache[index, :, : ctx.cur_len]
        values = v_cache[index, :, : ctx.cur_len]
    out = sdpa(q, keys, values, *layer_mask(ctx, ctx.local), scale, softcap)
    batch, heads, n, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, n, heads * head_dim)


def _attend_mixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | Sequence[torch.Tensor],
    v_cache: torch.Tensor | Sequence[torch.Tensor],
    ctx: ForwardContext,
    scale: float | None,
) -> torch.Tensor:
    """:func:`attend` of a mixed pass (``ctx.mixed``): the first tokens of the one row decode (one per
    decoding row, over the pool's slabs through the paged kernel), the rest are a ragged prefill (into its
    blocks). ``k_cache``/``v_cache`` are ``(slabs, slabs)``: the decode's, then the prefill's."""
    assert ctx.mixed is not None
    decode, prefill = ctx.mixed
    (k_slabs, k_prefill), (v_slabs, v_prefill) = k_cache, v_cache
    rows = decode.positions.shape[0]
    out_decode = _attend_native(
        q[0, :, :rows].transpose(0, 1).unsqueeze(2),
        k[0, :, :rows].transpose(0, 1).unsqueeze(2),
        v[0, :, :rows].transpose(0, 1).unsqueeze(2),
        k_slabs,
        v_slabs,
        decode,
        scale,
    )
    out_prefill = _attend_ragged(q[:, :, rows:], k[:, :, rows:], v[:, :, rows:], k_prefill, v_prefill, prefill, scale)
    return torch.cat([out_decode.view(1, rows, -1), out_prefill], dim=1)


def _attend_ragged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | Sequence[torch.Tensor],
    v_cache: torch.Tensor | Sequence[torch.Tensor],
    ctx: ForwardContext,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`attend` of a ragged prefill (``ctx.segments``): ``q``/``k``/``v`` hold every prompt's tokens
    back to back in one row; each prompt writes its K/V into its own cache row (right-aligned, as left
    padding places it; with ``ctx.places``, into its row's blocks of the pool whose slabs ``k_cache``/``v_cache``
    are) and attends causally over its own tokens only. No padding is computed."""
    assert ctx.segments is not None
    if ctx.places is not None:
        assert ctx.tables is not None
        assert not isinstance(k_cache, torch.Tensor) and not isinstance(v_cache, torch.Tensor)
        native.paged_write(
            k[0].transpose(0, 1), v[0].transpose(0, 1), list(k_cache), list(v_cache), ctx.tables, ctx.places
        )
    else:
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
        for offset, length, row, start, _ in ctx.segments:
            k_cache[row, :, start : start + length].copy_(k[0, :, offset : offset + length])
            v_cache[row, :, start : start + length].copy_(v[0, :, offset : offset + length])
    if ctx.native_prefill:
        segments = [(offset, length) for offset, length, *_ in ctx.segments]
        return _prefill_native(q, k, v, segments, scale).view(1, q.shape[2], -1)
    outs = []
    for offset, length, _row, _start, seg in ctx.segments:
        rows = slice(offset, offset + length)
        outs.append(sdpa(q[:, :, rows], k[:, :, rows], v[:, :, rows], *layer_mask(seg, ctx.local), scale, softcap))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    _, heads, n, head_dim = out.shape
    return out.transpose(1, 2).reshape(1, n, heads * head_dim)


def _prefill_native(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[tuple[int, int]], scale: float | None
) -> torch.Tensor:
    """Causal attention of ``q`` ``[batch, heads, n, head_dim]`` over ``k``/``v`` (``[batch, kv_heads, n,
    head_dim]``) through the native prefill kernel, the batch's tokens taken as one sequence cut into
    ``segments`` (offset, length), each attending over itself only: one call for every prompt, but those that
    attend faster through torch's flash attention on this host (:func:`native.torch_prefill_from`), which go
    there one by one. Returns ``[batch * n, heads, head_dim]``."""
    batch, heads, n, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    q_rows = q.transpose(1, 2).reshape(batch * n, heads, head_dim)  # views of a fused projection, not copies
    k_rows = k.transpose(1, 2).reshape(batch * n, kv_heads, head_dim)
    v_rows = v.transpose(1, 2).reshape(batch * n, kv_heads, head_dim)
    from_len = native.torch_prefill_from(q.dtype)
    short: list[tuple[int, int]] = []
    long: list[tuple[int, int]] = []
    for segment in segments:
        (long if from_len is not None and segment[1] >= from_len else short).append(segment)
    if short:
        out = native.prefill_attention(q_rows, k_rows, v_rows, torch.tensor(short, dtype=torch.long), scale)
    else:  # tokens in no segment are 0, as the kernel leaves them
        out = torch.zeros(batch * n, heads, head_dim, dtype=q.dtype, device=q.device)
    for offset, length in long:
        rows = slice(offset, offset + length)
        part = F.scaled_dot_product_attention(
            q_rows[rows].transpose(0, 1).unsqueeze(0),
            k_rows[rows].transpose(0, 1).unsqueeze(0),
            v_rows[rows].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
        out[rows] = part[0].transpose(0, 1)
    return out


def decode_spans(geometries: Sequence[BatchGeometry], window: int | None = None) -> torch.Tensor:
    """``ForwardContext.spans`` of a one-token call over groups with these geometries: per row
    ``(group, index, start, end)``, the span of cache positions the row attends (its own tokens,
    the new one included; with ``window``, its last ``window`` positions at most)."""
    spans = [
        (g, row, pad if window is None else max(pad, geo.cur_len - window), geo.cur_len)
        for g, geo in enumerate(geometries)
        for row, pad in zip(geo.cache_rows, geo.pad_lens, strict=True)
    ]
    return torch.tensor(spans, dtype=torch.long)


def _attend_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor | Sequence[torch.Tensor],
    v_cache: torch.Tensor | Sequence[torch.Tensor],
    ctx: ForwardContext,
    scale: float | None,
) -> torch.Tensor:
    """:func:`attend` of one token per row through the native kernel: in one call, every row of every
    group writes its new K/V into its group's cache (or its blocks of a paged pool, ``ctx.tables``) and
    attends over its own span."""
    k_caches = [k_cache] if isinstance(k_cache, torch.Tensor) else list(k_cache)
    v_caches = [v_cache] if isinstance(v_cache, torch.Tensor) else list(v_cache)
    batch, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    spans = ctx.window_spans if ctx.local else ctx.spans
    assert spans is not None, "a sliding-window layer's native context has no window spans"
    args = (
        q.reshape(batch, heads, head_dim).contiguous(),
        k.reshape(batch, kv_heads, head_dim).contiguous(),
        v.reshape(batch, kv_heads, head_dim).contiguous(),
        k_caches,
        v_caches,
    )
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    if ctx.tables is not None:  # the caches are a paged pool's slabs of this layer
        out = native.paged_decode_attention(*args, ctx.tables, spans, scale)
    else:
        out = native.decode_attention(*args, spans, scale)
    return out.view(batch, 1, heads * head_dim)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, n, heads * d]`` -> ``[batch, heads, n, d]``."""
    batch, n, width = x.shape
    return x.view(batch, n, heads, width // heads).transpose(1, 2)


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi head slopes as BLOOM defines them (geometric; interleaved extras for non powers of 2)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**p for p in range(1, closest + 1)]
    if closest != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra**p for p in range(1, 1 + 2 * min(closest, heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_mask(geometry: BatchGeometry, n: int, heads: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[batch, heads, n, cur_len]``: slope x key position (pad-aware), min where masked."""
    keys = torch.arange(geometry.cur_len, device=device)
    pads = torch.tensor(geometry.pad_lens, device=device).unsqueeze(1)
    key_pos = (keys.unsqueeze(0) - pads).clamp_(min=0).to(torch.float32)  # [batch, cur_len]
    bias = alibi_slopes(heads).to(device).view(1, heads, 1, 1) * key_pos.view(-1, 1, 1, geometry.cur_len)
    bias = bias.expand(-1, -1, n, -1).to(dtype)
    return bias.masked_fill(~allowed(geometry, n, device), torch.finfo(dtype).min)

"""Torch's attention of one query block over its keys, as every torch path of the engine runs it
(:mod:`dejavu_engine.attention`, :mod:`dejavu_engine.slices`): SDPA, or transformers' eager arithmetic where the
logits are soft-capped; and the mask of a layer (its sliding window's where it has one)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine.family import ForwardContext


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[batch, heads, n, head_dim]`` over ``k``/``v`` ``[batch, kv_heads, len, head_dim]``
    with a bool or additive ``mask`` (or plainly ``causal``): torch's SDPA, or with ``softcap`` the logits capped
    at ``softcap * tanh(logits / softcap)`` before the mask, as transformers' eager attention of Gemma 2 computes
    it (softmax in float32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    logits = torch.matmul(q, k.transpose(2, 3)) * scale
    logits = torch.tanh(logits / softcap) * softcap
    if causal:
        n, length = q.shape[2], k.shape[2]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril()  # SDPA's is_causal
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min) if mask.dtype == torch.bool else logits + mask
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def layer_mask(ctx: ForwardContext, local: bool) -> tuple[torch.Tensor | None, bool]:
    """``(mask, causal)`` a plain context's queries attend with: its sliding window's in a ``local`` layer."""
    if local:
        if ctx.window_mask is None:
            raise ValueError("a sliding-window layer's context has no window mask")
        return ctx.window_mask, False
    return ctx.mask, ctx.causal

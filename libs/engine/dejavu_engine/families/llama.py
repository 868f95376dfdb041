"""Llama (SmolLM2, Llama 3.x): RMSNorm, rotary positions (unscaled or scaled, :mod:`.rope`), grouped-query
attention, SwiGLU MLP. The other Llama-shaped families (Mistral, Qwen2, Qwen3, Phi-3) are subclasses that
change a name, a bias or one step of the layer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine.attention import attend, bool_mask, positions, window_allowed
from dejavu_engine.families.rope import Rotary
from dejavu_engine.family import Family, ForwardContext, ModelSpec, SpecKeys, Weights, fuse
from dejavu_engine.gemm import linear, residual_linear
from dejavu_engine.geometry import BatchGeometry

_PREFIX = "model."
_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """The two halves of the last dimension exchanged (rotate_half without its sign)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension, op for op as transformers computes it (normalise in float32,
    round to ``x``'s dtype, then scale): the same numbers in every dtype, and in a decode step half
    the ops of ``F.rms_norm``'s CPU composite."""
    h = x.float()  # a no-op for float32
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``qk * cos + rotate_half(qk) * sin`` (the sign of rotate_half lives in ``sin``):
    one fused op in float32; below it, HF's three roundings."""
    if qk.dtype == torch.float32:
        return torch.addcmul(qk * cos, swap_halves(qk), sin)
    return qk * cos + swap_halves(qk) * sin


class Llama(Family):
    model_type = "llama"
    spec_keys = SpecKeys(max_positions_default=2048, tied_default=False)
    gemm_roles = ("qkv", "o", "gate_up", "down")
    head_gemm_roles = ("lm_head",)
    default_eps = 1e-6
    # The family's own names of rope types (Phi-3's "su"), and its pretraining length where a config has none.
    rope_aliases: ClassVar[dict[str, str]] = {}
    default_original_max: int | None = None
    # The attention's scale of q·k (None: head_dim ** -0.5).
    scaling: float | None = None

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cls.model_type}: activation {config.get('hidden_act')!r} is not supported (silu only)")

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.eps = float(config.get("rms_norm_eps", self.default_eps))
        self.window, self.windowed_layers = self.sliding(config)
        try:
            self.rope, self.local_rope = self.rotaries(config)
        except ValueError as exc:
            raise ValueError(f"{self.model_type}: {exc}") from exc

    def sliding(self, config: dict[str, Any]) -> tuple[int | None, frozenset[int]]:
        """The sliding window and the layers it limits (:func:`sliding_windows`; no window where none are)."""
        layers = frozenset(sliding_windows(config, self.spec))
        return (int(config["sliding_window"]) if layers else None), layers

    def rotaries(self, config: dict[str, Any]) -> tuple[Rotary, Rotary | None]:
        """The rotary embedding of the full-attention layers and, where it differs, the sliding-window layers'."""
        return Rotary(config, self.spec.head_dim, self.rope_aliases, self.default_original_max), None

    def embedding_names(self) -> dict[str, str]:
        return {"embed": f"{_PREFIX}embed_tokens.weight"}

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"{_PREFIX}layers.{layer}."
        names = {
            "ln_1": p + "input_layernorm.weight",
            "q": p + "self_attn.q_proj.weight",
            "k": p + "self_attn.k_proj.weight",
            "v": p + "self_attn.v_proj.weight",
            "o": p + "self_attn.o_proj.weight",
            "ln_2": p + "post_attention_layernorm.weight",
            "gate": p + "mlp.gate_proj.weight",
            "up": p + "mlp.up_proj.weight",
            "down": p + "mlp.down_proj.weight",
        }
        biased = self.biased_roles()
        return names | {f"{r}_bias": names[r].removesuffix("weight") + "bias" for r in _PROJECTIONS if r in biased}

    def biased_roles(self) -> frozenset[str]:
        """The projections with a bias: q, k, v and o per ``attention_bias``, gate, up and down per ``mlp_bias``."""
        roles: set[str] = set()
        if self.config.get("attention_bias"):
            roles |= {"q", "k", "v", "o"}
        if self.config.get("mlp_bias"):
            roles |= {"gate", "up", "down"}
        return frozenset(roles)

    def head_names(self) -> dict[str, str]:
        lm_head = self.embedding_names()["embed"] if self.spec.tie_word_embeddings else "lm_head.weight"
        return {"norm": f"{_PREFIX}norm.weight", "lm_head": lm_head}

    def prepare_layer(self, w: Weights) -> Weights:
        """Fuse q/k/v and gate/up into one matmul each (their names stay, as views)."""
        fuse(w, ("q", "k", "v"), "qkv")
        fuse(w, ("gate", "up"), "gate_up")
        if "q_bias" in w:
            fuse(w, ("q_bias", "k_bias", "v_bias"), "qkv_bias")
        if "gate_bias" in w:
            fuse(w, ("gate_bias", "up_bias"), "gate_up_bias")
        return w

    def context(self, geometry: BatchGeometry, n: int, device: torch.device, dtype: torch.dtype) -> ForwardContext:
        pos = positions(geometry, n, device)
        mask, causal = bool_mask(geometry, n, device)
        window = None if self.window is None else window_allowed(geometry, n, self.window, device)
        local_rope = None if self.local_rope is None else heads_rope(self.local_rope, geometry, pos, dtype)
        rope = heads_rope(self.rope, geometry, pos, dtype)
        return ForwardContext(
            geometry,
            geometry.cur_len - n,
            pos,
            mask,
            causal,
            rope=rope,
            window_mask=window,
            local_rope=local_rope,
        )

    def embed(self, w: Weights, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return F.embedding(input_ids, w["embed"])

    def layer(
        self, w: Weights, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attention = self.attention(w, self.norm(hidden, w["ln_1"]), k_cache, v_cache, ctx)
        hidden = residual_linear(hidden, attention, w["o"], w.get("o_bias"))
        x = self.norm(hidden, w["ln_2"])
        gated = self.gated(linear(x, w["gate_up"], w.get("gate_up_bias")))
        return residual_linear(hidden, gated, w["down"], w.get("down_bias"))

    def attention(
        self, w: Weights, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The attention of a layer's normed input ``x`` ``[batch, n, hidden]``, before the output projection:
        ``[batch, n, heads * head_dim]``. A sliding-window layer (``ctx.local``) rotates with ``ctx.local_rope``
        where the context has one."""
        spec = self.spec
        batch, n, _ = x.shape
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        qkv = linear(x, w["qkv"], w.get("qkv_bias")).view(batch, n, heads + 2 * kv_heads, spec.head_dim)
        self.normalize_qk(w, qkv)
        cos, sin = ctx.local_rope if ctx.local and ctx.local_rope is not None else ctx.rope  # type: ignore[misc]
        qk = self.rotary(qkv, cos, sin, heads + kv_heads)  # rotary embedding of q and k in one pass
        q = qk[:, :, :heads].transpose(1, 2)
        k = qk[:, :, heads:].transpose(1, 2)
        v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        return attend(q, k, v, k_cache, v_cache, ctx, self.scaling, self.attention_softcap)

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden, w["norm"])
        return linear(x, w["lm_head"], None)

    def normalize_qk(self, w: Weights, qkv: torch.Tensor) -> None:
        """A step between the projection ``[batch, n, all heads, head_dim]`` and the rotary embedding, in place
        (Qwen3's per-head norms of q and k); none in Llama."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """:func:`rms_norm`, in one native pass where the stage has the kernels (the same arithmetic)."""
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        """The first ``heads`` heads of a fused projection ``[batch, n, all heads, head_dim]`` (q and k) with the
        rotary embedding applied: in place in one native pass where the stage has the kernels (transformers'
        arithmetic, :func:`dejavu_engine.native.rope_`), else :func:`rotate`."""
        if self.kernels is not None and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous():
            self.kernels.rope_(qkv, cos, sin, heads)
            return qkv[:, :, :heads]
        return rotate(qkv[:, :, :heads], cos, sin)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of the fused projection ``[..., gate | up]`` (one native pass where
        the stage has the kernels)."""
        if self.kernels is not None and gate_up.is_contiguous():
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


def heads_rope(
    rope: Rotary, geometry: BatchGeometry, pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope``'s ``(cos, sin)`` of a call's positions as ``[batch, n, 1, head_dim]``: broadcast over the heads of a
    ``[batch, n, heads, head_dim]`` projection."""
    cos, sin = rope.embed(geometry, pos, dtype)
    return cos.unsqueeze(2), sin.unsqueeze(2)


def sliding_windows(config: dict[str, Any], spec: ModelSpec) -> list[int]:
    """The layers whose attention a config limits to a sliding window narrower than the model's positions (a
    window of at least ``max_position_embeddings`` positions never drops a key, and the layers then attend fully,
    on the native kernels where the stage has them): ``layer_types``' sliding
    layers where the config lists them, Qwen's ``use_sliding_window`` from ``max_window_layers`` on, else every
    layer when a ``sliding_window`` is set (Mistral, Phi-3)."""
    window = config.get("sliding_window")
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        window = None  # Qwen: the window applies only where use_sliding_window is set
    if not isinstance(window, int) or window >= spec.max_positions:
        return []
    types = config.get("layer_types")
    if isinstance(types, list):
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if "use_sliding_window" in config:
        return list(range(int(config.get("max_window_layers", 0)), spec.num_layers))
    return list(range(spec.num_layers))

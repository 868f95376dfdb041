"""Gemma 2 and Gemma 3 (text): Llama's grouped-query attention with the embedding scaled by ``sqrt(hidden)``, every
RMSNorm scaling by ``1 + weight`` in float32, a norm after attention and one before and after the MLP, a GELU-tanh
gated MLP, attention scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window layers between full ones
(``layer_types``). Gemma 2 soft-caps the attention logits and the final logits (``cap * tanh(x / cap)``); Gemma 3
normalises each q and k head (as Qwen3, with Gemma's norm) and rotates its sliding-window layers with their own
base (``rope_parameters["sliding_attention"]``).

Soft-capped attention runs on torch's attention (:meth:`Family.torch_attention`): a Gemma 2 stage never attends in
the native kernels. A Gemma 3 stage decodes in them (its windowed layers over the window's spans) and prefills
through torch where one of its layers has a window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine.families.llama import Llama
from dejavu_engine.families.rope import Rotary
from dejavu_engine.family import ForwardContext, SpecKeys, Weights
from dejavu_engine.gemm import linear

_PREFIX = "model."
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of the last dimension, op for op as transformers computes it: normalise and scale by
    ``1 + weight`` in float32, then round to ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (transformers' three ops)."""
    return torch.tanh(x / cap) * cap


class Gemma2(Llama):
    model_type = "gemma2"
    spec_keys = SpecKeys(max_positions_default=8192)
    # Which layers have a sliding window where a config lists no layer_types: every other one, from the first.
    default_pattern = 2

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in _ACTIVATIONS:
            raise ValueError(f"{cls.model_type}: activation {activation!r} is not supported (GELU-tanh only)")
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"{cls.model_type}: bidirectional attention (use_bidirectional_attention) is unsupported")

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.scaling = float(config.get("query_pre_attn_scalar", self.spec.head_dim)) ** -0.5
        self.attention_softcap = config.get("attn_logit_softcapping")
        self.final_softcap = config.get("final_logit_softcapping")

    def sliding(self, config: dict[str, Any]) -> tuple[int | None, frozenset[int]]:
        """``layer_types``' sliding layers (where the config lists none, every ``sliding_window_pattern``-th layer
        attends fully, the others in the window), none where the window is at least the model's positions."""
        num_layers = self.spec.num_layers
        pattern = int(config.get("sliding_window_pattern") or self.default_pattern)
        types = config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"{self.model_type}: layer_types {types} are not one of full/sliding_attention per layer")
        window = config.get("sliding_window")
        if not isinstance(window, int) or window >= self.spec.max_positions:
            return None, frozenset()
        return window, frozenset(i for i, kind in enumerate(types) if kind == "sliding_attention")

    def biased_roles(self) -> frozenset[str]:
        """q, k, v and o per ``attention_bias``; the MLP has none."""
        return super().biased_roles() & {"q", "k", "v", "o"}

    def layer_names(self, layer: int) -> dict[str, str]:
        """Llama's, with a norm after the attention and one before and after the MLP in place of ``ln_2``."""
        p = f"{_PREFIX}layers.{layer}."
        names = super().layer_names(layer)
        del names["ln_2"]
        return names | {
            "post_attn": p + "post_attention_layernorm.weight",
            "pre_mlp": p + "pre_feedforward_layernorm.weight",
            "post_mlp": p + "post_feedforward_layernorm.weight",
        }

    def embed(self, w: Weights, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        scale = torch.tensor(self.spec.hidden_size**0.5, dtype=torch.float32).to(w["embed"].dtype)
        return F.embedding(input_ids, w["embed"]) * scale

    def layer(
        self, w: Weights, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        out = self.attention(w, self.norm(hidden, w["ln_1"]), k_cache, v_cache, ctx)
        hidden = hidden + self.norm(linear(out, w["o"], w.get("o_bias")), w["post_attn"])
        x = self.norm(hidden, w["pre_mlp"])
        gate, up = linear(x, w["gate_up"], None).chunk(2, dim=-1)
        mlp = linear(F.gelu(gate, approximate="tanh") * up, w["down"], None)
        return hidden + self.norm(mlp, w["post_mlp"])

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(self.norm(hidden, w["norm"]), w["lm_head"], None)
        return logits if self.final_softcap is None else soft_cap(logits, self.final_softcap)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_norm(x, weight, self.eps)


class Gemma3Text(Gemma2):
    """Gemma 3's text model (``gemma3_text``; a ``gemma3`` checkpoint's language model is the same layers under
    another prefix, with a vision tower, and is refused)."""

    model_type = "gemma3_text"
    default_pattern = 6  # Gemma3TextConfig's sliding_window_pattern

    def rotaries(self, config: dict[str, Any]) -> tuple[Rotary, Rotary | None]:
        """Per layer type: ``rope_parameters`` keyed by ``full_attention``/``sliding_attention`` (transformers 5), or
        the older ``rope_theta`` (default 1e6) with ``rope_scaling`` and ``rope_local_base_freq`` (default 1e4)."""
        params = config.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            full = params.get("full_attention") or {"rope_type": "default", "rope_theta": 1_000_000.0}
            local = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
        else:
            full = dict(config.get("rope_scaling") or params)
            full.setdefault("rope_theta", config.get("rope_theta") or 1_000_000.0)
            local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq") or 10_000.0}
        base = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        dim = self.spec.head_dim
        return Rotary(base | {"rope_parameters": full}, dim), Rotary(base | {"rope_parameters": local}, dim)

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"{_PREFIX}layers.{layer}.self_attn."
        return super().layer_names(layer) | {"q_norm": p + "q_norm.weight", "k_norm": p + "k_norm.weight"}

    def normalize_qk(self, w: Weights, qkv: torch.Tensor) -> None:
        """Each q and k head of the fused projection normalised over ``head_dim`` with Gemma's norm, in place."""
        heads, kv_heads = self.spec.num_heads, self.spec.num_kv_heads
        q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
        q.copy_(gemma_norm(q, w["q_norm"], self.eps))
        k.copy_(gemma_norm(k, w["k_norm"], self.eps))

"""BLOOM: ALiBi attention biases (no position embeddings), LayerNorm after the embedding, fused
head-interleaved QKV, tanh-GELU MLP, optional post-LayerNorm residuals."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine.attention import alibi_mask, attend, positions
from dejavu_engine.family import Family, ForwardContext, SpecKeys, Weights, module_names
from dejavu_engine.geometry import BatchGeometry

_PREFIX = "transformer."
# ALiBi has no learned position table; the engine's max_context is the effective bound.
_ALIBI_MAX_POSITIONS = 1 << 20


class Bloom(Family):
    model_type = "bloom"
    spec_keys = SpecKeys(
        num_layers=("n_layer", "num_hidden_layers"),
        hidden_size=("hidden_size", "n_embed"),
        num_heads=("n_head", "num_attention_heads"),
        num_kv_heads=(),
        head_dim=(),
        max_positions=(),
        max_positions_default=_ALIBI_MAX_POSITIONS,
    )

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.eps = float(config.get("layer_norm_epsilon", 1e-5))
        self.post_ln_residual = bool(config.get("apply_residual_connection_post_layernorm", False))

    def embedding_names(self) -> dict[str, str]:
        return {
            "embed": f"{_PREFIX}word_embeddings.weight",
            "embed_ln": f"{_PREFIX}word_embeddings_layernorm.weight",
            "embed_ln_bias": f"{_PREFIX}word_embeddings_layernorm.bias",
        }

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"{_PREFIX}h.{layer}."
        roles = {
            "ln_1": "input_layernorm",
            "qkv": "self_attention.query_key_value",
            "o": "self_attention.dense",
            "ln_2": "post_attention_layernorm",
            "fc1": "mlp.dense_h_to_4h",
            "fc2": "mlp.dense_4h_to_h",
        }
        return module_names(p, roles)

    def head_names(self) -> dict[str, str]:
        lm_head = self.embedding_names()["embed"] if self.spec.tie_word_embeddings else "lm_head.weight"
        return {"norm": f"{_PREFIX}ln_f.weight", "norm_bias": f"{_PREFIX}ln_f.bias", "lm_head": lm_head}

    def context(self, geometry: BatchGeometry, n: int, device: torch.device, dtype: torch.dtype) -> ForwardContext:
        mask = alibi_mask(geometry, n, self.spec.num_heads, device, dtype)
        return ForwardContext(geometry, geometry.cur_len - n, positions(geometry, n, device), mask, causal=False)

    def _norm(self, x: torch.Tensor, w: Weights, role: str) -> torch.Tensor:
        return F.layer_norm(x, (self.spec.hidden_size,), w[role], w[f"{role}_bias"], self.eps)

    def embed(self, w: Weights, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self._norm(F.embedding(input_ids, w["embed"]), w, "embed_ln")

    def layer(
        self, w: Weights, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        spec = self.spec
        x = self._norm(hidden, w, "ln_1")
        residual = x if self.post_ln_residual else hidden
        batch, n, _ = x.shape
        # The fused projection interleaves per head: [heads, (q, k, v), head_dim].
        qkv = F.linear(x, w["qkv"], w["qkv_bias"]).view(batch, n, spec.num_heads, 3, spec.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        hidden = residual + F.linear(attend(q, k, v, k_cache, v_cache, ctx), w["o"], w["o_bias"])
        x = self._norm(hidden, w, "ln_2")
        residual = x if self.post_ln_residual else hidden
        x = F.gelu(F.linear(x, w["fc1"], w["fc1_bias"]), approximate="tanh")
        return residual + F.linear(x, w["fc2"], w["fc2_bias"])

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(hidden, w, "norm"), w["lm_head"])

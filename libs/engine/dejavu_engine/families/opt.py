"""OPT: learned positions with offset 2, pre- or post-LayerNorm per config, ReLU MLP, optional
projections between the embedding width and the hidden width."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine.attention import attend, bool_mask, positions, split_heads
from dejavu_engine.family import Family, ForwardContext, SpecKeys, Weights, module_names
from dejavu_engine.geometry import BatchGeometry

_PREFIX = "model.decoder."
# OPT's learned position table reserves its first two rows (a fairseq convention).
POSITION_OFFSET = 2
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}
_EPS = 1e-5  # nn.LayerNorm's default, which OPT uses


class OPT(Family):
    model_type = "opt"
    spec_keys = SpecKeys(num_kv_heads=(), head_dim=())

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        if config.get("activation_function", "relu") not in _ACTIVATIONS:
            raise ValueError(f"unsupported OPT activation {config.get('activation_function')!r}")
        if not config.get("layer_norm_elementwise_affine", True):
            raise ValueError("OPT without elementwise-affine LayerNorm is not supported")

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.pre_norm = bool(config.get("do_layer_norm_before", True))
        self.final_norm = self.pre_norm and not config.get("_remove_final_layer_norm", False)
        self.projected = config.get("word_embed_proj_dim", self.spec.hidden_size) != self.spec.hidden_size
        self.bias = bool(config.get("enable_bias", True))
        self.act = _ACTIVATIONS[config.get("activation_function", "relu")]

    def embedding_names(self) -> dict[str, str]:
        names = {"embed": f"{_PREFIX}embed_tokens.weight", "positions": f"{_PREFIX}embed_positions.weight"}
        if self.projected:
            names["project_in"] = f"{_PREFIX}project_in.weight"
        return names

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"{_PREFIX}layers.{layer}."
        linear = {
            "q": "self_attn.q_proj",
            "k": "self_attn.k_proj",
            "v": "self_attn.v_proj",
            "o": "self_attn.out_proj",
            "fc1": "fc1",
            "fc2": "fc2",
        }
        norms = module_names(p, {"ln_1": "self_attn_layer_norm", "ln_2": "final_layer_norm"})
        return norms | module_names(p, linear, bias=self.bias)

    def head_names(self) -> dict[str, str]:
        lm_head = self.embedding_names()["embed"] if self.spec.tie_word_embeddings else "lm_head.weight"
        names = {"lm_head": lm_head}
        if self.final_norm:
            names |= {"norm": f"{_PREFIX}final_layer_norm.weight", "norm_bias": f"{_PREFIX}final_layer_norm.bias"}
        if self.projected:
            names["project_out"] = f"{_PREFIX}project_out.weight"
        return names

    def context(self, geometry: BatchGeometry, n: int, device: torch.device, dtype: torch.dtype) -> ForwardContext:
        mask, causal = bool_mask(geometry, n, device)
        return ForwardContext(geometry, geometry.cur_len - n, positions(geometry, n, device), mask, causal)

    def embed(self, w: Weights, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = F.embedding(input_ids, w["embed"])
        if self.projected:
            x = F.linear(x, w["project_in"])
        return x + F.embedding(ctx.positions + POSITION_OFFSET, w["positions"])

    def _norm(self, x: torch.Tensor, w: Weights, role: str) -> torch.Tensor:
        return F.layer_norm(x, (self.spec.hidden_size,), w[role], w[f"{role}_bias"], _EPS)

    def layer(
        self, w: Weights, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        heads = self.spec.num_heads
        x = self._norm(hidden, w, "ln_1") if self.pre_norm else hidden
        q = split_heads(F.linear(x, w["q"], w.get("q_bias")), heads)
        k = split_heads(F.linear(x, w["k"], w.get("k_bias")), heads)
        v = split_heads(F.linear(x, w["v"], w.get("v_bias")), heads)
        hidden = hidden + F.linear(attend(q, k, v, k_cache, v_cache, ctx), w["o"], w.get("o_bias"))
        if not self.pre_norm:
            hidden = self._norm(hidden, w, "ln_1")
        x = self._norm(hidden, w, "ln_2") if self.pre_norm else hidden
        x = F.linear(self.act(F.linear(x, w["fc1"], w.get("fc1_bias"))), w["fc2"], w.get("fc2_bias"))
        hidden = hidden + x
        return hidden if self.pre_norm else self._norm(hidden, w, "ln_2")

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_norm:
            hidden = self._norm(hidden, w, "norm")
        if self.projected:
            hidden = F.linear(hidden, w["project_out"])
        return F.linear(hidden, w["lm_head"])

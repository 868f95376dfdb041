"""GPT-2: learned absolute positions, pre-LayerNorm, Conv1D (transposed) weights, gelu_new."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from dejavu_engine.attention import attend, bool_mask, positions, split_heads
from dejavu_engine.family import Family, ForwardContext, SpecKeys, Weights, module_names
from dejavu_engine.geometry import BatchGeometry

_PREFIX = "transformer."


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """HF's Conv1D: weights stored ``[in, out]``, i.e. ``x @ W + b``."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])


class GPT2(Family):
    model_type = "gpt2"
    spec_keys = SpecKeys(
        num_layers=("n_layer",),
        hidden_size=("n_embd",),
        num_heads=("n_head",),
        num_kv_heads=(),
        head_dim=(),
        max_positions=("n_positions",),
    )
    transposed_roles = ("qkv", "proj", "fc", "fc_proj")  # Conv1D weights, stored [in, out]

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported GPT-2 activation {config.get('activation_function')!r}")
        if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
            raise ValueError("unsupported GPT-2 attention scaling options")

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.eps = float(config.get("layer_norm_epsilon", 1e-5))

    def embedding_names(self) -> dict[str, str]:
        return {"wte": f"{_PREFIX}wte.weight", "wpe": f"{_PREFIX}wpe.weight"}

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"{_PREFIX}h.{layer}."
        roles = {
            "ln_1": "ln_1",
            "qkv": "attn.c_attn",
            "proj": "attn.c_proj",
            "ln_2": "ln_2",
            "fc": "mlp.c_fc",
            "fc_proj": "mlp.c_proj",
        }
        return module_names(p, roles)

    def head_names(self) -> dict[str, str]:
        lm_head = self.embedding_names()["wte"] if self.spec.tie_word_embeddings else "lm_head.weight"
        return {"norm": f"{_PREFIX}ln_f.weight", "norm_bias": f"{_PREFIX}ln_f.bias", "lm_head": lm_head}

    def context(self, geometry: BatchGeometry, n: int, device: torch.device, dtype: torch.dtype) -> ForwardContext:
        mask, causal = bool_mask(geometry, n, device)
        return ForwardContext(geometry, geometry.cur_len - n, positions(geometry, n, device), mask, causal)

    def embed(self, w: Weights, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return F.embedding(input_ids, w["wte"]) + F.embedding(ctx.positions, w["wpe"])

    def layer(
        self, w: Weights, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        width, heads = self.spec.hidden_size, self.spec.num_heads
        x = F.layer_norm(hidden, (width,), w["ln_1"], w["ln_1_bias"], self.eps)
        q, k, v = conv1d(x, w["qkv"], w["qkv_bias"]).split(width, dim=-1)
        out = attend(split_heads(q, heads), split_heads(k, heads), split_heads(v, heads), k_cache, v_cache, ctx)
        hidden = hidden + conv1d(out, w["proj"], w["proj_bias"])
        x = F.layer_norm(hidden, (width,), w["ln_2"], w["ln_2_bias"], self.eps)
        x = F.gelu(conv1d(x, w["fc"], w["fc_bias"]), approximate="tanh")
        return hidden + conv1d(x, w["fc_proj"], w["fc_proj_bias"])

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(hidden, (self.spec.hidden_size,), w["norm"], w["norm_bias"], self.eps)
        return F.linear(x, w["lm_head"])

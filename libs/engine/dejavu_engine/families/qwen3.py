"""Qwen3: Llama's layer with an RMSNorm over each head of q and of k (one weight of ``head_dim`` each) between
the projection and the rotary embedding; biases per ``attention_bias``, as Llama's."""

from __future__ import annotations

import torch

from dejavu_engine.families.llama import Llama, rms_norm
from dejavu_engine.family import Weights


class Qwen3(Llama):
    model_type = "qwen3"

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"model.layers.{layer}.self_attn."
        return super().layer_names(layer) | {"q_norm": p + "q_norm.weight", "k_norm": p + "k_norm.weight"}

    def normalize_qk(self, w: Weights, qkv: torch.Tensor) -> None:
        """Each q and k head of the fused projection RMS-normalised over ``head_dim`` (transformers' arithmetic,
        :func:`rms_norm`), written back in place: v and the layout the rotary embedding reads stay as they are."""
        heads, kv_heads = self.spec.num_heads, self.spec.num_kv_heads
        q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
        q.copy_(rms_norm(q, w["q_norm"], self.eps))
        k.copy_(rms_norm(k, w["k_norm"], self.eps))

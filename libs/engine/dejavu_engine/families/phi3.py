"""Phi-3: Llama's layer with the q/k/v projections fused in one checkpoint weight (``qkv_proj``) and gate/up in
another (``gate_up_proj``), no biases; rotary ``longrope`` (also named ``su`` or ``yarn`` in its configs)."""

from __future__ import annotations

from typing import ClassVar

from dejavu_engine.families.llama import Llama
from dejavu_engine.family import Weights


class Phi3(Llama):
    model_type = "phi3"
    default_eps = 1e-5
    rope_aliases: ClassVar[dict[str, str]] = {"su": "longrope", "yarn": "longrope"}
    default_original_max = 4096  # Phi3Config's original_max_position_embeddings

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"model.layers.{layer}."
        return {
            "ln_1": p + "input_layernorm.weight",
            "qkv": p + "self_attn.qkv_proj.weight",
            "o": p + "self_attn.o_proj.weight",
            "ln_2": p + "post_attention_layernorm.weight",
            "gate_up": p + "mlp.gate_up_proj.weight",
            "down": p + "mlp.down_proj.weight",
        }

    def prepare_layer(self, w: Weights) -> Weights:
        """Nothing to fuse: the checkpoint's projections are fused already (q | k | v and gate | up, in the order
        the layer splits them)."""
        return w

"""Qwen2 (and Qwen2.5): Llama's layer with biases on the q, k and v projections (none on the output)."""

from __future__ import annotations

from dejavu_engine.families.llama import Llama


class Qwen2(Llama):
    model_type = "qwen2"

    def layer_names(self, layer: int) -> dict[str, str]:
        names = super().layer_names(layer)
        return names | {f"{r}_bias": names[r].removesuffix("weight") + "bias" for r in ("q", "k", "v")}

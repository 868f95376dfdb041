"""Qwen2 (and Qwen2.5): Llama's layer with biases on the q, k and v projections (none on the output)."""

from __future__ import annotations

from dejavu_engine.families.llama import Llama


class Qwen2(Llama):
    model_type = "qwen2"

    def biased_roles(self) -> frozenset[str]:
        """q, k and v always, and the rest per the config (as Llama)."""
        return super().biased_roles() | {"q", "k", "v"}

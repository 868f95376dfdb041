"""Mistral: Llama's layer; its checkpoints without a sliding window (``sliding_window`` null, as from v0.2 on)
or with one no narrower than the model's positions. A narrower window is refused (:meth:`Llama.check_attention`)."""

from __future__ import annotations

from dejavu_engine.families.llama import Llama


class Mistral(Llama):
    model_type = "mistral"

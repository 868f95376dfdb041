"""Mistral: Llama's layer, every layer within a sliding window of ``sliding_window`` positions where the config sets
one narrower than the model's positions (v0.1; null from v0.2 on): see :func:`~.llama.sliding_windows`."""

from __future__ import annotations

from dejavu_engine.families.llama import Llama


class Mistral(Llama):
    model_type = "mistral"

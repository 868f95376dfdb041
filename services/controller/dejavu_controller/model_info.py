"""Facts about the served checkpoint the controller needs, read from config.json without torch."""

from __future__ import annotations

import functools
import json
from pathlib import Path

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_POSITION_KEYS = ("max_position_embeddings", "n_positions")


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {folder} a prepared checkpoint (`dejavu model prepare`)?")
    return json.loads(path.read_text())


@functools.cache
def context_limit(folder: Path, configured: int) -> int:
    """Positions a request may span: the configured bound, capped at the checkpoint's own position limit
    (Llama/OPT: max_position_embeddings; GPT-2: n_positions; BLOOM's ALiBi has none)."""
    path = folder / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}  # a tokenizer-only folder: no model limit
    limits = [config[k] for k in _POSITION_KEYS if isinstance(config.get(k), int) and config[k] > 0]
    return min([configured, *limits])


def count_layers(folder: Path) -> int:
    """Decoder layers of the checkpoint in ``folder`` (Llama/OPT: num_hidden_layers; GPT-2/BLOOM: n_layer)."""
    config = _config(folder)
    path = folder / "config.json"
    for key in _LAYER_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"{path} names no layer count (looked for {', '.join(_LAYER_KEYS)})")

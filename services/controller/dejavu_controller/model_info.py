"""Facts about the served checkpoint the controller needs, read from config.json without torch."""

from __future__ import annotations

import json
from pathlib import Path

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def count_layers(folder: Path) -> int:
    """Decoder layers of the checkpoint in ``folder`` (Llama/OPT: num_hidden_layers; GPT-2/BLOOM: n_layer)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {folder} a prepared checkpoint (`dejavu model prepare`)?")
    config = json.loads(path.read_text())
    for key in _LAYER_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"{path} names no layer count (looked for {', '.join(_LAYER_KEYS)})")

"""Reading selected tensors of a safetensors checkpoint folder, without loading the rest."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dejavu_engine.checkpoint import CheckpointError


def load_config(folder: Path) -> dict[str, Any]:
    """config.json of a checkpoint folder; raises :class:`CheckpointError` if absent."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"not a checkpoint folder (no config.json): {folder}")
    return json.loads(path.read_text())


class CheckpointReader:
    """Index of tensor names -> safetensors file over all ``*.safetensors`` files of a folder.

    Reads tensors one by one through ``safe_open``, so a stage touches only its own weights.
    Names are checkpoint names; a name missing verbatim is also looked up without its first
    component (``transformer.h.0...`` -> ``h.0...``), since some checkpoints omit the base prefix.
    """

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {folder}")
        self._file_of: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                self._file_of.update(dict.fromkeys(handle.keys(), file))

    def resolve(self, name: str) -> str:
        """The stored name of checkpoint name ``name``; raises :class:`CheckpointError` if missing."""
        if name in self._file_of:
            return name
        _, _, short = name.partition(".")
        if short in self._file_of:
            return short
        raise CheckpointError(f"tensor {name!r} not found in the checkpoint")

    def load(self, names: Iterable[str], dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Tensors named ``names`` (checkpoint names, as keys), cast to ``dtype`` on ``device``."""
        by_file: dict[Path, list[str]] = {}
        for name in dict.fromkeys(names):
            by_file.setdefault(self._file_of[self.resolve(name)], []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for name in wanted:
                    tensor = handle.get_tensor(self.resolve(name))
                    tensors[name] = tensor.to(device=device, dtype=dtype).contiguous()
        return tensors

"""Reading selected tensors of a checkpoint folder (safetensors, or one GGUF file), without loading the rest.

Quantized weights stay quantized (:class:`~dejavu_engine.quant.QuantizedWeight`): an int8 tensor ``<name>``
stored with a float32 ``<name>_scale`` (``[out, 1]``, or ``[1, out]`` for a weight stored ``[in, out]``) is
int8 per output channel; a folder without safetensors but with a ``*.gguf`` file reads that file's tensors as
published (:mod:`dejavu_engine.gguf_file`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dejavu_engine.checkpoint import CheckpointError
from dejavu_engine.gguf_file import GGUFTensors
from dejavu_engine.quant import QuantizedWeight


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
        ggufs = sorted(folder.glob("*.gguf"))
        self._file_of: dict[str, Path] = {}
        self._gguf: GGUFTensors | None = None
        if not files and len(ggufs) == 1:
            try:
                self._gguf = GGUFTensors(ggufs[0])
            except ValueError as exc:
                raise CheckpointError(str(exc)) from exc
            self._file_of = dict.fromkeys(self._gguf.names(), ggufs[0])
            return
        if not files:
            raise CheckpointError(f"no *.safetensors files (nor one *.gguf file) in {folder}")
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
        """Tensors named ``names`` (checkpoint names, as keys), cast to ``dtype`` on ``device``; quantized weights
        as :class:`QuantizedWeight`, where ``dtype`` is float32 and ``device`` the CPU (else CheckpointError)."""
        by_file: dict[Path, list[str]] = {}
        for name in dict.fromkeys(names):
            by_file.setdefault(self._file_of[self.resolve(name)], []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        if self._gguf is not None:
            for name in dict.fromkeys(names):
                tensors[name] = _placed(self._gguf.load(self.resolve(name), dtype), device, dtype, name)  # type: ignore[assignment]
            return tensors
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for name in wanted:
                    stored = self.resolve(name)
                    tensor = handle.get_tensor(stored)
                    if tensor.dtype == torch.int8 and f"{stored}_scale" in self._file_of:
                        scale = self._scale(f"{stored}_scale")
                        tensors[name] = _placed(QuantizedWeight.from_stored(tensor, scale), device, dtype, name)  # type: ignore[assignment]
                        continue
                    tensors[name] = tensor.to(device=device, dtype=dtype).contiguous()
        return tensors

    def _scale(self, stored: str) -> torch.Tensor:
        with safe_open(str(self._file_of[stored]), framework="pt") as handle:
            return handle.get_tensor(stored)


def _placed(
    tensor: torch.Tensor | QuantizedWeight, device: torch.device | str, dtype: torch.dtype, name: str
) -> torch.Tensor | QuantizedWeight:
    """A float tensor moved to ``device``; a quantized weight checked against the stage's device and dtype
    (quantized weights compute in float32 on CPU)."""
    if isinstance(tensor, QuantizedWeight):
        if torch.device(device).type != "cpu" or dtype != torch.float32:
            raise CheckpointError(
                f"{name}: quantized weights ({tensor.kind}) compute in float32 on CPU, not {dtype} on {device}"
            )
        return tensor
    return tensor.to(device=device).contiguous()

"""Zero-copy byte views of numpy arrays and CPU torch tensors (what transports move)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

Buffer: TypeAlias = "np.ndarray | torch.Tensor"


def is_tensor(buf: object) -> bool:
    """Whether ``buf`` is a torch tensor, without importing torch (a process that never imported it has none)."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(buf, torch_module.Tensor)


def as_bytes(buf: Any) -> np.ndarray:
    """A flat ``uint8`` numpy view sharing memory with ``buf`` (contiguous numpy array, CPU tensor or bytes).

    Raises ``ValueError`` for non-contiguous or non-CPU buffers: transports never copy silently.
    """
    if is_tensor(buf):
        import torch

        if buf.device.type != "cpu":
            raise ValueError(f"transports move host memory; got a tensor on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("buffer must be contiguous")
        return buf.view(-1).view(torch.uint8).numpy() if buf.numel() else np.empty(0, np.uint8)
    if isinstance(buf, bytes | bytearray | memoryview):
        return np.frombuffer(buf, dtype=np.uint8)
    arr = np.asarray(buf)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)

"""Zero-copy byte views of numpy arrays and CPU torch tensors (what transports move)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

Buffer = np.ndarray | torch.Tensor


def as_bytes(buf: Any) -> np.ndarray:
    """A flat ``uint8`` numpy view sharing memory with ``buf`` (contiguous numpy array, CPU tensor or bytes).

    Raises ``ValueError`` for non-contiguous or non-CPU buffers: transports never copy silently.
    """
    if isinstance(buf, torch.Tensor):
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

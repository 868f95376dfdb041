"""Local transport: torch copies into host memory slots of another transport in the same process.

This is the device <-> host path (swapping, local replicas). Tensors may live on any device; slots
are host memory. The CUDA-only parts (pinned host memory, a side stream so copies overlap compute)
sit behind the ``_Copier`` seam and are chosen only when a tensor is on a CUDA device.
"""

from __future__ import annotations

import numpy as np
import torch

from dejavulib.buffers import Buffer
from dejavulib.errors import ClosedError, IntegrityError
from dejavulib.transport.base import Transport, check_key
from dejavulib.transport.directory import Directory
from dejavulib.transport.slots import SlotStore

_DIRECTORY: Directory[LocalTransport] = Directory("local")


def _as_tensor(buf: Buffer) -> torch.Tensor:
    tensor = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
    if not tensor.is_contiguous():
        raise ValueError("buffer must be contiguous")
    return tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)


class _Copier:
    """Host-only copies: plain ``copy_``."""

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class _CudaCopier(_Copier):
    """Pinned host slots and a side stream; ``copy`` returns once the copy has finished."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Order after work already queued on the compute stream that produced src, then run apart from it.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.stream.synchronize()


class LocalTransport(Transport):
    """Slot semantics; addresses are ``b"local:<n>"`` names valid inside one process."""

    moves_device_memory = True

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self._slots: SlotStore[torch.Tensor] = SlotStore()
        self._peers: dict[str, bytes] = {}
        self._copiers: dict[str, _Copier] = {"cpu": _Copier()}
        self._closed = False
        self._address = _DIRECTORY.register(self)

    @property
    def address(self) -> bytes:
        return self._address

    def connect(self, peer_id: str, address: bytes) -> None:
        _DIRECTORY.check(address)
        self._peers[peer_id] = address

    def _copier(self, tensor: torch.Tensor) -> _Copier:
        if tensor.device.type != "cuda":
            return self._copiers["cpu"]
        name = str(tensor.device)
        if name not in self._copiers:
            self._copiers[name] = _CudaCopier(tensor.device)
        return self._copiers[name]

    def flush(self, peer_id: str, key: int, src: Buffer, deadline_s: float) -> None:
        check_key(key)
        if self._closed:
            raise ClosedError("transport closed")
        peer = _DIRECTORY.peer(self._peers, peer_id)
        data = _as_tensor(src)
        copier = self._copier(data)
        host = peer._slots.peek(self.self_id, key)
        if host is None or host.numel() != data.numel():  # slots are reused: swapping rewrites the same chunks
            host = copier.alloc_host(data.numel())
        copier.copy(host, data)
        peer._slots.put(self.self_id, key, host)

    def fetch(self, peer_id: str, key: int, dst: Buffer, deadline_s: float) -> None:
        check_key(key)
        host = self._slots.get(peer_id, key, deadline_s)
        out = _as_tensor(dst)
        if host.numel() != out.numel():
            raise IntegrityError(f"chunk {key} from {peer_id!r} has {host.numel()} bytes, buffer {out.numel()}")
        self._copier(out).copy(out, host)

    def discard(self, peer_id: str, key: int) -> None:
        check_key(key)
        self._slots.pop(peer_id, key)

    def close(self) -> None:
        self._closed = True
        _DIRECTORY.unregister(self._address)

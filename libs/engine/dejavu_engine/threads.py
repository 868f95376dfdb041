"""torch thread configuration, done once per process before any model work."""

from __future__ import annotations

import contextlib
import os

import torch


def configure_torch_threads(n: int) -> int:
    """Use ``n`` intra-op threads (0: all cores this process may run on); return the number set.

    Inter-op parallelism is pinned to one thread where torch still allows it: stages run their
    layers sequentially, and spare threads would only contend with other processes on the host.
    """
    if n < 0:
        raise ValueError(f"thread count must be >= 0, got {n}")
    threads = n or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    # torch allows this once, before any parallel work; later calls raise and keep the first value.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return threads

"""Admission: the largest microbatch whose KV caches fit a stage's device memory budget.

A token stage of a pipeline of depth ``D`` has ``D`` microbatches in flight. Without swapping,
all ``D`` caches live on the device. With microbatch swapping (the paper's "Microbatch swapping"
section) all ``D`` caches live in host memory and the device holds only the microbatches being
computed and prefetched: two cache buffers, or one when ``D == 2`` (the paper's footnote; with one
buffer the swap-in of the next microbatch cannot overlap the current one's compute). A swapping
stage also keeps a reusable staging buffer for the copy-back of the positions a step wrote: one
position of every row, i.e. ``batch * bytes_per_token`` (the paper calls it negligible; we count it).

Pure Python: no torch. Sizes are in bytes; ``bytes_per_token`` is one position of one sequence
across the stage's layers, K and V (``KVLayout.bytes_per_token``).
"""

from __future__ import annotations

from dataclasses import dataclass


class KVBudgetError(ValueError):
    """A configuration in which not even a microbatch of one sequence fits; the message says why."""


def resident_microbatches(depth: int, swapping: bool) -> int:
    """Microbatch caches a stage holds on the device: ``D`` without swapping, else ``min(D, 2)``
    (two buffers, one computing and one prefetching; one when ``D <= 2`` per the paper)."""
    if depth < 1:
        raise ValueError(f"pipeline depth must be >= 1, got {depth}")
    if not swapping:
        return depth
    return 1 if depth <= 2 else 2


@dataclass(frozen=True)
class KVBudget:
    """One stage's KV memory question: which microbatch size fits ``device_bytes``?

    ``host_bytes`` (optional) bounds the host copies a swapping stage keeps of all ``depth`` caches.
    """

    device_bytes: int
    bytes_per_token: int
    max_len: int
    depth: int
    swapping: bool
    host_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "bytes_per_token", "max_len", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVBudget.{name} must be >= 1, got {getattr(self, name)}")
        if self.host_bytes is not None and self.host_bytes < 1:
            raise ValueError(f"KVBudget.host_bytes must be >= 1 or None, got {self.host_bytes}")

    @property
    def resident(self) -> int:
        """Microbatch caches on the device."""
        return resident_microbatches(self.depth, self.swapping)

    @property
    def microbatch_bytes_per_row(self) -> int:
        """Bytes of one sequence's whole cache (``max_len`` positions)."""
        return self.bytes_per_token * self.max_len

    def device_bytes_for(self, batch: int) -> int:
        """Device bytes a stage needs for microbatches of ``batch`` rows (caches, plus staging if swapping)."""
        staging = batch * self.bytes_per_token if self.swapping else 0
        return self.resident * batch * self.microbatch_bytes_per_row + staging

    def host_bytes_for(self, batch: int) -> int:
        """Host bytes a swapping stage needs: the caches of all ``depth`` microbatches (0 without swapping)."""
        return self.depth * batch * self.microbatch_bytes_per_row if self.swapping else 0

    def max_batch(self) -> int:
        """The largest microbatch size that fits the device (and host) budget.

        Raises :class:`KVBudgetError` when not even one sequence fits, naming the bytes needed.
        """
        per_row_device = self.device_bytes_for(1)
        batch = self.device_bytes // per_row_device
        if batch < 1:
            raise KVBudgetError(self._device_shortfall(per_row_device))
        if self.host_bytes is not None:
            per_row_host = self.host_bytes_for(1)
            if self.host_bytes < per_row_host:
                raise KVBudgetError(
                    f"host budget {self.host_bytes} B < {per_row_host} B: swapping keeps all {self.depth} "
                    f"microbatches' caches in host memory ({self.microbatch_bytes_per_row} B per sequence each)"
                )
            batch = min(batch, self.host_bytes // per_row_host)
        return batch

    def _device_shortfall(self, per_row: int) -> str:
        mode = (
            f"with swapping, {self.resident} device buffer(s) of {self.microbatch_bytes_per_row} B plus "
            f"{self.bytes_per_token} B of staging"
            if self.swapping
            else f"without swapping, all {self.depth} in-flight caches of {self.microbatch_bytes_per_row} B"
        )
        return (
            f"device KV budget {self.device_bytes} B cannot hold a microbatch of one sequence: {mode} "
            f"({self.bytes_per_token} B per token x max_len {self.max_len}) need {per_row} B" + self._swapping_hint()
        )

    def _swapping_hint(self) -> str:
        swapped = resident_microbatches(self.depth, swapping=True)
        if self.swapping or swapped >= self.depth:
            return ""
        return f"; swapping would keep only {swapped} of the {self.depth} caches on the device"


def max_microbatch_size(
    device_bytes: int, bytes_per_token: int, max_len: int, depth: int, swapping: bool, host_bytes: int | None = None
) -> int:
    """Shorthand for ``KVBudget(...).max_batch()``; raises :class:`KVBudgetError` if nothing fits."""
    return KVBudget(device_bytes, bytes_per_token, max_len, depth, swapping, host_bytes).max_batch()

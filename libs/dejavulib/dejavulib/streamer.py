"""The background streaming thread: overlaps KV (and other) transfers with compute.

``Streamer.submit*`` returns a ``Handle`` at once; one thread packs each job into the reusable staging
buffer and sends it through an ``Endpoint``, strictly in submission order (hence FIFO per
destination). Bytes in flight are bounded: a submit that would exceed ``max_inflight_bytes`` blocks
until earlier jobs complete, or raises ``BackPressureTimeout`` past its admission deadline. A job
that fails (dead peer, deadline) fails only its own handle; the thread goes on with the next job.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dejavulib.buffers import Buffer
from dejavulib.endpoint import Endpoint
from dejavulib.errors import BackPressureTimeout, ClosedError
from dejavulib.handle import Handle
from dejavulib.header import DType, Header
from dejavulib.kvcache import KVCache, StagingBuffer
from dejavulib.layout import Region

log = logging.getLogger(__name__)

Producer = Callable[[StagingBuffer], Buffer]


@dataclass(frozen=True)
class _Job:
    peer_id: str
    header: Header
    produce: Producer
    nbytes: int
    deadline_s: float
    handle: Handle


class Streamer:
    """See the module docstring. Thread-safe; ``close`` fails jobs still queued with ``ClosedError``."""

    def __init__(self, endpoint: Endpoint, max_inflight_bytes: int, staging: StagingBuffer | None = None) -> None:
        self.endpoint = endpoint
        self.max_inflight_bytes = max_inflight_bytes
        self._staging = staging or StagingBuffer()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"streamer-{endpoint.self_id}", daemon=True)
        self._thread.start()

    @property
    def inflight_bytes(self) -> int:
        with self._cond:
            return self._inflight

    def submit(self, peer_id: str, header: Header, payload: Buffer, deadline_s: float,
               admit_deadline_s: float | None = None) -> Handle:  # fmt: skip
        """Send ``payload`` (kept unchanged by the caller until the handle completes) after earlier jobs."""
        nbytes = payload.numel() * payload.element_size() if isinstance(payload, torch.Tensor) else payload.nbytes
        return self._enqueue(peer_id, header, lambda _staging: payload, nbytes, deadline_s, admit_deadline_s)

    def submit_region(self, peer_id: str, header: Header, cache: KVCache, region: Region, deadline_s: float,
                      admit_deadline_s: float | None = None) -> Handle:  # fmt: skip
        """Pack ``region`` of ``cache`` on the streaming thread (buffered copy) and send it with ``header``.

        The region must not be written again until the handle completes (prompt layers already computed
        and past decode positions are not). ``header`` gets the cache's dtype, the packed shape and ``which``;
        its layers/rows/positions, if left at ``(0, 0)``, become the region's (same place at the destination).
        """
        nbytes = region.nbytes(cache.layout)
        header = replace(header, dtype=DType.from_name(cache.layout.dtype), shape=(), which=int(region.which))
        for name in ("layers", "rows", "positions"):
            if getattr(header, name) == (0, 0):
                header = replace(header, **{name: getattr(region, name)})

        def produce(staging: StagingBuffer) -> Buffer:
            packed = cache.pack(region, staging.get(nbytes)).reshape(-1)
            return packed if packed.device.type == "cpu" else packed.cpu()

        return self._enqueue(peer_id, header, produce, nbytes, deadline_s, admit_deadline_s)

    def drain(self, timeout_s: float) -> None:
        """Block until every submitted job has completed (successfully or not)."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._inflight:
                left = end - time.monotonic()
                if left <= 0:
                    raise BackPressureTimeout(f"streamer not drained within {timeout_s} s")
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._cond.notify_all()
        for job in jobs:
            job.handle.set_done(ClosedError("streamer closed"))
        self._thread.join(10)

    def _enqueue(self, peer_id: str, header: Header, produce: Producer, nbytes: int, deadline_s: float,
                 admit_deadline_s: float | None) -> Handle:  # fmt: skip
        admit = deadline_s if admit_deadline_s is None else admit_deadline_s
        end = time.monotonic() + admit
        with self._cond:
            # A job larger than the bound alone is admitted when nothing else is in flight.
            while self._inflight and self._inflight + nbytes > self.max_inflight_bytes:
                left = end - time.monotonic()
                if self._closed:
                    raise ClosedError("streamer closed")
                if left <= 0:
                    raise BackPressureTimeout(
                        f"{self._inflight} bytes in flight; {nbytes} more would exceed {self.max_inflight_bytes}"
                    )
                self._cond.wait(left)
            if self._closed:
                raise ClosedError("streamer closed")
            handle = Handle(nbytes)
            self._inflight += nbytes
            self._jobs.append(_Job(peer_id, header, produce, nbytes, deadline_s, handle))
            self._cond.notify_all()
        return handle

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            error: BaseException | None = None
            try:
                payload = job.produce(self._staging)
                self.endpoint.send(job.peer_id, job.header, payload, job.deadline_s).wait()
            except Exception as exc:  # the job's own failure; the streamer keeps serving others
                log.warning("streaming %d bytes to %s failed: %s", job.nbytes, job.peer_id, exc)
                error = exc
            with self._cond:
                self._inflight -= job.nbytes
                self._cond.notify_all()
            job.handle.set_done(error)

"""The background streaming thread: every message a worker sends, KV packed off the compute thread.

``Streamer.submit*`` returns a ``Handle`` at once; one thread takes the jobs in submission order
(hence FIFO per destination, across channels), packs a KV region into a staging buffer (the buffered
copy: one strided copy per tensor) and hands it to the ``Endpoint``, which seals it (the payload MAC is
computed here too, not on the caller's thread). Sends are pipelined: the thread does not wait for one
to complete before the next; a staging buffer returns to a small pool when its send completes and is
reused for later jobs. Bytes in flight are bounded: a submit that would exceed ``max_inflight_bytes``
blocks until earlier jobs complete, or raises ``BackPressureTimeout`` past its admission deadline. A
job that fails (dead peer, its deadline) fails only its own handle; a send still pending at its
deadline is failed with ``TransferTimeout`` and its buffer left to the transport (never reused while
the transport may still read it), so a dead peer cannot hold the bound forever.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dejavulib.buffers import Buffer
from dejavulib.endpoint import Endpoint
from dejavulib.errors import BackPressureTimeout, ClosedError, TransferTimeout
from dejavulib.handle import Handle
from dejavulib.header import DType, Header
from dejavulib.kvcache import KVCache, StagingBuffer
from dejavulib.layout import Region

log = logging.getLogger(__name__)

# A producer turns a job into its payload; it may take a staging buffer from the pool (returned when
# the send completes) or return a buffer of its own (None: nothing to give back).
Producer = Callable[["_Pool"], tuple[Buffer, "StagingBuffer | None"]]

#: Staging buffers kept for reuse once their sends complete (more are made while more are in flight).
POOL_SIZE = 4


class _Pool:
    """Staging buffers free for reuse (on the streamer's device), at most ``size`` of them."""

    def __init__(self, device: str | torch.device, pin: bool, size: int = POOL_SIZE) -> None:
        self.device, self.pin, self.size = device, pin, size
        self._free: list[StagingBuffer] = []
        self._lock = threading.Lock()

    def take(self) -> StagingBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        return StagingBuffer(self.device, self.pin)

    def give(self, staging: StagingBuffer) -> None:
        with self._lock:
            if len(self._free) < self.size:
                self._free.append(staging)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


@dataclass
class _Job:
    peer_id: str
    header: Header
    produce: Producer
    nbytes: int
    deadline_s: float
    handle: Handle
    deadline: float = 0.0  # monotonic, set when the send starts
    queued_at: float = field(default_factory=time.monotonic)  # when it was submitted
    staging: StagingBuffer | None = None
    settled: bool = False  # completed, failed or expired: its bytes no longer count


class Streamer:
    """See the module docstring. Thread-safe; ``close`` fails jobs still queued with ``ClosedError``."""

    def __init__(
        self, endpoint: Endpoint, max_inflight_bytes: int, device: str | torch.device = "cpu", pin: bool = False
    ) -> None:
        self.endpoint = endpoint
        self.max_inflight_bytes = max_inflight_bytes
        # Called on the streaming thread with each message's header and size as its send starts (accounting).
        self.observe: Callable[[Header, int], None] = lambda header, nbytes: None
        # Called once per message when it is settled (sent, failed or past its deadline), on whichever thread
        # settles it, with its peer, header, size, seconds since it was submitted and error (None: sent).
        self.settled: Callable[[str, Header, int, float, BaseException | None], None] = _ignore_settled
        # Called on the streaming thread if the thread itself fails (not one job: those fail their handles);
        # a worker points it at ending its process, since nothing it sends would leave any more.
        self.on_failure: Callable[[BaseException], None] = lambda exc: log.critical("streamer is dead: %s", exc)
        self._pool = _Pool(device, pin)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._sending: collections.deque[_Job] = collections.deque()  # sent, not yet settled, oldest first
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"streamer-{endpoint.self_id}", daemon=True)
        self._thread.start()

    @property
    def inflight_bytes(self) -> int:
        with self._cond:
            self._expire()
            return self._inflight

    def submit(self, peer_id: str, header: Header, payload: Buffer, deadline_s: float,
               admit_deadline_s: float | None = None) -> Handle:  # fmt: skip
        """Send ``payload`` (kept unchanged by the caller until the handle completes) after earlier jobs."""
        nbytes = payload.numel() * payload.element_size() if isinstance(payload, torch.Tensor) else payload.nbytes
        return self._enqueue(peer_id, header, lambda _pool: (payload, None), nbytes, deadline_s, admit_deadline_s)

    def submit_region(self, peer_id: str, header: Header, cache: KVCache, region: Region, deadline_s: float,
                      admit_deadline_s: float | None = None) -> Handle:  # fmt: skip
        """Pack ``region`` of ``cache`` on the streaming thread (buffered copy) and send it with ``header``.

        The region must not be written again until the handle completes (prompt layers already computed
        and past decode positions are not). ``header`` gets the cache's dtype, the packed shape and ``which``;
        its layers/rows/positions, if left at ``(0, 0)``, become the region's (same place at the destination).
        """
        region.check_within(cache.layout)
        nbytes = region.nbytes(cache.layout)
        header = region_header(header, cache, region)

        def produce(pool: _Pool) -> tuple[Buffer, StagingBuffer | None]:
            staging = pool.take()
            packed = cache.pack(region, staging.get(nbytes)).reshape(-1)
            if packed.device.type != "cpu":
                return packed.cpu(), None  # a host copy the transport can read; the device buffer is free again
            return packed, staging

        return self._enqueue(peer_id, header, produce, nbytes, deadline_s, admit_deadline_s)

    def drain(self, timeout_s: float) -> None:
        """Block until every submitted job has completed (successfully or not)."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._inflight:
                self._expire()
                if not (self._jobs or self._inflight):
                    return
                left = end - time.monotonic()
                if left <= 0:
                    raise BackPressureTimeout(f"streamer not drained within {timeout_s} s")
                self._cond.wait(min(left, 0.1))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._cond.notify_all()
        for job in jobs:
            job.handle.set_done(ClosedError("streamer closed"))
        self._thread.join(10)
        self._pool.clear()

    def _enqueue(self, peer_id: str, header: Header, produce: Producer, nbytes: int, deadline_s: float,
                 admit_deadline_s: float | None) -> Handle:  # fmt: skip
        admit = deadline_s if admit_deadline_s is None else admit_deadline_s
        end = time.monotonic() + admit
        with self._cond:
            # A job larger than the bound alone is admitted when nothing else is in flight.
            while True:
                self._expire()
                if not (self._inflight and self._inflight + nbytes > self.max_inflight_bytes):
                    break
                left = end - time.monotonic()
                if self._closed:
                    raise ClosedError("streamer closed")
                if left <= 0:
                    raise BackPressureTimeout(
                        f"{self._inflight} bytes in flight; {nbytes} more would exceed {self.max_inflight_bytes}"
                    )
                self._cond.wait(min(left, 0.1))
            if self._closed:
                raise ClosedError("streamer closed")
            handle = Handle(nbytes, deadline_s)
            self._inflight += nbytes
            self._jobs.append(_Job(peer_id, header, produce, nbytes, deadline_s, handle))
            self._cond.notify_all()
        return handle

    def _settle(self, job: _Job, error: BaseException | None, reuse: bool) -> None:
        """Count ``job`` as finished (once): its bytes leave the bound, its buffer returns to the pool
        when the transport is done with it (``reuse``), its handle completes."""
        with self._cond:
            if job.settled:
                if reuse and job.staging is not None:
                    self._pool.give(job.staging)  # an expired send completed after all: its buffer is free
                return
            job.settled = True
            self._inflight -= job.nbytes
            self._cond.notify_all()
        if reuse and job.staging is not None:
            self._pool.give(job.staging)
        self.settled(job.peer_id, job.header, job.nbytes, time.monotonic() - job.queued_at, error)
        job.handle.set_done(error)

    def _expire(self) -> None:
        """Fail sends past their deadline (their buffers stay with the transport). Call with the lock held."""
        now = time.monotonic()
        while self._sending and (self._sending[0].settled or self._sending[0].deadline < now):
            job = self._sending.popleft()
            if job.settled:
                continue
            job.settled = True
            self._inflight -= job.nbytes
            log.warning("a send of %d bytes to %s did not complete within %.1f s", job.nbytes, job.peer_id,
                        job.deadline_s)  # fmt: skip
            error = TransferTimeout(f"send of {job.nbytes} bytes to {job.peer_id} past its deadline")
            self.settled(job.peer_id, job.header, job.nbytes, now - job.queued_at, error)
            job.handle.set_done(error)
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the thread's own failure: every queued job fails, then the owner decides
            log.exception("the streaming thread of %s failed", self.endpoint.self_id)
            with self._cond:
                self._closed = True
                jobs, self._jobs = list(self._jobs), collections.deque()
                self._cond.notify_all()
            for job in jobs:
                job.handle.set_done(ClosedError(f"streamer failed: {exc}"))
            self.on_failure(exc)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._expire()
                    self._cond.wait(0.1 if self._sending else None)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                payload, job.staging = job.produce(self._pool)
                job.deadline = time.monotonic() + job.deadline_s
                sent = self.endpoint.send(job.peer_id, job.header, payload, job.deadline_s)
                self.observe(job.header, job.nbytes)
            except Exception as exc:  # the job's own failure; the streamer keeps serving others
                log.warning("streaming %d bytes to %s failed: %s", job.nbytes, job.peer_id, exc)
                self._settle(job, exc, reuse=True)
                continue
            with self._cond:
                self._sending.append(job)
            sent.add_done_callback(functools.partial(self._sent, job))

    def _sent(self, job: _Job, handle: Handle) -> None:
        self._on_sent(job, handle.error)

    def _on_sent(self, job: _Job, error: BaseException | None) -> None:
        if error is not None:
            log.warning("streaming %d bytes to %s failed: %s", job.nbytes, job.peer_id, error)
        # A failed send's buffer is not reused: the failure may be the transport giving up on a transfer
        # it still runs (a forgotten peer's), which may still read it.
        self._settle(job, error, reuse=error is None)


def _ignore_settled(peer_id: str, header: Header, nbytes: int, seconds: float, error: BaseException | None) -> None:
    pass


def region_header(header: Header, cache: KVCache, region: Region) -> Header:
    """``header`` describing a packed ``region`` of ``cache``: the cache's dtype, ``which``, and the
    region's layers/rows/positions wherever ``header`` leaves them at ``(0, 0)`` (same place at the
    destination)."""
    header = replace(header, dtype=DType.from_name(cache.layout.dtype), shape=(), which=int(region.which))
    for name in ("layers", "rows", "positions"):
        if getattr(header, name) == (0, 0):
            header = replace(header, **{name: getattr(region, name)})
    return header

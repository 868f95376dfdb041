"""The stages after stage 0 of a request-scheduled pipeline: compute each pass as it comes, hand it on.

A stage after the first keeps no books: stage 0's policy names every block (its :class:`~dejavu_common.sched.
BlockBook` hands out ids the pools of every stage use), so a pass's slices say where each request's positions go
on this stage too. A middle stage computes its layers and sends the hidden states on; the last computes its layers
and the logits, its :class:`Emitter` samples and publishes, and it returns what each request sampled to stage 0
(:class:`~dejavu_worker.dataplane.PassReturn`). Passes arrive in the order stage 0 sent them and a request is in
one pass in flight at most, so each request's positions are written in order on every stage, and a block stage 0
hands out again was last written by a pass that has returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from dejavu_common.errors import DeadlineExceeded
from dejavu_engine.geometry import Slice
from dejavu_engine.stage_io import StageIO
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.emitter import Emitter, Record
from dejavu_token_worker.executor import PassLogits, SliceExecutor, request_layout
from dejavu_token_worker.recovery import Restored
from dejavu_token_worker.replication import ReplicaSender
from dejavu_token_worker.runner import STEP_FAILURES
from dejavu_worker.dataplane import Outcome, PassReturn, SlicePass
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.lifecycle import SERVE_RETRYABLE
from dejavu_worker.metrics import PassKind, WorkerMetrics
from dejavulib.paged import PagedKVCache
from dejavulib.streaming import stream_in

log = logging.getLogger("dejavu.token_worker.follow")


class _Abandoned(Exception):
    """A newer epoch began while a pass waited here: nobody waits for its answer."""


class _Missing(Exception):
    """One request of a pass cannot be computed here (its prompt KV never came, or does not fit it)."""

    def __init__(self, mb: int, why: str) -> None:
        super().__init__(why)
        self.mb = mb


class SliceFollower:
    """A stage > 0 of a request-scheduled pipeline. Its books: per request, the table and the positions this stage
    wrote of it (what a repair's progress report and a replaced neighbour's restore read), and the KV a restore
    brought for requests whose tables the next pass names. ``emitter``: the last stage's."""

    def __init__(
        self,
        executor: SliceExecutor,
        endpoint: DataEndpoint,
        emitter: Emitter | None,
        arrivals: PromptArrivals | None = None,
        kv_deadline_s: float = 60.0,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.executor = executor
        self.metrics = metrics
        self.endpoint = endpoint
        self.emitter = emitter
        self.arrivals = arrivals  # disaggregated: the prompt KV the prompt pipeline streams here
        self.kv_deadline_s = kv_deadline_s
        self.stop: Callable[[], bool] = lambda: False
        self.next_peer: str | None = None
        self.first_peer = ""
        self.replicas: ReplicaSender | None = None
        self.on_ended: Callable[[Iterable[int]], None] = lambda mbs: None  # the stage forgets their replicas
        self.held: dict[int, tuple[tuple[int, ...], int]] = {}  # request -> (its table, positions written here)
        self.restores: dict[int, Restored] = {}  # request -> its KV on this stage, restored from a replica

    def connect(self, next_peer: str | None, first_peer: str, replicas: ReplicaSender | None) -> None:
        """Serve an epoch: the stage after this one (None on the last), stage 0, the successor replicas go to."""
        if (next_peer is None) != (self.emitter is not None):
            raise ValueError("the last stage (no next peer) samples, and only it")
        self.next_peer, self.first_peer, self.replicas = next_peer, first_peer, replicas

    # -- what recovery reads and sets -----------------------------------------------------------------
    def progress(self) -> dict[int, int]:
        """Per request, the last position this stage holds (a repair resumes each from what every stage holds)."""
        return {mb: end - 1 for mb, (_table, end) in list(self.held.items()) if end > 0}

    def caches(self, mbs: Iterable[int]) -> Iterator[tuple[int, PagedKVCache, int]]:
        """(request, its KV here as a cache, its last position) of each of ``mbs`` this stage holds: what a
        replaced neighbour gets back."""
        pool = self.executor.pool
        for mb in sorted(set(mbs) & set(self.held)):
            table, end = self.held[mb]
            yield mb, PagedKVCache.view(pool, request_layout(pool, len(table)), table, end), end - 1

    def keep(self, mbs: Iterable[int]) -> None:
        """Forget every request but ``mbs`` (a repair resumes those); the last stage's records start over."""
        keep = set(mbs)
        self.held = {mb: held for mb, held in self.held.items() if mb in keep}
        self.restores = {mb: r for mb, r in self.restores.items() if mb in keep}
        if self.arrivals is not None:
            self.arrivals.keep(keep)
        if self.emitter is not None:
            self.emitter.clear()

    def restored(self, parts: Iterable[Restored]) -> None:
        """Keep what a restore brought (this stage's KV of each request, from its successor's replica) until the
        request's next pass names its table."""
        for part in parts:
            self.restores[part.region.microbatch] = part

    # -- serving --------------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Follow the passes stage 0 sends until ``stop()``."""
        self.stop = stop
        while not stop():
            payload = self.endpoint.recv(Channel.ACTIVATION, timeout_s=0.05)
            if payload is None:
                continue
            try:
                msg = SlicePass.decode(bytes(payload))
            except ValueError as exc:
                log.error("dropped a malformed request-scheduled pass: %s", exc)
                continue
            self.handle(msg)

    def handle(self, msg: SlicePass) -> None:
        """Compute ``msg`` here, replicate what it wrote and hand it on (or answer stage 0, on the last stage). A
        pass that cannot be computed fails its requests (stage 0 publishes their errors; a request whose prompt KV
        never came fails alone, the others run again); one an error this stage outlives stops (Redis refusing the
        tokens) is answered ``broken``, so its requests run again from their streams, and the error goes on to the
        lifecycle."""
        try:
            self._forget(msg.ended)
            for mb in msg.released:  # preempted at stage 0: its blocks are no longer its own
                self.held.pop(mb, None)
                self.restores.pop(mb, None)
            if not msg.slices:  # only what ended
                if self.next_peer is not None:
                    self.endpoint.send(self.next_peer, Channel.ACTIVATION, msg.encode())
                return
            assert msg.tensor is not None  # a pass of slices carries their hidden states
            started = time.perf_counter()
            self._place(msg)
            pieces = [(Slice(w.table, w.start, w.length), (b for b in w.table if b >= 0)) for w in msg.slices]
            out = self.executor.forward(pieces, StageIO(hidden=msg.tensor), self._every(msg))
            for w in msg.slices:
                self.held[w.mb] = (w.table, w.start + w.length)
            self._observe(msg, time.perf_counter() - started)
            if self.replicas is not None:  # before the pass goes on: the successor has it first (FIFO per peer)
                # A request's first pass since it was admitted sends from position 0: a replica starts there.
                written = [(w.mb, w.table, 0 if w.spec is not None else w.start, w.start + w.length)
                           for w in msg.slices]  # fmt: skip
                self.replicas.send_slices(self.executor.pool, written)
            if isinstance(out, torch.Tensor):
                assert self.next_peer is not None
                forward = SlicePass(msg.pass_id, msg.slices, out, msg.ended, msg.released)
                self.endpoint.send(self.next_peer, Channel.ACTIVATION, forward.encode())
                return
            self._answer(PassReturn(pass_id=msg.pass_id, outcomes=tuple(self._emit(msg, out))))
        except _Abandoned:
            return  # a newer epoch: the pass is stage 0's to forget
        except _Missing as exc:
            log.error("pass %d: %s", msg.pass_id, exc)
            self._answer(PassReturn(pass_id=msg.pass_id, error=str(exc), failed=(exc.mb,)))
        except SERVE_RETRYABLE:
            self._answer(PassReturn(pass_id=msg.pass_id, broken=True))
            raise
        except STEP_FAILURES as exc:
            log.error("pass %d failed here: %r", msg.pass_id, exc)
            self._answer(PassReturn(pass_id=msg.pass_id, error=f"{type(exc).__name__}: {exc}"))

    def _forget(self, ended: Iterable[int]) -> None:
        ended = list(ended)
        for mb in ended:
            self.held.pop(mb, None)
            self.restores.pop(mb, None)
        if self.arrivals is not None:
            self.arrivals.drop(ended)
        if self.emitter is not None:
            self.emitter.forget(ended)
        if ended:
            self.on_ended(ended)

    def _place(self, msg: SlicePass) -> None:
        """Write into the blocks the pass's tables name here the KV of its requests that came from elsewhere: the
        prompt KV the prompt pipeline streamed (a request's first pass after stage 0 admitted it: waited for, up
        to the transport deadline for the whole pass, as it may still be on its way) and what a restore brought."""
        pool = self.executor.pool
        end_by = time.monotonic() + self.kv_deadline_s
        for w in msg.slices:
            if w.streamed and self.arrivals is not None:
                try:
                    self.arrivals.wait(w.mb, max(0.0, end_by - time.monotonic()), self.stop)
                except DeadlineExceeded as exc:
                    if self.stop():
                        raise _Abandoned from exc
                    raise _Missing(w.mb, f"the prompt KV of request {w.mb} did not reach this stage") from exc
                try:
                    end = self.arrivals.place(w.mb, pool, w.table, w.cached)
                except ValueError as exc:
                    raise _Missing(w.mb, str(exc)) from exc
                self.held[w.mb] = (w.table, end)
            part = self.restores.pop(w.mb, None)
            if part is None:
                continue
            end = part.region.positions[1]
            if part.region.positions[0] != 0 or end > len(w.table) * pool.geometry.block_size:
                raise ValueError(f"the restored KV of request {w.mb} (positions {part.region.positions}) does not "
                                 f"fit its table of {len(w.table)} blocks")  # fmt: skip
            pool.ensure(b for b in w.table if b >= 0)
            stream_in(PagedKVCache.view(pool, request_layout(pool, len(w.table)), w.table, end), part.message,
                      part.region)  # fmt: skip
            self.held[w.mb] = (w.table, end)

    def _observe(self, msg: SlicePass, seconds: float) -> None:
        if self.metrics is None:
            return
        decode = [w.length == 1 for w in msg.slices]  # one token: the one sampled last (a prompt of one, rarely)
        kind = PassKind.MIXED if any(decode) and not all(decode) else PassKind.DECODE if all(decode) else (
            PassKind.PREFILL)  # fmt: skip
        self.metrics.observe_pass(kind, seconds, sum(w.length for w in msg.slices))

    def _every(self, msg: SlicePass) -> set[int]:
        return {i for i, w in enumerate(msg.slices) if w.every} if self.emitter is not None else set()

    def _emit(self, msg: SlicePass, out: PassLogits) -> list[Outcome]:
        assert self.emitter is not None
        self.emitter.forget(msg.ended)
        records: dict[int, Record | None] = {}
        for i, w in enumerate(msg.slices):
            if w.samples or w.every or w.spec is not None:  # a spec comes once: its record is begun now
                records[i] = self.emitter.record(w)
        for i, logits in out.every.items():
            record = records.get(i)
            if record is not None:
                self.emitter.note_prompt_logprobs(record, msg.slices[i].start, logits)
        sampling = [i for i, w in enumerate(msg.slices) if w.samples]
        live = [i for i in sampling if records[i] is not None]
        gone = [Outcome(mb=msg.slices[i].mb, token=-1, ended=True) for i in sampling if records[i] is None]
        if not live:
            return gone
        index = torch.tensor(live, dtype=torch.long, device=out.last.device)
        chosen = [records[i] for i in live]
        return self.emitter.sample([r for r in chosen if r is not None], out.last[index]) + gone

    def _answer(self, answer: PassReturn) -> None:
        self.endpoint.send(self.first_peer, Channel.TOKENS, answer.encode())

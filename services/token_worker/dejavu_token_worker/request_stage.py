"""A token worker's stage of a request-scheduled pipeline, and how the worker wires it.

Where settings say the pipeline schedules requests (:func:`schedules_requests`), a token stage computes passes of
per-request slices over a paged pool (:class:`SliceExecutor`) instead of cohorts: stage 0 runs the pipeline's
:class:`RequestLoop`, whose book hands out the block ids of every stage's pool, and the stages after it follow its
passes (:class:`SliceFollower`); the last stage's :class:`Emitter` samples (stage 0's, on a one-stage pipeline).
Disaggregated, each stage keeps the prompt KV the prompt pipeline streams to it until the request's first pass
names its blocks (:class:`PromptArrivals`).

Stage 0's book and the later stages' pools are sized apart, each by the memory its host has. So stage 0 publishes
how many blocks its book hands out as it begins serving each epoch (the ``book_blocks`` field of its registry
record, with the layers it serves), and a later stage waits for that before following its passes: one whose pool
cannot hold that many blocks of its own layers refuses to serve (:class:`PoolTooSmall`, with the numbers, which ends
the worker), rather than failing requests once the book hands out ids past its pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

import redis

from dejavu_common import keys, tracing
from dejavu_common.messages import MicrobatchSpec, PromptTask, StageAssignment, Topology
from dejavu_common.sched import BlockBook, Budget, Scheduler
from dejavu_common.settings import Mode, Settings
from dejavu_common.signing import EntrySigner
from dejavu_common.tracing import RowSpans
from dejavu_engine.stage import Stage
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.downstream import Downstream
from dejavu_token_worker.driver import ensure_group
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import SliceExecutor
from dejavu_token_worker.follow import SliceFollower
from dejavu_token_worker.loop import RequestLoop
from dejavu_token_worker.memory import pool_blocks
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.recovery import Restored
from dejavu_token_worker.replication import ReplicaSender
from dejavu_token_worker.runner import Position
from dejavu_worker.endpoint import DataEndpoint
from dejavu_worker.metrics import WorkerMetrics
from dejavulib.paged import BlockGeometry, BlockPool, PagedKVCache

log = logging.getLogger("dejavu.token_worker")

BOOK_FIELD = "book_blocks"  # stage 0's registry record: "<first layer>:<end layer>:<blocks its book hands out>"


class PoolTooSmall(RuntimeError):
    """A later stage's pool holds fewer blocks than stage 0's book hands out: it would fail requests mid-way."""


def schedules_requests(settings: Settings, stage: Stage) -> bool:
    """Whether ``stage`` belongs to a request-scheduled pipeline: ``Settings.schedules_requests``, which the controller
    and every worker read alike, so every stage of a pipeline agrees; a stage without the native paged kernels
    attends through torch (``Stage.native_slices``)."""
    requests = settings.schedules_requests
    if requests and not stage.native_slices:
        log.warning("request scheduling without the native paged kernels here: passes attend through torch")
    return requests


def slice_executor(settings: Settings, stage: Stage, topology: Topology) -> SliceExecutor:
    """The executor of a request-scheduled stage over a new paged pool. Stage 0's book hands out the block ids of
    every stage's pool, so each stage sizes its pool by the stage of the pipeline with the most layers (the same
    memory gives each the same number of blocks); a later stage allows a quarter more, as its slabs are made only
    as ids are used and the memory each stage finds available at load differs a little."""
    engine = settings.engine
    geometry = BlockGeometry.of(stage.kv_layout(1, 1), engine.kv_block_size)
    widest = max(a.layers[1] - a.layers[0] for a in topology.token_stages)
    blocks = pool_blocks(settings, replace(geometry, layers=widest))
    if stage.layers[0] > 0:
        blocks += blocks // 4
    return SliceExecutor(stage, stage.block_pool(engine.kv_block_size, blocks))


def request_loop(
    settings: Settings,
    executor: SliceExecutor,
    emitter: Emitter,
    client: redis.Redis,
    worker_id: str,
    metrics: WorkerMetrics,
    held: list[PromptTask],
    ready: ReadyPrompts | None,
    arrivals: PromptArrivals | None,
    depth: int,
) -> RequestLoop:
    """Stage 0's loop and its policy, whose book hands out the blocks of every stage's pool."""
    engine, m = settings.engine, settings.model
    pool = executor.pool
    # Equal token ids give other KV under another model, dtype or block size: none of them may hit.
    namespace = f"{m.folder}|{m.dtype}|{engine.kv_block_size}".encode()
    book = BlockBook(pool.max_blocks, engine.kv_block_size, namespace, caching=engine.prefix_caching)
    budget = Budget(tokens=engine.token_budget, max_running=settings.controller.max_running, depth=depth)
    log.info(
        "request scheduling: a paged pool of up to %d blocks of %d positions (%.1f GB), %d positions a pass, "
        "prefix caching %s",
        pool.max_blocks,
        engine.kv_block_size,
        pool.max_blocks * pool.geometry.bytes_per_block / 1e9,
        engine.token_budget,
        "on" if engine.prefix_caching else "off",
    )
    return RequestLoop(
        Scheduler(book, budget, executor.stage.model_kv_window),  # blocks out of every layer's window go back
        executor,
        client,
        worker_id,
        metrics,
        emitter,
        held,
        engine.max_recomputes,
        ready=ready,
        arrivals=arrivals,
        kv_deadline_s=settings.transport.deadline_s,
        depth=depth,
    )


def publish_book(client: redis.Redis, worker_id: str, layers: tuple[int, int], blocks: int) -> None:
    """Say in stage 0's registry record (worker ``worker_id``, serving ``layers``) how many blocks its book hands
    out."""
    client.hset(keys.worker(worker_id), BOOK_FIELD, f"{layers[0]}:{layers[1]}:{blocks}")


def book_blocks(
    client: redis.Redis, first: StageAssignment, stop: Callable[[], bool], warn_after_s: float = 60.0
) -> int | None:
    """The blocks the book of stage 0 (``first``) hands out, as it published them for the layers it serves: waited
    for (stage 0 publishes them as it begins serving an epoch, before it sends a pass; a wait past ``warn_after_s``
    is logged, once); None once ``stop()``. A record of other layers, or one that does not parse, is not stage 0's
    now: waited past."""
    prefix = f"{first.layers[0]}:{first.layers[1]}:"
    warn_at = time.monotonic() + warn_after_s
    while not stop():
        raw = client.hget(keys.worker(first.worker_id), BOOK_FIELD)
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        if text is not None and text.startswith(prefix) and text[len(prefix) :].isdigit():
            return int(text[len(prefix) :])
        if time.monotonic() > warn_at:
            log.warning("still waiting for stage 0 (%s) to say how many blocks its book of layers %s hands out "
                        "(its record says %r)", first.worker_id, first.layers, text)  # fmt: skip
            warn_at = float("inf")
        time.sleep(0.1)
    return None


def check_pool(pool: BlockPool, book: int, index: int) -> None:
    """Raise :class:`PoolTooSmall` where ``pool`` (token stage ``index``'s) holds fewer than ``book`` blocks."""
    if book <= pool.max_blocks:
        return
    have, want = (n * pool.geometry.bytes_per_block / 1e9 for n in (pool.max_blocks, book))
    raise PoolTooSmall(
        f"token stage {index}'s KV pool holds {pool.max_blocks} blocks of its layers ({have:.2f} GB), but stage 0's "
        f"book hands out {book} ({want:.2f} GB here): requests would fail once it hands out the blocks past this "
        "pool. Give this stage a host with more memory available, or bound every stage's pool alike with "
        "engine.kv_pool_bytes"
    )


def trace_arrival(spec: MicrobatchSpec, stage: int, first_ns: int) -> None:
    """The ``dejavu.kv_stream`` span of a traced request of a request-scheduled pipeline: its prompt KV arriving at
    this token stage, from the first message to the last."""
    attributes = {tracing.STAGE: stage, "dejavu.kv_cells": spec.prompt_len}
    spans = RowSpans.start("dejavu.kv_stream", spec.rows, attributes, start_ns=first_ns, mb_id=spec.mb_id)
    if spans is not None:
        spans.end()


class RequestStage:
    """A token worker's stage of a request-scheduled pipeline: its ``executor`` over the paged pool, its
    ``emitter`` (sampling on the last stage), the prompt KV arriving (``arrivals``, disaggregated), and stage 0's
    ``loop`` or a later stage's ``follower``."""

    def __init__(
        self,
        executor: SliceExecutor,
        emitter: Emitter,
        arrivals: PromptArrivals | None = None,
        loop: RequestLoop | None = None,
        follower: SliceFollower | None = None,
    ) -> None:
        if (loop is None) == (follower is None):
            raise ValueError("a request-scheduled stage is stage 0 (a loop) or a later one (a follower)")
        self.executor = executor
        self.emitter = emitter
        self.arrivals = arrivals
        self.loop = loop
        self.follower = follower
        # Stage 0 taken over by a repair: its own KV restored from stage 1's replica, and each resumed request's
        # table as stage 1 holds it (the resume point's), from which its new book takes the requests over.
        self.restores: dict[int, Restored] = {}
        self.adopting: dict[int, tuple[int, ...]] = {}

    @classmethod
    def build(
        cls,
        settings: Settings,
        stage: Stage,
        assignment: StageAssignment,
        topology: Topology,
        client: redis.Redis,
        endpoint: DataEndpoint,
        signer: EntrySigner | None,
        metrics: WorkerMetrics,
        worker_id: str,
        held: list[PromptTask],
        ready: ReadyPrompts | None,
        spec_of: Callable[[int], MicrobatchSpec],
    ) -> RequestStage:
        """Wire ``assignment``'s stage of ``topology``'s request-scheduled pipeline. ``held``: the colocated tasks
        the worker keeps across epochs; ``ready``: stage 0's announcements (disaggregated); ``spec_of``: reads a
        request's spec."""
        executor = slice_executor(settings, stage, topology)
        emitter = Emitter(client, signer, stage.spec.eos_token_ids)
        arrivals = None
        if topology.mode == Mode.DISAGGREGATED.value:
            index = assignment.stage
            arrivals = PromptArrivals(assignment.layers, spec_of, lambda a: trace_arrival(a.spec, index, a.first_ns))
        depth = len(topology.token_stages)
        if assignment.stage == 0:
            loop = request_loop(settings, executor, emitter, client, worker_id, metrics, held, ready, arrivals, depth)
            return cls(executor, emitter, arrivals, loop=loop)
        last = emitter if assignment.stage == depth - 1 else None
        follower = SliceFollower(executor, endpoint, last, arrivals, settings.transport.deadline_s, metrics)
        return cls(executor, emitter, arrivals, follower=follower)

    # -- what a repair and the metrics read -------------------------------------------------------------
    def held(self) -> dict[int, int]:
        """Per request, the last position this stage holds (read without locks)."""
        if self.loop is not None:
            return dict(self.loop.requests.progress())
        assert self.follower is not None
        return dict(self.follower.progress())

    def tables(self) -> dict[int, tuple[int, ...]] | None:
        """A later stage's requests' block tables (what a replacement of stage 0 rebuilds its book from)."""
        if self.follower is None:
            return None
        return {mb: table for mb, (table, end) in list(self.follower.held.items()) if end > 0}

    def progress(self, depth: int) -> dict[int, int]:
        """What this stage reports holding to a repair of a pipeline of ``depth`` stages: :meth:`held`, but nothing
        from a one-stage pipeline (its requests all re-run, from the prefix cache)."""
        return self.held() if depth > 1 or self.loop is None else {}

    def caches(self, mbs: Iterable[int]) -> Iterator[tuple[int, PagedKVCache, int]]:
        """(request, its KV here as a cache, its last position) of each of ``mbs`` this stage holds: what a replaced
        neighbour gets back."""
        if self.loop is not None:
            yield from self.loop.requests.caches(mbs)
        elif self.follower is not None:
            yield from self.follower.caches(mbs)

    def kv_held(self) -> tuple[int, int]:
        """(bytes, requests) of KV this stage holds beyond its replicas: stage 0's requests' blocks, the prompt KV
        waiting for its blocks."""
        held, count = 0, 0
        if self.loop is not None:
            book = self.loop.scheduler.book
            held += (book.num_blocks - book.free) * self.executor.pool.geometry.bytes_per_block
            count += len(self.loop.requests.served)
        if self.arrivals is not None:
            held += self.arrivals.nbytes
            count += len(self.arrivals.requests())
        return held, count

    # -- epochs -----------------------------------------------------------------------------------------
    def restored(self, primary: Iterable[Restored]) -> None:
        """A replacement's own KV, restored: placed into the blocks each request's next pass names (stage 0: into
        the tables it takes over, once the repair's resume point names them)."""
        if self.follower is not None:
            self.follower.restored(primary)
        else:
            self.restores = {part.region.microbatch: part for part in primary}

    def keep(self, mbs: set[int]) -> None:
        """A repair: a later stage forgets every request but ``mbs``."""
        if self.follower is not None:
            self.follower.keep(mbs)

    def recovered(
        self,
        points: Mapping[int, int],
        pos: Position,
        endpoint: DataEndpoint,
        deadline_s: float,
        replicas: ReplicaSender | None,
    ) -> None:
        """The repair of a new epoch is over: stage 0 resumes the requests of ``points`` (several stages) or drops
        every one (one stage: they re-run from their streams), and sends this epoch's passes, from none, to
        ``pos``'s next stage (each back within ``deadline_s``), after the replicas of what it wrote."""
        if self.loop is None:
            return
        if pos.depth > 1 and self.adopting:
            self.loop.adopt(points, self.adopting, self.restores)
        elif pos.depth > 1:
            self.loop.resume(points)
        else:
            self.loop.drop_all()
        self.restores, self.adopting = {}, {}
        if pos.next_peer is not None:
            self.loop.downstream = Downstream(endpoint, pos.next_peer, pos.depth, deadline_s, replicas)

    def unassigned(self) -> None:
        """The worker lost its stage: stage 0 forgets every request, the last stage its records."""
        if self.loop is not None:
            self.loop.drop_all()
        self.emitter.clear()

    def run(
        self,
        topology: Topology,
        pos: Position,
        client: redis.Redis,
        ready: ReadyPrompts | None,
        replicas: ReplicaSender | None,
        on_ended: Callable[[Iterable[int]], None],
        stop: Callable[[], bool],
    ) -> None:
        """Serve ``topology``'s epoch, its repair over, until ``stop()``: stage 0's loop, which first publishes its
        book's blocks, or a later stage following its passes once it knows its pool holds them (:class:`PoolTooSmall`
        otherwise). ``replicas``: to the successor; ``on_ended(requests)``: for the requests that end (the worker
        forgets their replicas)."""
        if self.follower is not None:
            book = book_blocks(client, topology.token_stages[0], stop, warn_after_s=self.follower.kv_deadline_s)
            if book is None:
                return  # a newer epoch
            check_pool(self.executor.pool, book, pos.index)
            self.follower.connect(pos.next_peer, pos.first_peer, replicas)
            self.follower.on_ended = on_ended
            self.follower.run(stop)
            return
        assert self.loop is not None
        first = topology.token_stages[0]
        publish_book(client, first.worker_id, first.layers, self.loop.scheduler.book.num_blocks)
        if pos.colocated:
            ensure_group(client, keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP)
        if ready is not None:
            ready.serving(topology.epoch)
        self.loop.serve(topology.epoch)
        self.loop.requests.on_ended = on_ended
        self.loop.run(stop)

"""A token worker: one stage of the token pipeline (the paper's T-worker).

Per epoch, :meth:`TokenWorker.serve` connects to its peers, starts the receivers (prompt KV from the
prompt pipeline; the replica of its predecessor's cache), takes part in recovery when the epoch
follows a failure, and then runs stage 0's :class:`Driver` or the follower loop of later stages.
Microbatch caches and replicas survive an epoch change: that is what recovery resumes from.

An epoch served again after an error (:data:`SERVE_RETRYABLE`: Redis refusing a write, back-pressure,
a peer's message failing its check) is continued, never started over: its recovery ran already (running
it again would forget every microbatch admitted since). Stage 0 runs the same :class:`Driver` again, whose
microbatches of the pass the error broke run again from where their token streams end; a later stage
handles the message the error broke again, then follows on with the caches it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import redis

from dejavu_common import keys, tracing
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.fatal import guarded
from dejavu_common.messages import MicrobatchSpec, PromptTask, RecoveryOrder, StageAssignment, Topology, WorkerRole
from dejavu_common.sched import BlockBook, Budget, Scheduler
from dejavu_common.settings import Mode, Replication, Settings
from dejavu_common.tracing import RowSpans
from dejavu_engine.stage import Stage
from dejavu_engine.threads import configure_torch_threads
from dejavu_token_worker import recovery
from dejavu_token_worker.arrivals import PromptArrivals
from dejavu_token_worker.downstream import Downstream
from dejavu_token_worker.driver import PASS_DEADLINES, Driver, ensure_group
from dejavu_token_worker.emitter import Emitter
from dejavu_token_worker.executor import SliceExecutor
from dejavu_token_worker.follow import SliceFollower
from dejavu_token_worker.loop import RequestLoop
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.replication import ReplicaSender, ReplicaStore
from dejavu_token_worker.runner import STEP_FAILURES, FinishedMicrobatch, Position, StageRunner
from dejavu_worker.dataplane import Kind, Returned, StageMessage, TokenReturn
from dejavu_worker.endpoint import Channel, largest_message
from dejavu_worker.lifecycle import SERVE_RETRYABLE, WorkerProcess
from dejavu_worker.metrics import PoolUsage, RepairRole, StageSnapshot
from dejavu_worker.microbatch import KVStatus, MicrobatchState, fetch_spec
from dejavu_worker.swap import SwapManager
from dejavulib.errors import DejaVuLibError, IntegrityError, ProtocolError
from dejavulib.kvcache import KVCache
from dejavulib.paged import BlockGeometry, PagedKVCache
from dejavulib.streaming import region_of

log = logging.getLogger("dejavu.token_worker")


class TokenWorker(WorkerProcess):
    role = WorkerRole.TOKEN

    def __init__(self, settings: Settings, worker_id: str, spare: bool = False) -> None:
        super().__init__(settings, worker_id, spare, configure_torch_threads(settings.engine.torch_threads))
        self.runner: StageRunner | None = None
        self.replica: ReplicaStore | None = None
        self.ready: ReadyPrompts | None = None
        self.held_tasks: list[PromptTask] = []  # colocated tasks of an epoch this worker does not serve yet
        self.recovered_epoch: int | None = None  # the epoch whose recovery (or fresh start) this stage did
        self.driver: Driver | None = None  # stage 0's driver of ``recovered_epoch``
        self.slices: SliceExecutor | None = None  # a request-scheduled pipeline's stage (instead of the runner's)
        self.emitter: Emitter | None = None  # its sampling end (used on its last stage)
        self.loop: RequestLoop | None = None  # its stage 0's loop (instead of a driver)
        self.follower: SliceFollower | None = None  # its later stages' (instead of the runner's follow)
        self.arrivals: PromptArrivals | None = None  # disaggregated: the prompt KV streamed to its stages
        self._broken: tuple[memoryview | bytes, float] | None = None  # a later stage's message an error broke
        self._replicates_requests = False  # a request-scheduled stage sending replicas to its successor

    # -- lifecycle hooks ----------------------------------------------------------------------
    def load(self, assignment: StageAssignment, topology: Topology) -> None:
        assert self.redis is not None and self.endpoint is not None
        m = self.settings.model
        engine = self.settings.engine
        stage = Stage(
            m.folder,
            assignment.layers,
            m.device,
            m.dtype,
            engine.packs_gemms(decodes=True),
            engine.native_attention,
            engine.ragged_prefill,
        )
        self.endpoint.bound_messages(largest_message(topology, self.settings, stage.spec))
        swap = None
        if self.settings.swap.enabled:
            # Device buffers sized for the largest microbatch this pipeline admits.
            layout = stage.kv_layout(topology.token_microbatch, self.settings.engine.max_context)
            swap = SwapManager(
                layout, len(topology.token_stages), m.device, deadline_s=self.settings.transport.deadline_s
            )
            log.info("swapping on: %d device buffer(s), %.1f MB", swap.slots, swap.device_bytes / 1e6)
        pool = None
        self.loop, self.follower, self.slices, self.emitter, self.arrivals = None, None, None, None, None
        requests = self._schedules_requests(topology, stage, swap)
        if requests:
            self.slices = self._slice_executor(stage, topology)
            self.emitter = Emitter(self.redis, self.signer, stage.spec.eos_token_ids)
            if topology.mode == Mode.DISAGGREGATED.value:
                index = assignment.stage
                self.arrivals = PromptArrivals(
                    assignment.layers, self._spec_of, lambda a: trace_arrival(a.spec, index, a.first_ns)
                )
        elif swap is None and engine.kv_block_size > 0 and not stage.paged_attention:
            log.info(
                "paged KV pool off: no paged attention kernel for this stage (%s, %s): contiguous caches",
                stage.device,
                type(stage.family).__name__,
            )
        elif swap is None and engine.kv_block_size > 0:
            blocks = self._pool_blocks(BlockGeometry.of(stage.kv_layout(1, 1), engine.kv_block_size))
            pool = stage.block_pool(engine.kv_block_size, blocks)
            log.info(
                "paged KV pool: blocks of %d positions (%.2f MB), up to %d blocks (%.1f GB)",
                engine.kv_block_size,
                pool.geometry.bytes_per_block / 1e6,
                pool.max_blocks,
                pool.max_blocks * pool.geometry.bytes_per_block / 1e9,
            )
        self.runner = StageRunner(
            stage,
            self.redis,
            self.endpoint,
            self.settings.transport.deadline_s,
            swap,
            abandon=self.epoch_changed,
            pool=pool,
            mixed_passes=engine.mixed_passes,
            metrics=self.metrics,
        )
        self.runner.signer = self.signer
        if self.replica is not None:
            self.replica.close()  # of the previous assignment
        self.replica = None
        self.ready = None
        self.recovered_epoch, self.driver, self._broken = None, None, None  # a new stage holds nothing to continue
        if assignment.stage == 0 and topology.mode == Mode.DISAGGREGATED.value:
            # Created before this worker reports SERVING, so no announcement is missed.
            self.ready = ReadyPrompts(self.redis, signer=self.signer)
        if requests and assignment.stage == 0:
            assert self.slices is not None and self.emitter is not None
            self.loop = self._request_loop(self.slices, self.emitter, len(topology.token_stages))
        elif requests:
            assert self.slices is not None
            last = assignment.stage == len(topology.token_stages) - 1
            self.follower = SliceFollower(self.slices, self.endpoint, self.emitter if last else None, self.arrivals,
                                          self.settings.transport.deadline_s, self.metrics)  # fmt: skip
        if self.heartbeat is not None:
            self.heartbeat.kv_held = self.kv_held
        log.info(
            "loaded layers %s (%.1f MB, packed GEMMs %s, native attention %s, mixed passes %s)",
            assignment.layers,
            stage.param_bytes / 1e6,
            stage.packed_gemms,
            stage.native_attention,
            self.runner.mixes,
        )

    def _schedules_requests(self, topology: Topology, stage: Stage, swap: SwapManager | None) -> bool:
        """Whether this stage belongs to a request-scheduled pipeline (stage 0's :class:`RequestLoop`, the others'
        :class:`SliceFollower`): token stages, colocated or fed by a prompt pipeline, over paged pools,
        ``engine.request_scheduling`` on, no swapping. Settings alone decide, as the controller decides
        (``pipeline_backend.schedules_requests``), so every stage of a pipeline agrees: a stage without the native
        paged kernels attends through torch (``Stage.native_slices``)."""
        engine = self.settings.engine
        if engine.request_scheduling and swap is None and engine.kv_block_size > 0 and not stage.native_slices:
            log.warning("request scheduling without the native paged kernels here: passes attend through torch")
        return engine.request_scheduling and swap is None and engine.kv_block_size > 0

    def _slice_executor(self, stage: Stage, topology: Topology) -> SliceExecutor:
        """The executor of a request-scheduled stage over a new paged pool. Stage 0's book hands out the block ids
        of every stage's pool, so each stage sizes its pool by the stage of the pipeline with the most layers (the
        same memory gives each the same number of blocks); a later stage allows a quarter more, as its slabs are
        made only as ids are used and the memory each stage finds available at load differs a little."""
        engine = self.settings.engine
        geometry = BlockGeometry.of(stage.kv_layout(1, 1), engine.kv_block_size)
        widest = max(a.layers[1] - a.layers[0] for a in topology.token_stages)
        blocks = self._pool_blocks(replace(geometry, layers=widest))
        if stage.layers[0] > 0:
            blocks += blocks // 4
        return SliceExecutor(stage, stage.block_pool(engine.kv_block_size, blocks))

    def _spec_of(self, mb_id: int) -> MicrobatchSpec:
        """A request's spec (written before its prompt was queued)."""
        assert self.redis is not None
        return fetch_spec(self.redis, mb_id, self.settings.transport.deadline_s, self.epoch_changed)

    def _request_loop(self, executor: SliceExecutor, emitter: Emitter, depth: int) -> RequestLoop:
        """Stage 0's loop and its policy, whose book hands out the blocks of every stage's pool."""
        assert self.redis is not None
        engine, m = self.settings.engine, self.settings.model
        pool = executor.pool
        # Equal token ids give other KV under another model, dtype or block size: none of them may hit.
        namespace = f"{m.folder}|{m.dtype}|{engine.kv_block_size}".encode()
        book = BlockBook(pool.max_blocks, engine.kv_block_size, namespace, caching=engine.prefix_caching)
        budget = Budget(tokens=engine.token_budget, max_running=self.settings.controller.max_running, depth=depth)
        log.info(
            "request scheduling: a paged pool of up to %d blocks of %d positions (%.1f GB), %d positions a pass, "
            "prefix caching %s",
            pool.max_blocks,
            engine.kv_block_size,
            pool.max_blocks * pool.geometry.bytes_per_block / 1e9,
            engine.token_budget,
            "on" if engine.prefix_caching else "off",
        )
        stage = executor.stage
        return RequestLoop(
            Scheduler(book, budget, stage.model_kv_window),  # blocks out of every layer's window go back
            executor,
            self.redis,
            self.worker_id,
            self.metrics,
            emitter,
            self.held_tasks,
            engine.max_recomputes,
            ready=self.ready,
            arrivals=self.arrivals,
            kv_deadline_s=self.settings.transport.deadline_s,
            depth=depth,
        )

    def _pool_blocks(self, geometry: BlockGeometry) -> int:
        """Blocks of the paged pool: ``engine.kv_pool_bytes``, or 60% of the memory available now."""
        budget = self.settings.engine.kv_pool_bytes
        if budget is None:
            budget = int(0.6 * available_memory_bytes())
        return max(1, budget // geometry.bytes_per_block)

    def _host_bytes(self) -> int:
        """Bound on the preempted host copies: ``engine.kv_host_bytes``, or 10% of the memory available now."""
        budget = self.settings.engine.kv_host_bytes
        return budget if budget is not None else int(0.1 * available_memory_bytes())

    def _replica_bytes(self) -> int:
        """Bound on the replica pool: ``recovery.replica_memory_bytes``, or 30% of the memory available now."""
        budget = self.settings.recovery.replica_memory_bytes
        return budget if budget is not None else int(0.3 * available_memory_bytes())

    def serve(self, topology: Topology) -> None:
        assert self.endpoint is not None and self.runner is not None and self.redis is not None
        stages = topology.token_stages
        me = topology.stage_of(self.worker_id)
        assert me is not None
        depth = len(stages)
        pos = Position(
            index=me.stage,
            depth=depth,
            next_peer=stages[me.stage + 1].worker_id if me.stage + 1 < depth else None,
            first_peer=stages[0].worker_id,
            colocated=topology.mode == Mode.COLOCATED.value,
        )
        self.endpoint.set_epoch(topology.epoch)
        if self.slices is not None:
            self._serve_requests(topology, pos, self.slices)
            return
        if self.ready is not None:
            self.ready.serving(topology.epoch)
        self.endpoint.connect_all(self.redis, [a.worker_id for a in stages if a.worker_id != self.worker_id])
        replicating = self.settings.recovery.replication is not Replication.OFF and depth > 1
        successor = stages[(me.stage + 1) % depth].worker_id if replicating else None
        self.runner.replicas = ReplicaSender(self.endpoint, successor) if successor else None
        if replicating and self.replica is None:
            self._open_replicas(topology, me.stage, by_position=False)
        self.runner.held_replicas = self.replica
        # Past it, a stage short of blocks discards instead of copying to host memory; stage 0 recomputes.
        self.runner.host_budget = self._host_bytes() if self.runner.pool is not None else None
        stop = threading.Event()
        # Prompt KV waits in the endpoint's queue until this epoch's recovery is over: a re-run prompt's
        # first layers can arrive before the resume point is read, and releasing the re-run microbatch's
        # stale cache then would throw those fresh cells away with it.
        recovered = threading.Event()
        threads = []
        if not pos.colocated:
            receive = guarded("prompt KV receiver", self._receive_prompt_kv, retry_on=(redis.RedisError,))
            threads.append(threading.Thread(target=receive, args=(stop, recovered, pos.index), daemon=True))
        if self.replica is not None:
            receive = guarded("replica receiver", self.replica.run, retry_on=(redis.RedisError,))
            threads.append(threading.Thread(target=receive, args=(stop,), daemon=True))
        for t in threads:
            t.start()
        try:
            if self.recovered_epoch == topology.epoch:
                log.warning("serving epoch %d again: continuing what this stage holds", topology.epoch)
            else:
                resume = self._recover(topology, pos)
                if resume is None:
                    return
                self.recovered_epoch, self._broken = topology.epoch, None
                if self.driver is not None:
                    self.driver.end_traces()
                self.driver = self._driver(topology, pos) if pos.is_first else None
                if self.driver is not None:
                    self.driver.resume(resume)  # what an error interrupts here, the driver's run settles
            recovered.set()
            if pos.is_first:
                if pos.colocated:
                    ensure_group(self.redis, keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP)
                if self.driver is None:  # stage 0 at this epoch without its driver: none held anything
                    self.driver = self._driver(topology, pos)
                self.driver.run(self.epoch_changed)
            else:
                self._follow(pos)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=2)

    def _open_replicas(self, topology: Topology, index: int, by_position: bool) -> None:
        """The store of the replica this stage keeps of its predecessor's KV (``by_position``: of requests)."""
        assert self.redis is not None and self.endpoint is not None and self.runner is not None
        stages = topology.token_stages
        pred = stages[(index - 1) % len(stages)]
        spec = self.runner.stage.spec
        self.replica = ReplicaStore(
            self.redis,
            self.endpoint,
            pred.stage,
            pred.layers,
            (spec.num_kv_heads, spec.head_dim, self.runner.stage.dtype),
            self.settings.recovery.replication,
            self.settings.recovery.replica_dir,
            self.settings.transport.deadline_s,
            self.epoch_changed,
            self.worker_id,
            block_size=self.settings.engine.kv_block_size or 16,
            memory_bytes=self._replica_bytes(),
            by_position=by_position,
        )
        self.replica.signer = self.signer
        if self.replica.pool is not None:
            log.info(
                "replicas of stage %d: a host pool of up to %d blocks of %d positions (%.1f GB)",
                pred.stage,
                self.replica.pool.max_blocks,
                self.replica.pool.geometry.block_size,
                self.replica.pool.max_blocks * self.replica.pool.geometry.bytes_per_block / 1e9,
            )

    def _serve_requests(self, topology: Topology, pos: Position, executor: SliceExecutor) -> None:
        """Serve ``topology``'s epoch as a stage of a request-scheduled pipeline: stage 0's loop, or a later stage
        following its passes. Each stage replicates what every pass wrote on it to its successor (with several
        stages and replication on), whose replica of each request advances a watermark in positions. A recovery
        resumes each request from the positions every stage holds (a replaced stage restored from its successor's
        replica), and re-queues the others, which go on from their token streams; a one-stage pipeline, which has
        nobody to restore it, re-queues every request (mostly found in its prefix cache). Serving the same epoch
        again after an error continues."""
        assert self.redis is not None and self.endpoint is not None
        stages = topology.token_stages
        replicating = self.settings.recovery.replication is not Replication.OFF and pos.depth > 1
        if replicating and self.replica is None:
            self._open_replicas(topology, pos.index, by_position=True)
        replicas = ReplicaSender(self.endpoint, stages[(pos.index + 1) % pos.depth].worker_id) if replicating else None
        self._replicates_requests = replicating
        if pos.depth > 1:
            self.endpoint.connect_all(self.redis, [a.worker_id for a in stages if a.worker_id != self.worker_id])
        stop = threading.Event()
        recovered = threading.Event()  # prompt KV is read once the repair decided what resumes (see serve)
        threads = []
        if self.replica is not None:
            receive = guarded("replica receiver", self.replica.run, retry_on=(redis.RedisError,))
            threads.append(threading.Thread(target=receive, args=(stop,), daemon=True))
        if self.arrivals is not None:
            receive = guarded("prompt KV receiver", self._receive_prompt_regions, retry_on=(redis.RedisError,))
            threads.append(threading.Thread(target=receive, args=(stop, recovered, pos.index), daemon=True))
        for thread in threads:
            thread.start()
        try:
            if self.recovered_epoch != topology.epoch:
                points = self._recover(topology, pos)
                if points is None:
                    return
                if self.loop is not None and pos.depth > 1:
                    self.loop.resume(points)
                elif self.loop is not None:
                    self.loop.drop_all()
                if self.loop is not None and pos.next_peer is not None:  # the passes of this epoch, from none
                    deadline = PASS_DEADLINES * self.settings.transport.deadline_s
                    self.loop.downstream = Downstream(self.endpoint, pos.next_peer, pos.depth, deadline, replicas)
                self.recovered_epoch = topology.epoch
            else:  # the passes in flight go on (their returns come back at this epoch)
                log.warning("serving epoch %d again: continuing what this stage holds", topology.epoch)
            recovered.set()
            if self.follower is not None:
                self.follower.connect(pos.next_peer, pos.first_peer, replicas)
                self.follower.on_ended = self._forget_replicas
                self.follower.run(self.epoch_changed)
                return
            assert self.loop is not None
            if pos.colocated:
                ensure_group(self.redis, keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP)
            if self.ready is not None:
                self.ready.serving(topology.epoch)
            self.loop.serve(topology.epoch)
            self.loop.on_ended = self._forget_replicas
            self.loop.run(self.epoch_changed)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=2)

    def _receive_prompt_regions(self, stop: threading.Event, recovered: threading.Event, index: int) -> None:
        """A request-scheduled token stage's prompt KV receiver: each region the prompt pipeline streams here is
        kept until the request's first pass names its blocks (:class:`PromptArrivals`)."""
        assert self.endpoint is not None and self.arrivals is not None
        while not recovered.wait(0.1):
            if stop.is_set():
                return
        while not stop.is_set():
            message = self.endpoint.recv_message(Channel.KV_PROMPT, timeout_s=0.1)
            if message is None:
                continue
            try:
                if message.header.user != index:
                    raise ProtocolError(f"prompt KV for token stage {message.header.user} arrived at stage {index}")
                self.arrivals.add(region_of(message.header), message)
            except (ValueError, KeyError, IndexError, RuntimeError, DeadlineExceeded, DejaVuLibError) as exc:
                log.error("dropped a prompt KV message: %s", exc)

    def _forget_replicas(self, mbs: Iterable[int]) -> None:
        """Requests that ended: the replicas this stage keeps of them go (none of them comes back)."""
        if self.replica is not None:
            for mb in mbs:
                self.replica.drop(mb, finished=True)

    def _driver(self, topology: Topology, pos: Position) -> Driver:
        """Stage 0's driver of ``topology``'s epoch."""
        assert self.runner is not None and self.endpoint is not None and self.redis is not None
        return Driver(
            self.runner,
            self.endpoint,
            self.redis,
            self.worker_id,
            pos,
            self.ready,
            self.settings.transport.deadline_s,
            self.settings.controller.max_running,
            self.release,
            topology.epoch,
            self.held_tasks,
            max_recomputes=self.settings.engine.max_recomputes,
        )

    def unassigned(self, epoch: int) -> None:
        super().unassigned(epoch)
        if self.driver is not None:
            self.driver.end_traces()
        self.recovered_epoch, self.driver, self._broken = None, None, None
        if self.loop is not None:
            self.loop.drop_all()
        if self.emitter is not None:
            self.emitter.clear()
        if self.runner is not None:
            self._release_all_but(set())

    def close_data_plane(self) -> None:
        if self.replica is not None:
            self.replica.close()
        super().close_data_plane()

    def release(self, mb_id: int, finished: bool = True) -> None:
        """Free everything this stage holds of ``mb_id``: its cache and the replica kept of it. A
        ``finished`` microbatch is remembered, so prompt KV of it still in flight (its rows all
        finished at step 0, before their last layers' KV arrived) cannot bring it back."""
        assert self.runner is not None
        self.runner.release(mb_id, finished)
        if self.replica is not None:
            self.replica.drop(mb_id, finished)
        if self.heartbeat is not None:
            self.heartbeat.memory.freed()

    def _release_all_but(self, keep: set[int]) -> None:
        """Recovery: free what does not resume (re-run prompts come back, so nothing is remembered)."""
        assert self.runner is not None
        held = set(self.runner.states) | (self.replica.microbatches() if self.replica is not None else set())
        for mb in held - keep:
            self.release(mb, finished=False)
        if self.follower is not None:
            self.follower.keep(keep)

    def kv_held(self) -> tuple[int, int]:
        """(bytes, microbatches) of KV this stage holds: caches and replicas (what memory accounting checks)."""
        caches = [st.cache for st in list(self.runner.states.values())] if self.runner is not None else []
        if self.replica is not None:
            caches += self.replica.memory_caches()  # a replica on disk holds no memory
        held, count = sum(c.nbytes for c in caches), len(caches)
        if self.loop is not None:
            held += self.loop.held_bytes()
            count += len(self.loop.served)
        if self.arrivals is not None:
            held += self.arrivals.nbytes
            count += len(self.arrivals.requests())
        return held, count

    def snapshot(self) -> StageSnapshot:
        """What this stage holds now (see :class:`StageSnapshot`): read on the scraping thread from snapshots
        of the runner's, the replica store's and the driver's books (taken without their locks), the pools'
        and the swap manager's counts (each under its own lock, held for a count, as a receiver thread taking
        blocks holds it), and the watermarks of this stage's replicas (one Redis read)."""
        base = super().snapshot()
        runner, replica, driver = self.runner, self.replica, self.driver
        if runner is None:
            return base
        states = list(runner.states.values())
        pools: dict[str, PoolUsage] = {}
        if runner.pool is not None:
            pools["stage"] = PoolUsage(runner.pool.used_blocks, runner.pool.max_blocks)
        loop = self.loop
        if loop is not None:
            pools["stage"] = loop.pool_usage()
        if replica is not None and replica.pool is not None:
            pools["replica"] = PoolUsage(replica.pool.used_blocks, replica.pool.max_blocks)
        preempted = [st.cache.nbytes for st in states if st.status is KVStatus.PREEMPTED]
        replicating = (runner.replicas is not None or self._replicates_requests) and base.stage is not None
        held = self._held_steps(states)
        return replace(
            base,
            microbatches=len(states),
            occupancy=driver.occupancy() if driver is not None else loop.occupancy() if loop is not None else None,
            pools=pools,
            host_bytes=sum(preempted) if runner.pool is not None else None,
            replicas=len(replica.replicas) if replica is not None else None,
            replication_lag_steps=self._replication_lag(base.stage, held) if replicating else None,  # type: ignore[arg-type]
            swap=asdict(runner.swap.stats()) if runner.swap is not None else None,
            prefix_cache=loop.prefix_cache() if loop is not None else None,
        )

    def _held_steps(self, states: list[MicrobatchState]) -> dict[int, int]:
        """What this stage holds, as its successor's watermarks count it: per microbatch its last step, per request
        of a request-scheduled pipeline its last position (read without locks: a scrape's snapshot)."""
        if self.loop is not None:
            return dict(self.loop.progress())
        if self.follower is not None:
            return dict(self.follower.progress())
        return {st.mb_id: st.done_step for st in states if st.holds_kv}

    def _replication_lag(self, stage: int, held: dict[int, int]) -> int | None:
        """The largest gap between what this stage holds of a microbatch or request and the watermark its
        successor recorded for it (-1 when none); None when Redis cannot be read now."""
        assert self.redis is not None
        try:
            raw = self.redis.hgetall(keys.watermark(stage))
        except redis.RedisError as exc:
            log.warning("replication lag not read: %s", exc)
            return None
        marks = {}
        for mb, step in raw.items():  # any worker may write these: a field that does not parse is skipped
            with contextlib.suppress(ValueError):
                marks[int(mb)] = int(step)
        return max((last - marks.get(mb, -1) for mb, last in held.items()), default=0)

    # -- recovery -----------------------------------------------------------------------------
    def _recover(self, topology: Topology, pos: Position) -> dict[int, int] | None:
        """Take part in the repair of this epoch, if it follows failures; the microbatches stage 0
        resumes (empty for a fresh pipeline), or None if the epoch changed meanwhile."""
        assert self.redis is not None and self.runner is not None and self.endpoint is not None
        order = recovery.recovery_order(self.redis, topology.epoch)
        if order is None:
            # A fresh pipeline (first start, or a restarted controller that cleared its work): nothing
            # to resume, and microbatch ids start over, so no old cache may survive.
            self._release_all_but(set())
            if self.ready is not None:
                self.ready.reset()
            return {}
        # The controller gives up waiting for reports after 3 deadlines and then still publishes a
        # resume point (re-running every prompt), so a worker waits longer than that.
        deadline = self.settings.transport.deadline_s * 4
        started = time.monotonic()
        role = RepairRole.REPLACEMENT if pos.index in order.replaced else RepairRole.SURVIVOR
        try:
            if pos.index in order.replaced:
                if self.ready is not None:
                    # Taking stage 0 over (perhaps again, after serving it at an earlier epoch): what was
                    # announced before is the old holder's or resumes through this recovery; what re-runs is
                    # dispatched only once this stage reports its restore.
                    self.ready.start_over()
                try:
                    self._restore(order, pos)
                    self.metrics.restore_seconds.observe(time.monotonic() - started)
                except (DeadlineExceeded, IntegrityError):
                    # Said at once, so the controller re-runs every microbatch now rather than at its deadline.
                    self.redis.set(keys.restored(topology.epoch, pos.index), keys.RESTORE_FAILED, ex=3600)
                    raise
                if self.loop is not None and pos.depth > 1:
                    # Stage 0 of a request-scheduled pipeline holds its book (every request's blocks and progress),
                    # which no replica keeps: its own KV came back (and is dropped), and every request re-runs.
                    log.warning("took over stage 0 of a request-scheduled pipeline: every request re-runs")
                    self.redis.set(keys.restored(topology.epoch, pos.index), keys.RESTORE_FAILED, ex=3600)
                else:
                    self.redis.set(keys.restored(topology.epoch, pos.index), keys.RESTORED, ex=3600)
            else:
                self._send_restores(order, pos, topology)
                recovery.report_progress(self.redis, topology.epoch, pos.index, self.signer, self._progress(pos))
            point = recovery.wait_resume(self.redis, topology.epoch, deadline, self.epoch_changed)
        except (DeadlineExceeded, IntegrityError) as exc:
            self.metrics.observe_repair(role, time.monotonic() - started, ok=False)
            if self.epoch_changed():
                return None  # a newer epoch: its own recovery takes over
            log.error("recovery at epoch %d failed (%s): dropping every in-flight microbatch", topology.epoch, exc)
            self._release_all_but(set())
            return {}
        self.metrics.observe_repair(role, time.monotonic() - started, ok=True)
        # Only what resumes survives: re-run prompts start from clean caches, dropped microbatches are
        # gone, and anything else held here (a release lost with the failed worker) would leak.
        self._release_all_but(set(point.resume))
        if self.ready is not None:
            self.ready.forget(set(point.rerun))
            self.ready.ignored |= set(point.dropped)  # a late announcement of a failed microbatch is stale
        for state in list(self.runner.states.values()):
            state.tracker = None  # rebuilt from the token streams at the resumed steps
        return dict(point.resume) if pos.is_first else {}

    def _progress(self, pos: Position) -> dict[int, int]:
        """What this stage reports holding to a repair: per microbatch its last step, or per request of a
        request-scheduled pipeline of several stages its last position (a one-stage one reports nothing: its
        requests all re-run, from the prefix cache)."""
        assert self.runner is not None
        if self.loop is not None:
            return self.loop.progress() if pos.depth > 1 else {}
        if self.follower is not None:
            return self.follower.progress()
        return self.runner.progress()

    def _own_caches(self, mbs: Iterable[int]) -> Iterator[tuple[int, KVCache | PagedKVCache, int]]:
        """(microbatch or request, its KV on this stage, its last step or position) of each of ``mbs`` held here:
        what a replaced successor gets back as its replica."""
        assert self.runner is not None
        if self.loop is not None:
            yield from self.loop.caches(mbs)
        elif self.follower is not None:
            yield from self.follower.caches(mbs)
        else:
            wanted = set(mbs)
            for mb, st in list(self.runner.states.items()):
                if mb in wanted and st.holds_kv:
                    yield mb, st.cache, st.done_step

    def _send_restores(self, order: RecoveryOrder, pos: Position, topology: Topology) -> None:
        """As successor of a replaced stage, send the replica kept for it; as predecessor, own caches."""
        assert self.runner is not None and self.endpoint is not None
        depth = pos.depth
        for stage, new_worker in order.replaced.items():
            if depth > 1 and (stage + 1) % depth == pos.index and self.replica is not None:
                sent = recovery.send_caches(
                    self.endpoint, new_worker, self.replica.restorable(order.microbatches), "primary"
                )
                log.info("sent %s its caches of microbatches %s", new_worker, sent)
            if depth > 1 and (stage - 1) % depth == pos.index:
                sent = recovery.send_caches(self.endpoint, new_worker, self._own_caches(order.microbatches), "replica")
                log.info("sent %s the replica of microbatches %s", new_worker, sent)

    def _restore(self, order: RecoveryOrder, pos: Position) -> None:
        """As a replacement: receive this stage's caches (primary) and the predecessor's (replica)."""
        assert self.runner is not None and self.endpoint is not None
        roles = recovery.expected_roles(pos.index, pos.depth, set(order.replaced))
        if not roles or self.settings.recovery.replication is Replication.OFF:
            return
        primary, replica = recovery.receive_caches(
            self.endpoint, roles, self.settings.transport.deadline_s * 2, self.epoch_changed
        )
        log.info(
            "restored caches of microbatches %s and the replica of %s",
            {r.region.microbatch: r.step for r in primary},
            {r.region.microbatch: r.step for r in replica},
        )
        if self.follower is not None:
            self.follower.restored(primary)  # placed into the blocks the request's next pass names
        for r in primary if self.slices is None else ():
            state = self.runner.state(r.region.microbatch)
            state.place(r.region, r.message)
            state.mark_complete(r.step)
            state.prompt_replicated = True
        if self.replica is not None:
            for r in replica:
                try:
                    self.replica.store(r.region, r.step, r.message)
                except (OSError, ValueError, DejaVuLibError) as exc:  # e.g. the replica disk is full
                    mb = r.region.microbatch
                    log.error("could not keep the restored replica of microbatch %d (%s): not replicated", mb, exc)
                    self.replica.drop(mb)  # no watermark: a failure of the predecessor re-runs its prompt

    # -- stages > 0 ---------------------------------------------------------------------------
    def _follow(self, pos: Position) -> None:
        """Follow the passes (and releases) stage 0 sends, until the epoch changes. A message whose handling
        an error broke (:data:`SERVE_RETRYABLE`: Redis refused the last stage's tokens, a send found no room:
        the pass did not get through, since this stage hands it on last) is kept, and the error goes on to
        the lifecycle; when it serves this epoch again, the message is handled again first (a pass runs
        again from the top: it rewrites the same KV and samples the same tokens, from trackers rebuilt from
        the token streams). Past stage 0's pass deadline it is dropped instead: stage 0 has failed it."""
        assert self.endpoint is not None and self.runner is not None
        while not self.epoch_changed():
            broken, self._broken = self._broken, None
            if broken is None:
                payload = self.endpoint.recv(Channel.ACTIVATION, timeout_s=0.05)
                if payload is None:
                    continue
                since = time.monotonic()
            else:
                payload, since = broken
            try:
                msg = StageMessage.decode(payload)
            except ValueError as exc:
                log.error("dropped a malformed stage message: %s", exc)
                continue
            if broken is not None and not self._follow_again(msg, since):
                continue
            try:
                self._handle(pos, msg, payload)
            except SERVE_RETRYABLE:
                self._broken = (payload, since)
                raise

    def _follow_again(self, msg: StageMessage, since: float) -> bool:
        """Whether a message an error broke (received at ``since``) is handled again: not past stage 0's
        pass deadline. A pass that is has its members' trackers rebuilt from their token streams."""
        assert self.runner is not None
        if time.monotonic() - since > PASS_DEADLINES * self.settings.transport.deadline_s:
            log.warning("dropped the pass of cohort %d broken here: stage 0 has failed it by now", msg.mb_id)
            return False
        for mb, _step, _rows in msg.members:
            state = self.runner.states.get(mb)
            if state is not None:
                state.tracker = None
        log.info("handling again the %s message of cohort %d an error broke here", msg.kind.name, msg.mb_id)
        return True

    def _handle(self, pos: Position, msg: StageMessage, payload: memoryview | bytes) -> None:
        """One message from the previous stage: a release (freed here, then handed on) or a pass."""
        assert self.endpoint is not None and self.runner is not None
        if msg.kind is Kind.RELEASE:
            self.release(msg.mb_id)
            if pos.next_peer is not None:
                self.endpoint.send(pos.next_peer, Channel.ACTIVATION, payload)
            return
        try:
            self.runner.follow(pos, msg)
        except STEP_FAILURES as exc:
            # The pass's values broke the computation here: its members' clients get errors, stage 0
            # frees them along the pipeline, and this stage keeps serving the others.
            for mb, step, _rows in msg.members:
                self.runner.fail(mb, step, exc)
            failed = tuple(Returned(mb, step, (), True) for mb, step, _rows in msg.members)
            self.endpoint.send(pos.first_peer, Channel.TOKENS, TokenReturn(msg.mb_id, failed).encode())

    # -- prompt KV arrival (disaggregated) ----------------------------------------------------
    def _receive_prompt_kv(self, stop: threading.Event, recovered: threading.Event, index: int) -> None:
        assert self.endpoint is not None and self.runner is not None
        # When traced, when each microbatch's first prompt KV arrived (time.time_ns()), until it is complete.
        arriving: dict[int, int] | None = {} if tracing.enabled() else None
        while not recovered.wait(0.1):
            if stop.is_set():
                return
        while not stop.is_set():
            message = self.endpoint.recv_message(Channel.KV_PROMPT, timeout_s=0.1)
            if message is None:
                continue
            try:
                region = region_of(message.header)
                if message.header.user != index:
                    raise ProtocolError(f"prompt KV for token stage {message.header.user} arrived at stage {index}")
                try:
                    state = self.runner.state(region.microbatch)
                except FinishedMicrobatch:
                    continue  # late prompt KV of a microbatch that already finished
                if arriving is not None and not state.complete.is_set():
                    arriving.setdefault(state.mb_id, time.time_ns())
                state.place(region, message)
                state.add_prompt_cells(region.layers, region.rows)
                if arriving is not None and state.complete.is_set() and state.mb_id in arriving:
                    trace_prompt_kv(state, index, arriving.pop(state.mb_id))
            except (ValueError, KeyError, IndexError, RuntimeError, DeadlineExceeded, DejaVuLibError) as exc:
                log.error("dropped a prompt KV message: %s", exc)


def trace_prompt_kv(state: MicrobatchState, stage: int, first_ns: int) -> None:
    """The ``dejavu.kv_stream`` span of each traced row of ``state``: its prompt KV arriving at this token stage,
    from the first message to the last."""
    attributes = {tracing.STAGE: stage, "dejavu.kv_cells": state.expected_cells}
    spans = RowSpans.start("dejavu.kv_stream", state.spec.rows, attributes, start_ns=first_ns, mb_id=state.mb_id)
    if spans is not None:
        spans.end()


def trace_arrival(spec: MicrobatchSpec, stage: int, first_ns: int) -> None:
    """The ``dejavu.kv_stream`` span of a traced request of a request-scheduled pipeline: its prompt KV arriving at
    this token stage, from the first message to the last."""
    attributes = {tracing.STAGE: stage, "dejavu.kv_cells": spec.prompt_len}
    spans = RowSpans.start("dejavu.kv_stream", spec.rows, attributes, start_ns=first_ns, mb_id=spec.mb_id)
    if spans is not None:
        spans.end()


def available_memory_bytes() -> int:
    """Memory the host can still give (Linux ``MemAvailable``; elsewhere physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

"""A token worker: one stage of the token pipeline (the paper's T-worker), and the wiring of its parts.

At load it builds its stage: where settings say the pipeline schedules requests, a
:class:`~dejavu_token_worker.request_stage.RequestStage` (stage 0's :class:`RequestLoop` or a later stage's
:class:`SliceFollower`, over a paged pool); otherwise a cohort stage (a :class:`StageRunner`, driven by stage 0's
:class:`Driver` and followed by the later stages' :class:`CohortFollower`). Per epoch, :meth:`TokenWorker.serve`
connects to its peers, starts the receivers (prompt KV from the prompt pipeline:
:mod:`dejavu_token_worker.prompt_kv`; the replica of its predecessor's KV), takes part in recovery when the epoch
follows a failure, and then runs its stage. Caches and replicas survive an epoch change: that is what recovery
resumes from. What it reports holding is :mod:`dejavu_token_worker.snapshot`'s.

An epoch served again after an error (:data:`~dejavu_worker.lifecycle.SERVE_RETRYABLE`: Redis refusing a write,
back-pressure, a peer's message failing its check) is continued, never started over: its recovery ran already
(running it again would forget every request or microbatch admitted since). Stage 0 runs the same loop or driver
again, whose requests or microbatches of the pass the error broke run again from where their token streams end; a
later cohort stage handles the message the error broke again, then follows on with the caches it holds (a later
request-scheduled stage answers that pass ``broken`` instead, and stage 0 restarts its requests from their streams).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import redis

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.fatal import guarded
from dejavu_common.messages import MicrobatchSpec, PromptTask, RecoveryOrder, StageAssignment, Topology, WorkerRole
from dejavu_common.settings import Mode, Replication, Settings
from dejavu_engine.remote import resolve_model_folder
from dejavu_engine.stage import Stage
from dejavu_engine.threads import configure_torch_threads
from dejavu_token_worker import recovery
from dejavu_token_worker.driver import PASS_DEADLINES, Driver, ensure_group
from dejavu_token_worker.follow_cohorts import CohortFollower
from dejavu_token_worker.memory import host_bytes, pool_blocks, replica_bytes
from dejavu_token_worker.prompt_kv import cohort_placer, receive_prompt_kv
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.replication import ReplicaSender, ReplicaStore
from dejavu_token_worker.request_stage import RequestStage, schedules_requests
from dejavu_token_worker.runner import Position, StageRunner
from dejavu_token_worker.snapshot import stage_kv_held, stage_snapshot
from dejavu_worker.endpoint import largest_message
from dejavu_worker.lifecycle import WorkerProcess
from dejavu_worker.metrics import RepairRole, StageSnapshot
from dejavu_worker.microbatch import fetch_spec
from dejavu_worker.swap import SwapManager
from dejavulib.endpoint import Message
from dejavulib.errors import DejaVuLibError, IntegrityError
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
        self.requests: RequestStage | None = None  # a request-scheduled pipeline's stage (instead of the runner's)
        self.cohort: CohortFollower | None = None  # a later stage's follower of ``recovered_epoch`` (cohorts)
        self._replicates_requests = False  # a request-scheduled stage sending replicas to its successor

    # -- lifecycle hooks ----------------------------------------------------------------------
    def load(self, assignment: StageAssignment, topology: Topology) -> None:
        assert self.redis is not None and self.endpoint is not None
        m = self.settings.model
        engine = self.settings.engine
        stage = Stage(
            resolve_model_folder(self.settings, assignment.layers),
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
        self.ready = None
        if assignment.stage == 0 and topology.mode == Mode.DISAGGREGATED.value:
            # Created before this worker reports SERVING, so no announcement is missed.
            self.ready = ReadyPrompts(self.redis, signer=self.signer)
        pool, self.requests = None, None
        requests = schedules_requests(self.settings, stage)
        if requests:
            self.requests = RequestStage.build(self.settings, stage, assignment, topology, self.redis, self.endpoint,
                                               self.signer, self.metrics, self.worker_id, self.held_tasks, self.ready,
                                               self._spec_of)  # fmt: skip
        elif swap is None and engine.kv_block_size > 0 and not stage.paged_attention:
            log.info(
                "paged KV pool off: no paged attention kernel for this stage (%s, %s): contiguous caches",
                stage.device,
                type(stage.family).__name__,
            )
        elif swap is None and engine.kv_block_size > 0:
            blocks = pool_blocks(self.settings, BlockGeometry.of(stage.kv_layout(1, 1), engine.kv_block_size))
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
        self.recovered_epoch, self.driver, self.cohort = None, None, None  # a new stage holds nothing to continue
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

    def _spec_of(self, mb_id: int) -> MicrobatchSpec:
        """A request's spec (written before its prompt was queued)."""
        assert self.redis is not None
        return fetch_spec(self.redis, mb_id, self.settings.transport.deadline_s, self.epoch_changed)

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
        if self.requests is not None:
            self._serve_requests(topology, pos, self.requests)
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
        self.runner.host_budget = host_bytes(self.settings) if self.runner.pool is not None else None
        place = None if pos.colocated else cohort_placer(self.runner, pos.index)
        with self._receivers(place, pos.index) as recovered:  # prompt KV is read once the repair is over
            if self.recovered_epoch == topology.epoch:
                log.warning("serving epoch %d again: continuing what this stage holds", topology.epoch)
            else:
                resume = self._recover(topology, pos)
                if resume is None:
                    return
                self.recovered_epoch = topology.epoch
                deadline_s = self.settings.transport.deadline_s
                cohort = CohortFollower(self.runner, self.endpoint, deadline_s, self.release)
                self.cohort = None if pos.is_first else cohort
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
                assert self.cohort is not None  # made with the epoch's recovery
                self.cohort.run(pos, self.epoch_changed)

    @contextlib.contextmanager
    def _receivers(self, place: Callable[[Message], None] | None, index: int) -> Iterator[threading.Event]:
        """This epoch's receiver threads, run while the block runs: the prompt KV's (handing each message to
        ``place``, on token stage ``index``: :func:`receive_prompt_kv`) and the replicas' (where this stage keeps its
        predecessor's). Yields the event that lets the prompt KV be read, set once the repair decided what resumes
        (:mod:`dejavu_token_worker.prompt_kv`)."""
        stop, recovered = threading.Event(), threading.Event()
        threads = []
        if place is not None:
            receive = guarded("prompt KV receiver", receive_prompt_kv, retry_on=(redis.RedisError,))
            args = (self.endpoint, stop, recovered, index, place)
            threads.append(threading.Thread(target=receive, args=args, daemon=True))
        if self.replica is not None:
            receive = guarded("replica receiver", self.replica.run, retry_on=(redis.RedisError,))
            threads.append(threading.Thread(target=receive, args=(stop,), daemon=True))
        for thread in threads:
            thread.start()
        try:
            yield recovered
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=2)

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
            memory_bytes=replica_bytes(self.settings),
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

    def _serve_requests(self, topology: Topology, pos: Position, requests: RequestStage) -> None:
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
        arrivals = requests.arrivals
        place = None if arrivals is None else lambda message: arrivals.add(region_of(message.header), message)
        with self._receivers(place, pos.index) as recovered:  # prompt KV is read once the repair is over
            if self.recovered_epoch != topology.epoch:
                points = self._recover(topology, pos)
                if points is None:
                    return
                deadline = PASS_DEADLINES * self.settings.transport.deadline_s
                requests.recovered(points, pos, self.endpoint, deadline, replicas)
                self.recovered_epoch = topology.epoch
            else:  # the passes in flight go on (their returns come back at this epoch)
                log.warning("serving epoch %d again: continuing what this stage holds", topology.epoch)
            recovered.set()
            requests.run(topology, pos, self.redis, self.ready, replicas, self._forget_replicas, self.epoch_changed)

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
        self.recovered_epoch, self.driver, self.cohort = None, None, None
        if self.requests is not None:
            self.requests.unassigned()
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
        if self.requests is not None:
            self.requests.keep(keep)

    def kv_held(self) -> tuple[int, int]:
        """(bytes, microbatches) of KV this stage holds: caches and replicas (what memory accounting checks)."""
        return stage_kv_held(self.runner, self.replica, self.requests)

    def snapshot(self) -> StageSnapshot:
        """What this stage holds now (:func:`~dejavu_token_worker.snapshot.stage_snapshot`), read on the scraping
        thread."""
        return stage_snapshot(super().snapshot(), self.runner, self.replica, self.driver, self.requests, self.redis,
                              self._replicates_requests)  # fmt: skip

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
                # Taking stage 0 of a request-scheduled pipeline over, its book comes back from the tables stage 1
                # reported (the resume point carries them) and its own KV from stage 1's replica.
                self.redis.set(keys.restored(topology.epoch, pos.index), keys.RESTORED, ex=3600)
            else:
                self._send_restores(order, pos, topology)
                tables = self.requests.tables() if self.requests is not None else None
                done = self._progress(pos)
                recovery.report_progress(self.redis, topology.epoch, pos.index, self.signer, done, tables)
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
        if self.requests is not None:
            self.requests.adopting = dict(point.tables) if pos.is_first else {}
        return dict(point.resume) if pos.is_first else {}

    def _progress(self, pos: Position) -> dict[int, int]:
        """What this stage reports holding to a repair: per microbatch its last step, or per request of a
        request-scheduled pipeline of several stages its last position (a one-stage one reports nothing: its
        requests all re-run, from the prefix cache)."""
        assert self.runner is not None
        if self.requests is not None:
            return self.requests.progress(pos.depth)
        return self.runner.progress()

    def _own_caches(self, mbs: Iterable[int]) -> Iterator[tuple[int, KVCache | PagedKVCache, int]]:
        """(microbatch or request, its KV on this stage, its last step or position) of each of ``mbs`` held here:
        what a replaced successor gets back as its replica."""
        assert self.runner is not None
        if self.requests is not None:
            yield from self.requests.caches(mbs)
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
        if self.requests is not None:
            self.requests.restored(primary)  # placed into the blocks the request's next pass names
        for r in primary if self.requests is None else ():
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

"""The real :class:`Backend`: schedules microbatches onto worker pipelines through Redis.

Three asyncio tasks share one event loop (the gateway's):

- *control*: polls the registry every heartbeat interval, (re)publishes the topology, tracks readiness;
- *dispatch*: forms token microbatches from waiting requests, writes their specs, and queues prompt
  microbatches on the prompt stream (or, in colocated mode, on the colocated stream);
- *relay*: reads the token streams of active microbatches and hands each request its tokens,
  exactly once and in order (entries are indexed by step; a re-executed step is a duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError, ResponseError

from dejavu_common import keys
from dejavu_common.fatal import die
from dejavu_common.messages import TokenStep, Topology
from dejavu_common.redis_client import text
from dejavu_common.settings import Mode, Settings
from dejavu_common.signing import UnverifiedEntry, verify_entry
from dejavu_controller.aio import await_chain, cancellation_point
from dejavu_controller.api.metrics import KVStream, RuntimeMetrics
from dejavu_controller.backend import (
    BackendStats,
    FinishReason,
    GenerationRequest,
    NotReadyError,
    TokenEvent,
)
from dejavu_controller.leadership import Leadership, LeadershipLost
from dejavu_controller.model_info import context_limit
from dejavu_controller.overview import Overview, RepairView, request_views, requests_in_flight
from dejavu_controller.progress import ProgressWatchdog, stall_limit_s
from dejavu_controller.registry import Registry, WorkerView
from dejavu_controller.repair import Repair
from dejavu_controller.request import Request, RequestStatus
from dejavu_controller.request_trace import RequestTrace, end_repair, start_repair
from dejavu_controller.scheduler import Microbatch, Scheduler, SchedulerLimits
from dejavu_controller.writers import EntryWriters

log = logging.getLogger("dejavu.controller")

SHUTDOWN_DEADLINE_S = 10.0  # how long __aexit__ waits for its cancelled tasks
DISPATCH_RETRY_S = 0.25  # pause after a failed dispatch write before forming again (Redis is failing)


@dataclass(frozen=True)
class _RepairPlan:
    """What one repair covers (see ``PipelineBackend._plan_repair``)."""

    replaced: dict[int, str]
    resumable: list[int]
    not_started: list[int]
    dropped: list[int]
    detected_at: float


class PipelineBackend:
    """Backend over Redis-coordinated prompt and token pipelines. Use as an async context manager."""

    def __init__(
        self, settings: Settings, redis: aioredis.Redis, n_layers: int, metrics: RuntimeMetrics | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.redis = redis
        c = settings.controller
        colocated = c.mode is Mode.COLOCATED
        self.registry = Registry(redis, c, n_layers)
        self.scheduler = Scheduler(
            SchedulerLimits(
                token_microbatch=1 if settings.schedules_requests else c.token_microbatch,
                prompt_microbatch=c.token_microbatch if colocated else c.prompt_microbatch,
                max_outstanding_rows=_outstanding_rows(settings),
                queue_bound=c.queue_bound,
                batch_wait_s=c.batch_wait_ms / 1000.0,
                max_len=context_limit(settings.model.folder, settings.engine.max_context),
                split_prompts=not colocated,
                prompt_task_tokens=c.prompt_task_tokens,
            )
        )
        self._queue = keys.COLOCATED_QUEUE if colocated else keys.PROMPT_QUEUE
        self._ready = False
        self._workers: dict[str, WorkerView] = {}
        # Whose token-stream entries are relayed, under which keys: stage holders, their keys from the registry.
        self.writers = EntryWriters()
        self._wake = asyncio.Event()
        self._stream_ids: dict[int, bytes] = {}
        self._tasks: list[asyncio.Task] = []
        self.repair = Repair(settings, redis)
        self.repair.writers = self.writers  # progress reports are signed like token-stream entries
        identity = c.identity or f"{socket.gethostname()}:{c.port}"
        self.leadership = Leadership(redis, identity, c.leader_lease_s)
        self._repair_task: asyncio.Task | None = None
        self._repairing: set[int] = set()  # token stages the current repair restores
        self._repair_plan: tuple[int, _RepairPlan] | None = None  # the newest repair's epoch and plan
        self._kv_seen: dict[str, int] = {}
        self._drain_waiting: set[str] = set()  # draining stage holders no replacement is available for
        self._last_poll: float | None = None  # when the control loop last read the registry
        self._lease_grace_until = 0.0  # lease expiries are not failures before this (after a stall)
        self._dispatching = asyncio.Lock()  # held by a dispatch, and by a change of topology
        self._dropped_keys: list[str] = []  # Redis keys of dropped microbatches, deleted by the control loop
        self._closing = False  # __aexit__ began: no task starts any more
        self.progress = ProgressWatchdog(stall_limit_s(c.progress_stall_s, settings.transport.deadline_s))

    async def __aenter__(self) -> PipelineBackend:
        self._start("lead", self._lead())
        return self

    def _start(self, name: str, coro) -> None:
        if self._closing:  # a task whose cancellation was swallowed must not start loops after shutdown
            coro.close()
            raise asyncio.CancelledError(f"controller-{name} not started: the backend is shutting down")
        task = asyncio.create_task(coro, name=f"controller-{name}")
        task.add_done_callback(_fatal_if_ended)
        self._tasks.append(task)

    async def _lead(self) -> None:
        """Wait for the leader lease (a standby is not ready), then act: clear the previous controller's
        work, take an id range, run the loops, and keep the lease. Losing it to another instance ends
        this one (``LeadershipLost`` through ``_fatal_if_ended``), so two controllers never both act."""
        await self.leadership.acquire()
        cancellation_point()
        await self._clear_previous_work()
        previous = await self.registry.seed()  # its holders (spares that took a stage too) keep their stages
        if previous is not None:
            log.info("an earlier controller published epoch %d: its stage holders are kept", previous.epoch)
        self._incarnation = int(await self.redis.incr(keys.INCARNATION))
        self.scheduler.start_ids_at(self._incarnation << 32)
        cancellation_point()
        self._start("control", self._control_loop())
        self._start("dispatch", self._dispatch_loop())
        self._start("relay", self._relay_loop())
        await self.leadership.keep()

    async def _clear_previous_work(self) -> None:
        """The controller owns request state: work queued by an earlier controller (its clients are
        gone with it) is dropped, so workers never chase microbatches nobody waits for."""
        stale = [keys.PROMPT_QUEUE, keys.COLOCATED_QUEUE, keys.READY_QUEUE, keys.RESUME, keys.RECOVERY]
        async for key in self.redis.scan_iter(match=keys.microbatch(0).rsplit(":", 1)[0] + ":*"):
            stale.append(key)
        async for key in self.redis.scan_iter(match=keys.tokens(0).rsplit(":", 1)[0] + ":*"):
            stale.append(key)
        await self.redis.delete(*stale)

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True  # from now on nothing starts: the list below is every task there will be
        tasks = [*self._tasks, *([self._repair_task] if self._repair_task else [])]
        for t in tasks:
            t.remove_done_callback(_fatal_if_ended)
            t.cancel()
        # A deadline, not a hang: a task that does not end once cancelled is named with its stack.
        _, stuck = await asyncio.wait(tasks, timeout=SHUTDOWN_DEADLINE_S) if tasks else ((), ())
        for t in stuck:
            log.error(
                "controller task %s did not end within %.0f s of being cancelled:\n%s",
                t.get_name(),
                SHUTDOWN_DEADLINE_S,
                await_chain(t),
            )
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                log.warning("controller task %s had failed: %r", t.get_name(), t.exception())
        with contextlib.suppress(RedisError, OSError):  # a standby takes over at once
            await self.leadership.release()

    # -- Backend protocol ------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._ready

    def stats(self) -> BackendStats:
        return BackendStats(
            queue_depth=self.scheduler.queue_depth,
            workers={w: ("alive:" if v.alive else "dead:") + v.state.value for w, v in self._workers.items()},
            kv_held={w: (v.kv_bytes, v.kv_microbatches) for w, v in self._workers.items()},
            stalled_s=self.progress.stalled_s,
        )

    def overview(self) -> Overview:
        """What the status page shows (:mod:`dejavu_controller.overview`); reads state, changes nothing."""
        now = time.monotonic()
        repair = None
        if self._repair_task is not None and self._repair_plan is not None:
            epoch, plan = self._repair_plan
            timings = self.repair.current
            if timings is not None and timings.detected_at != plan.detected_at:
                timings = None  # the previous run's: this one was cancelled before it began
            repair = RepairView.of(
                epoch, plan.replaced, plan.resumable, plan.not_started, plan.dropped, self._repair_task, timings, now
            )
        dispatched = (r for mb in self.scheduler.active.values() for r in mb.requests)
        live = requests_in_flight(self.scheduler.waiting, dispatched)
        return Overview(
            leader=self.leadership.held,
            ready=self._ready,
            topology=self.registry.topology,
            workers=dict(self._workers),
            requests=request_views(live, now),
            requests_in_flight=len(live),
            repair=repair,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self._ready:
            if not self.leadership.held:
                raise NotReadyError("this controller is standing by: another controller holds the leader lease")
            raise NotReadyError("no complete pipeline is registered")
        req = Request(
            request_id=request.request_id, prompt_ids=request.prompt_token_ids, sampling=request.sampling.resolved()
        )
        req.trace = RequestTrace.start(req.request_id, len(req.prompt_ids), req.sampling)
        try:
            self.scheduler.admit(req)  # QueueFullError propagates before the first event
        except Exception:
            if req.trace is not None:
                req.trace.ended("refused", 0)
            raise
        self._wake.set()
        return self._events(req)

    async def _events(self, req: Request) -> AsyncIterator[TokenEvent]:
        try:
            while True:
                cancellation_point()
                try:
                    async with asyncio.timeout(self.settings.controller.request_timeout_s):  # not wait_for: above
                        ev = await req.events.get()
                except TimeoutError:
                    log.error("request %s timed out", req.request_id)
                    req.fail()
                    yield TokenEvent(token_ids=(), finish_reason=FinishReason.ERROR)
                    return
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not req.done:
                await self._cancel(req)
            if req.trace is not None:
                req.trace.ended(req.status.value, len(req.output_ids))

    async def _cancel(self, req: Request) -> None:
        req.transition(RequestStatus.CANCELLED)
        if req.mb_id is not None and req.row is not None:
            await self.redis.sadd(keys.microbatch_cancel(req.mb_id), req.row)
        self._wake.set()

    # -- control -----------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        interval = self.settings.recovery.heartbeat_interval_s
        while True:
            cancellation_point()
            try:
                await self._control_once()
            except LeadershipLost:  # another instance leads now: this one stops acting (the process ends)
                raise
            except Exception:  # keep the controller alive through transient Redis errors
                log.exception("control loop iteration failed")
            await asyncio.sleep(interval)

    async def _control_once(self) -> None:
        if self._dropped_keys:
            await self.redis.delete(*self._dropped_keys)
            self._dropped_keys.clear()
        if self.registry.topology is not None and not await self.redis.exists(keys.TOPOLOGY):
            await self._redis_lost()
        self._workers = await self.registry.workers()
        trust_leases = self._leases_trusted()
        await self._collect_kv_bytes()
        self.writers.update(self._workers, self.registry.topology)
        # A dispatch never interleaves with a change of topology: a microbatch formed while a repair is
        # planned would be in neither the repair's plan nor a pipeline that keeps it (the workers drop,
        # at the resume point, every cache the plan does not name).
        async with self._dispatching:
            await self._topology_once(trust_leases)
        self.writers.update(self._workers, self.registry.topology)
        self._watch_progress(time.monotonic())

    def _watch_progress(self, now: float) -> float | None:
        """Whether dispatched work has stalled at ``now`` (see ``dejavu_controller.progress``): how long it
        has had no token-stream entry, past the limit, while a pipeline is up and no repair runs."""
        repairing = self._repair_task is not None and not self._repair_task.done()
        up = self._ready and not repairing
        return self.progress.observe(now, awaiting=bool(self._stream_ids), pipeline_up=up)

    async def _topology_once(self, trust_leases: bool) -> None:
        old = self.registry.topology
        lost = self.registry.lost(self._workers, trust_leases)
        draining = self.registry.draining(self._workers)
        if old is None or lost or draining:
            topo = self.registry.assemble(self._workers)
            if topo is None and (old is None or lost):
                if lost and self._ready:
                    log.error("lost %s and no replacement is available: waiting for one", lost)
                self._ready = False
                return
            if topo is None:  # draining holders serve on until a replacement registers (or they leave)
                if set(draining) - self._drain_waiting:
                    log.warning("%s draining: no replacement available yet, they serve on meanwhile", draining)
                self._drain_waiting = set(draining)
            else:
                plan: list[_RepairPlan] = []

                async def announce(new: Topology) -> None:  # before the new epoch is visible to anyone
                    if old is not None:
                        plan.append(self._plan_repair(old, new, lost))
                        await self.repair.announce(new.epoch, plan[0].replaced, plan[0].resumable)

                new = await self.registry.publish(topo, self._workers, before=announce, fenced=self.leadership.fenced)
                if plan:
                    why = f"lost {lost}" if lost else f"handing over the stages of draining {draining}"
                    log.warning("%s: repairing the pipelines at epoch %d", why, new.epoch)
                    self._start_repair(new, plan[0])
                if lost:
                    await self._forget_claims(lost)
                self._drain_waiting = set()
        was = self._ready
        self._ready = self.registry.ready(self._workers)
        if self._ready != was:
            log.info("system %s", "ready" if self._ready else "not ready")
            self._wake.set()

    async def _redis_lost(self) -> None:
        """Redis restarted empty (the topology this controller published is gone, and with it every
        spec, token stream and queue): fail the dispatched work to its clients, keep the waiting
        requests, and start over with a fresh pipeline (published without a recovery order, so the
        workers drop every cache) once the workers have registered again."""
        active = list(self.scheduler.active.values())
        log.error(
            "Redis lost its state (the topology is gone): failing %d in-flight microbatch(es), keeping %d "
            "waiting request(s), publishing a fresh pipeline when the workers are back",
            len(active),
            self.scheduler.queue_depth,
        )
        if self._repair_task is not None:
            self._repair_task.cancel()
            self._repair_task = None
        self._repairing = set()
        for mb in active:
            self._drop(mb, "Redis lost its state")
        self.registry.forget()
        self._ready = False
        self._kv_seen.clear()  # the byte counters start over too
        # Ids of this incarnation stay unique: a controller started later must take a newer one.
        current = await self.redis.get(keys.INCARNATION)
        if current is None or int(current) < self._incarnation:
            await self.redis.set(keys.INCARNATION, self._incarnation)
        # Work queued between the restart and now belongs to the microbatches just failed.
        await self.redis.delete(keys.PROMPT_QUEUE, keys.COLOCATED_QUEUE, keys.READY_QUEUE)
        await self._ensure_groups()

    async def _ensure_groups(self) -> None:
        """Create the work queues' consumer groups (and streams) unless they exist (workers create them
        too, at the start of an epoch or on a NOGROUP reply; whoever is first wins)."""
        for stream, group in ((keys.PROMPT_QUEUE, keys.PROMPT_GROUP), (keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP)):
            try:
                await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _collect_kv_bytes(self) -> None:
        """Feed the workers' KV byte counters (monotonic, in Redis) into the metrics as deltas.

        The workers write these counters, so each field is checked: one that is not a known purpose with
        an integer count is logged and removed (every worker's ``HINCRBY`` of it would fail), and a key
        that is not a hash (Redis ``WRONGTYPE``) is logged and removed; neither ever stops the control loop
        that calls this before failure detection."""
        if self.metrics is None:
            return
        try:
            counters = await self.redis.hgetall(keys.KV_BYTES)
        except ResponseError as exc:
            log.warning("removing the KV byte counters (%s): %s", keys.KV_BYTES, exc)
            await self.redis.delete(keys.KV_BYTES)
            return
        malformed = []
        for purpose, counted in counters.items():
            try:
                name, total = text(purpose), int(counted)
                stream = KVStream(name)
            except ValueError:
                log.warning("removing a malformed KV byte counter in %s: %r = %r", keys.KV_BYTES, purpose, counted)
                malformed.append(purpose)
                continue
            delta = total - self._kv_seen.get(name, 0)
            self._kv_seen[name] = total
            if delta > 0:
                self.metrics.add_kv_bytes(delta, stream)
        if malformed:
            await self.redis.hdel(keys.KV_BYTES, *malformed)

    def _leases_trusted(self) -> bool:
        """False for one lease period after the control loop went longer than a lease without reading the
        registry: Redis (or this process) stalled, so every worker's lease may have expired at once while
        the workers are fine. They renew within a lease period; one that does not is failed after that."""
        now = time.monotonic()
        ttl = self.settings.recovery.lease_ttl_s
        if self._last_poll is not None and now - self._last_poll > ttl:
            self._lease_grace_until = now + ttl + self.settings.recovery.heartbeat_interval_s
            log.warning(
                "control loop stalled %.1f s (Redis or this process): lease expiries count as failures again in %.1f s",
                now - self._last_poll,
                self._lease_grace_until - now,
            )
        self._last_poll = now
        return now >= self._lease_grace_until

    async def _forget_claims(self, workers: list[str]) -> None:
        """Queue entries a lost worker claimed and never acknowledged would stay pending for it forever
        (nothing reads them again: the repair re-runs their microbatches): drop its consumers from the
        work queues' groups, pending entries and all. A worker that comes back under the same id joins
        again as a new consumer."""
        pipe = self.redis.pipeline(transaction=False)
        for worker in workers:
            for stream, group in ((keys.PROMPT_QUEUE, keys.PROMPT_GROUP), (keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP)):
                pipe.xgroup_delconsumer(stream, group, worker)
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception) and not any(m in str(result) for m in ("NOGROUP", "key to exist")):
                log.warning("could not drop a lost worker's queue claims: %s", result)

    def _plan_repair(self, old: Topology, new: Topology, lost: list[str]) -> _RepairPlan:
        """What the repair of ``new`` covers: stages replaced, microbatches to resume, re-run or drop (the
        ones that kept failing are failed to their clients here). An unfinished repair is cancelled."""
        detected_at = time.monotonic()
        replaced = self.registry.replaced(old, new, lost)
        if self._repair_task is not None and not self._repair_task.done():
            # A failure during recovery: the stages the unfinished repair was restoring are still
            # not restored, so they count as replaced again at the newer epoch.
            self._repair_task.cancel()
            holders = {a.stage: a.worker_id for a in new.token_stages}
            replaced = {**{s: holders[s] for s in self._repairing if s in holders}, **replaced}
        self._repairing = set(replaced)
        limit = self.settings.controller.max_stalled_repairs
        dropped = [mb for mb in list(self.scheduler.active.values()) if mb.note_repair(limit)]
        for mb in dropped:
            self._drop(mb, f"in flight for {mb.stalled_repairs} repairs in a row without progress")
        active = self.scheduler.active.values()
        resumable = [mb.spec.mb_id for mb in active if mb.first_complete]
        for mb in [*dropped, *active]:  # on the traces of the requests it covers
            outcome = "dropped" if mb in dropped else "resume" if mb.first_complete else "rerun"
            for req in mb.requests:
                if req.trace is not None:
                    req.trace.repaired(new.epoch, outcome, replaced)
        not_started = [mb.spec.mb_id for mb in active if not mb.first_complete]
        return _RepairPlan(replaced, resumable, not_started, [mb.spec.mb_id for mb in dropped], detected_at)

    def _start_repair(self, new: Topology, plan: _RepairPlan) -> None:
        cancellation_point()  # not while shutting down: the control loop was cancelled
        covered = [*plan.resumable, *plan.not_started]
        self._repair_plan = (new.epoch, plan)
        self._repair_task = task = asyncio.create_task(
            self.repair.run(
                new,
                plan.replaced,
                plan.resumable,
                plan.not_started,
                self._redispatch,
                plan.detected_at,
                self.metrics,
                dropped=plan.dropped,
            )
        )
        task.add_done_callback(lambda t: self._repair_ended(t, covered))
        traces = (r.trace for m in covered if m in self.scheduler.active for r in self.scheduler.active[m].requests)
        span = start_repair(new.epoch, plan.replaced, (t for t in traces if t is not None))
        task.add_done_callback(lambda t: end_repair(span, t))

    def _repair_ended(self, task: asyncio.Task, covered: list[int]) -> None:
        """A repair that failed (a Redis error half way) leaves its microbatches stranded: the workers
        give up waiting for its resume point and drop them, so their clients get an error now."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("repair failed: %r", task.exception(), exc_info=task.exception())
        for mb_id in covered:
            mb = self.scheduler.active.get(mb_id)
            if mb is not None:
                self._drop(mb, "its repair failed")

    def _drop(self, mb: Microbatch, why: str) -> None:
        """Fail ``mb``'s requests to their clients and forget it (its keys go with the repair's clean-up)."""
        log.error("failing microbatch %d (requests %s): %s", mb.spec.mb_id, [r.request_id for r in mb.requests], why)
        for req in mb.requests:
            req.fail()
        self.scheduler.complete(mb.spec.mb_id)
        self._stream_ids.pop(mb.spec.mb_id, None)
        self._dropped_keys.extend(
            (keys.tokens(mb.spec.mb_id), keys.microbatch_cancel(mb.spec.mb_id), keys.microbatch(mb.spec.mb_id))
        )

    async def _redispatch(self, mb_ids: list[int]) -> None:
        """Queue the prompts of ``mb_ids`` again (their specs are unchanged; duplicate tokens are dropped)."""
        mbs = [self.scheduler.active[m] for m in mb_ids if m in self.scheduler.active]
        if mbs:
            await self._dispatch(mbs, write_specs=False)

    # -- dispatch ----------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        wait = max(self.settings.controller.batch_wait_ms / 1000.0, 0.001)
        while True:
            cancellation_point()
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns the event's result when it is set in
            # the moment the task is cancelled, swallowing the cancellation (shutdown then hangs).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._wake.clear()
            async with self._dispatching:
                if not self._ready:
                    continue
                written = await self._form_and_write()
            if not written:
                await asyncio.sleep(DISPATCH_RETRY_S)

    async def _form_and_write(self) -> bool:
        """Form new microbatches and write them, as one step: if the write fails (a Redis error, e.g. OOM
        at ``maxmemory``), they are un-formed (their requests back at the head of the queue, their slots
        free) and their keys queued for deletion, in case the write landed after all (a connection lost
        after EXEC): a worker that finds no spec drops the task. False if the write failed."""
        formed = self.scheduler.form()
        try:
            await self._dispatch(formed)
        except Exception:
            log.exception(
                "dispatch failed: microbatches %s un-formed, their requests wait in the queue again",
                [mb.spec.mb_id for mb in formed],
            )
            self.scheduler.unform(formed)
            for mb in formed:
                self._dropped_keys.extend((keys.tokens(mb.spec.mb_id), keys.microbatch(mb.spec.mb_id)))
            return False
        return True

    async def _dispatch(self, mbs: list[Microbatch], write_specs: bool = True) -> None:
        """Write the specs of ``mbs`` (unless ``write_specs`` is False: a re-run) and queue their prompt
        tasks, in one transaction: either all of it is written or none (barring a connection lost after
        EXEC, when the outcome is unknown). Raises the Redis error of a failed write."""
        if not mbs:
            return
        pipe = self.redis.pipeline(transaction=True)
        if write_specs:
            for mb in mbs:
                pipe.set(keys.microbatch(mb.spec.mb_id), mb.spec.encode())
        # Stamped with the epoch they are queued under (dispatch and topology changes exclude each other).
        epoch = self.registry.topology.epoch if self.registry.topology is not None else 0
        for task in self.scheduler.pack_prompt_tasks(mbs, epoch):
            pipe.xadd(self._queue, {"task": task.encode()}, maxlen=keys.STREAM_MAXLEN, approximate=True)
        await pipe.execute()
        if write_specs:  # relayed from now on: a failed write leaves nothing to relay
            for mb in mbs:
                self._stream_ids[mb.spec.mb_id] = b"0-0"
                for req in mb.requests:
                    if req.trace is not None:
                        req.trace.dispatched(mb.spec.mb_id, req.row, epoch)
        log.info("dispatched microbatches %s", [(m.spec.mb_id, len(m.requests)) for m in mbs])

    # -- relay -------------------------------------------------------------------------------
    async def _relay_loop(self) -> None:
        while True:
            cancellation_point()
            if not self._stream_ids:
                await asyncio.sleep(0.005)
                continue
            try:
                await self._relay_once()
            except Exception:  # a Redis error: relay again once it answers (entries are read by id)
                log.exception("relay failed")
                await asyncio.sleep(0.1)

    async def _relay_once(self) -> None:
        streams: dict[Any, Any] = {keys.tokens(mb): sid for mb, sid in self._stream_ids.items()}
        resp: Any = await self.redis.xread(streams, block=50, count=256)  # [(stream, [(entry id, fields)])]
        if resp:
            self.progress.progressed(time.monotonic())
            self.writers.update(self._workers, self.registry.topology)
        for stream, entries in resp or []:
            mb_id = int(stream.decode().rsplit(":", 1)[1])
            for entry_id, fields in entries:
                if mb_id in self._stream_ids:
                    self._stream_ids[mb_id] = entry_id
                self._relay_entry(mb_id, fields)
            await self._maybe_complete(mb_id)

    def _relay_entry(self, mb_id: int, fields: dict) -> None:
        mb = self.scheduler.active.get(mb_id)
        if mb is None:
            return
        try:
            writer, payload = verify_entry(keys.tokens(mb_id), fields, "step", self.writers)
        except UnverifiedEntry as exc:
            log.error("dropping token entry for microbatch %d: %s", mb_id, exc)
            return
        try:
            step = TokenStep.decode(payload)
        except ValidationError as exc:
            log.error("dropping malformed token entry for microbatch %d by %s: %s", mb_id, writer, exc)
            return
        rows = len(step.tokens)
        per_row = (step.logprobs, step.prompt_logprobs, step.refusals)
        if len(step.finished) != rows or any(len(x) not in (0, rows) for x in per_row):
            log.error("dropping token entry for microbatch %d: its per-row fields differ in length", mb_id)
            return
        for row, req in enumerate(mb.requests):
            if row >= len(step.tokens):
                break
            fin = step.finished[row]
            if step.tokens[row] >= 0 or fin is not None:
                mb.started_rows.add(row)
            if fin is not None:
                mb.finished_rows.add(row)
            logprob = step.logprobs[row] if step.logprobs else None
            prompt = step.prompt_logprobs[row] if step.prompt_logprobs else None
            refusal = step.refusals[row] if step.refusals else None
            if not req.deliver(step.step, step.tokens[row], fin, logprob, prompt, refusal):
                continue
            if req.trace is not None:
                req.trace.delivered(step.step, fin)
            if req.diverged_at == step.step:
                log.error(
                    "request %s failed: a re-run of microbatch %d gave another token at step %d than the one "
                    "delivered (its answer is not spliced from two runs)", req.request_id, mb_id, step.step
                )  # fmt: skip
            elif fin is FinishReason.ERROR:
                log.error("request %s failed in the workers (microbatch %d, step %d)", req.request_id, mb_id, step.step)

    async def _maybe_complete(self, mb_id: int) -> None:
        mb = self.scheduler.active.get(mb_id)
        if mb is None or not mb.done:
            return
        self.scheduler.complete(mb_id)
        self._stream_ids.pop(mb_id, None)
        await self.redis.delete(keys.tokens(mb_id), keys.microbatch_cancel(mb_id), keys.microbatch(mb_id))
        self._wake.set()


def _outstanding_rows(settings: Settings) -> int:
    """Requests dispatched at once: what the token pipeline decodes plus what the prompt pipeline may run
    ahead. With swapping, a cohort holds one microbatch, so D_t + D_p microbatches, as in the paper. A
    request-scheduled pipeline gets twice what it runs: its policy fills a place the moment one is free."""
    c = settings.controller
    if settings.schedules_requests:
        return 2 * c.max_running
    ahead = 0 if c.mode is Mode.COLOCATED else c.prompt_depth * c.prompt_microbatch
    if settings.swap.enabled:
        return (c.token_depth + (0 if c.mode is Mode.COLOCATED else c.prompt_depth)) * c.token_microbatch
    return c.max_running + ahead


def _fatal_if_ended(task: asyncio.Task) -> None:
    """Done callback of the backend's loops, which run until cancelled: ending otherwise (an error
    their own handlers did not expect) ends the controller, visibly, instead of leaving a gateway that
    answers /health but never dispatches or relays again."""
    if not task.cancelled():
        die(f"controller task {task.get_name()}", task.exception())

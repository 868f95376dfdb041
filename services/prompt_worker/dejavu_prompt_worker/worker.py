"""A prompt worker: one stage of the prompt pipeline.

Stage 0 claims prompt microbatches from the prompt stream (a consumer group: at-least-once, the
last stage acknowledges), embeds them and runs its layers; every stage streams each layer's KV, as
soon as the layer is done, to the token stage holding that layer (split by layer range, rows and
positions remapped into the token microbatches the prompt microbatch feeds), then forwards hidden
states. The last stage samples each row's first token (step 0), publishes it, and tells token
stage 0 that the rows are ready.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import redis
import torch
from pydantic import ValidationError

from dejavu_common import keys, tracing
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import (
    FinishReason,
    Logprob,
    MicrobatchSpec,
    PromptDone,
    PromptSlice,
    PromptTask,
    StageAssignment,
    TokenStep,
    Topology,
    WorkerRole,
)
from dejavu_common.sched import BlockBook
from dejavu_common.signing import token_entry
from dejavu_common.stopping import StopCriteria
from dejavu_common.tracing import RowSpans
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.remote import resolve_model_folder
from dejavu_engine.sampling import RowContext, prompt_logprobs, sample_rows
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.threads import configure_torch_threads
from dejavu_prompt_worker.paged import PagedPrompts, Prompt, PromptPlanner, SliceLogits, input_ids, split_passes
from dejavu_worker.dataplane import Kind, StageMessage
from dejavu_worker.endpoint import Channel, largest_message
from dejavu_worker.lifecycle import WorkerProcess
from dejavu_worker.memory import available_memory_bytes
from dejavu_worker.metrics import PassKind, PoolUsage, PrefixCacheStats, StageSnapshot
from dejavu_worker.microbatch import fetch_spec
from dejavu_worker.rows import RowTracker
from dejavulib.paged import BlockGeometry, BlockPool
from dejavulib.streaming import LayerStreamer
from dejavulib.topology import Piece, plan_pieces

log = logging.getLogger("dejavu.prompt_worker")

# What one prompt task can raise that concerns its requests alone (values that break the computation,
# a spec that is gone): the task's rows are failed to their clients and the stage serves the next task.
TASK_FAILURES: tuple[type[Exception], ...] = (DeadlineExceeded, ValueError, IndexError, RuntimeError)
# XAUTOCLAIM calls of one look for unfinished tasks (each looks at up to 10 pending entries; the next look
# goes on where this one stopped).
_RECLAIM_CALLS = 100
_FAILED_TASKS = 1024  # failed tasks remembered, whose later passes are dropped


class PromptWorker(WorkerProcess):
    role = WorkerRole.PROMPT

    def __init__(self, settings, worker_id: str, spare: bool = False) -> None:
        super().__init__(settings, worker_id, spare, configure_torch_threads(settings.engine.torch_threads))
        self.stage: Stage | None = None
        self.stage_index = 0  # this worker's prompt stage at the epoch it serves
        self._held: tuple[str, PromptTask, StageIO] | None = None  # a task of an epoch not served yet
        self._reclaim_at = 0.0  # when stage 0 next looks for claimed tasks nobody finished (time.monotonic)
        self._reclaim_cursor = "0-0"  # where that look goes on in the queue's pending entries
        self.paged: PagedPrompts | None = None  # a request-scheduled deployment's prompt pool
        self.planner: PromptPlanner | None = None  # ... and, on stage 0, its book (new at every epoch)
        # The last stage's logits after each prompt of a task run in several passes, until its final pass.
        self._firsts: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._failed: dict[int, None] = {}  # tasks failed here lately: their later passes are dropped

    def load(self, assignment: StageAssignment, topology: Topology) -> None:
        m = self.settings.model
        engine = self.settings.engine
        self.stage = Stage(
            resolve_model_folder(self.settings, assignment.layers),
            assignment.layers,
            m.device,
            m.dtype,
            engine.packs_gemms(decodes=False),
            ragged_prefill=engine.ragged_prefill,
        )
        if self.endpoint is not None:
            self.endpoint.bound_messages(largest_message(topology, self.settings, self.stage.spec))
        self.paged, self.planner = None, None
        if self.settings.schedules_requests:
            self.paged = PagedPrompts(self.stage, self._prompt_pool(assignment, topology))
        log.info(
            "loaded layers %s (%.1f MB, packed GEMMs %s, %s)",
            assignment.layers,
            self.stage.param_bytes / 1e6,
            self.stage.packed_gemms,
            "no paged pool: left-padded prompt batches"
            if self.paged is None
            else f"a paged pool of up to {self.paged.pool.max_blocks} blocks of {engine.kv_block_size} positions, "
            f"prefix caching {'on' if engine.prefix_caching else 'off'}",
        )

    def _prompt_pool(self, assignment: StageAssignment, topology: Topology) -> BlockPool:
        """The paged pool of a request-scheduled deployment's prompt stage: ``engine.kv_pool_bytes``, or 30% of the
        memory available now, and room for one task of prompts of the whole context at least. Stage 0's book hands
        out the block ids of every prompt stage's pool, so each sizes it by the prompt stage with the most layers; a
        later stage allows a quarter more (the memory each finds available at load differs a little)."""
        assert self.stage is not None
        engine = self.settings.engine
        geometry = BlockGeometry.of(self.stage.kv_layout(1, 1), engine.kv_block_size)
        widest = max(a.layers[1] - a.layers[0] for a in topology.prompt_stages)
        budget = engine.kv_pool_bytes if engine.kv_pool_bytes is not None else int(0.3 * available_memory_bytes())
        one_task = self.settings.controller.prompt_microbatch * -(-engine.max_context // engine.kv_block_size)
        blocks = max(budget // replace(geometry, layers=widest).bytes_per_block, one_task)
        if assignment.stage > 0:
            blocks += blocks // 4
        return self.stage.block_pool(engine.kv_block_size, blocks, slab_blocks=32)

    def snapshot(self) -> StageSnapshot:
        """Adds the prompt pool's blocks in use and stage 0's prefix cache (read without locks: counts only)."""
        base = super().snapshot()
        planner = self.planner
        if planner is None:
            return base
        stats = planner.book.stats()
        return replace(
            base,
            pools={"stage": PoolUsage(stats.used, stats.total)},
            prefix_cache=PrefixCacheStats(stats.queries, stats.hits, stats.shared, stats.cached_free),
        )

    def serve(self, topology: Topology) -> None:
        assert self.endpoint is not None and self.redis is not None
        me = topology.stage_of(self.worker_id)
        assert me is not None
        stages = topology.prompt_stages
        self.next_peer = stages[me.stage + 1].worker_id if me.stage + 1 < len(stages) else None
        self.stage_index = me.stage
        self.token_stages = topology.token_stages
        peers = [a.worker_id for a in self.token_stages] + ([self.next_peer] if self.next_peer else [])
        self.endpoint.set_epoch(topology.epoch)
        self.endpoint.connect_all(self.redis, peers)
        if self.paged is not None:  # a new epoch: the pools' contents are nobody's
            self.paged.written.clear()
            self.paged.reached.clear()
            self._firsts.clear()
            self.planner = self._planner(self.paged.pool) if me.stage == 0 else None
        if me.stage == 0:
            _ensure_group(self.redis)
        while not self.epoch_changed():
            try:
                claimed = self._next_task(topology.epoch, me.stage == 0)
                if claimed is not None:
                    try:
                        with self._busy():
                            self._process(*claimed)
                    except TASK_FAILURES as exc:
                        self._fail_task(claimed[0], claimed[1], exc)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                _ensure_group(self.redis)  # the controller restarted and cleared the queues
            except DeadlineExceeded as exc:
                # A task whose microbatch is gone (a stale queue entry): drop it, keep serving.
                log.error("dropped a prompt task: %s", exc)

    def _planner(self, pool: BlockPool) -> PromptPlanner:
        engine, m = self.settings.engine, self.settings.model
        # Equal token ids give other KV under another model, dtype or block size: none of them may hit.
        namespace = f"prompt|{m.folder}|{m.dtype}|{engine.kv_block_size}".encode()
        return PromptPlanner(BlockBook(pool.max_blocks, engine.kv_block_size, namespace, engine.prefix_caching))

    def _next_task(self, epoch: int, first: bool) -> tuple[str, PromptTask, StageIO] | None:
        """The next task to run at ``epoch``: one held back earlier, or a newly claimed (stage 0) or
        received one. A task queued under a newer epoch than the one served (the controller published a
        topology this worker has not seen yet: a repair's re-run) is held back until this worker serves
        that epoch; run now, its KV would go to the old epoch's token stages, sealed with the old epoch,
        and be dropped (its requests then failing at the token stages' deadline)."""
        if self._held is not None:
            if self._held[1].epoch > epoch:
                time.sleep(0.005)  # the newer topology is on its way: epoch_changed() ends this epoch
                return None
            claimed, self._held = self._held, None
            return claimed
        claimed = self._claim() if first else self._receive()
        if claimed is not None and claimed[1].epoch > epoch:
            log.info("task %d was queued at epoch %d: holding it until this worker serves it (now %d)",
                     claimed[1].task_id, claimed[1].epoch, epoch)  # fmt: skip
            self._held, claimed = claimed, None
        return claimed

    def _busy(self) -> contextlib.AbstractContextManager[None]:
        """A task runs: no memory release meanwhile; its cache counts as freed after it."""
        return self.heartbeat.memory.busy() if self.heartbeat is not None else contextlib.nullcontext()

    # -- input --------------------------------------------------------------------------------
    def _claim(self) -> tuple[str, PromptTask, StageIO] | None:
        assert self.redis is not None
        reclaimed = self._reclaim()
        if reclaimed is not None:
            return reclaimed
        resp = self.redis.xreadgroup(keys.PROMPT_GROUP, self.worker_id, {keys.PROMPT_QUEUE: ">"}, count=1, block=50)
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                try:
                    task = PromptTask.decode(fields[b"task"])
                    ids = self._input_ids(task)
                except (KeyError, ValidationError, DeadlineExceeded) as exc:
                    log.error("dropped prompt task %s: %s", entry_id, exc)
                    self.redis.xack(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, entry_id)
                    continue
                return entry_id.decode(), task, StageIO(input_ids=ids)
        return None

    def _reclaim(self) -> tuple[str, PromptTask, StageIO] | None:
        """A task claimed ``recovery.prompt_reclaim_s`` ago or more that no last stage has finished (a stage
        stalled, or the task's activations were lost on the way, and no change of topology re-runs it),
        taken over (XAUTOCLAIM) to run again; looked for every quarter of that at most, through the whole
        list of pending entries (in calls that each look at a few). Should the first run finish after all,
        its output is a duplicate (same seed, same step): the controller and token stage 0 keep the first."""
        assert self.redis is not None
        reclaim_s = self.settings.recovery.prompt_reclaim_s
        now = time.monotonic()
        if now < self._reclaim_at:
            return None
        self._reclaim_at = now + reclaim_s / 4
        for _ in range(_RECLAIM_CALLS):
            cursor, entries, *_ = self.redis.xautoclaim(
                keys.PROMPT_QUEUE, keys.PROMPT_GROUP, self.worker_id, int(reclaim_s * 1000), self._reclaim_cursor, 1
            )
            self._reclaim_cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            for entry_id, fields in entries:
                claimed = self._rerun(entry_id, fields)
                if claimed is not None:
                    log.warning("prompt task %d was claimed %.0f s ago or more and is not finished: running it "
                                "again", claimed[1].task_id, reclaim_s)  # fmt: skip
                    self._reclaim_at = now  # there may be more
                    return claimed
            if self._reclaim_cursor == "0-0":  # every pending entry was looked at
                return None
        return None

    def _rerun(self, entry_id: bytes, fields: dict[bytes, bytes]) -> tuple[str, PromptTask, StageIO] | None:
        """A reclaimed entry to run again, or None: dropped (and acknowledged) if malformed, queued before
        the epoch this worker serves (the repair that began the epoch re-ran or failed its microbatches), or
        of a microbatch that has ended (no spec)."""
        assert self.redis is not None
        try:
            task = PromptTask.decode(fields[b"task"])
        except (KeyError, TypeError, ValidationError) as exc:
            log.error("dropped prompt task %s: %s", entry_id, exc)
            self.redis.xack(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, entry_id)
            return None
        ended = [p.mb_id for p in task.pieces if not self.redis.exists(keys.microbatch(p.mb_id))]
        if task.epoch < self.serve_epoch or ended:
            why = f"microbatches {ended} ended" if ended else f"of epoch {task.epoch}, before this one"
            log.info("dropped unfinished prompt task %d: %s", task.task_id, why)
            self.redis.xack(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, entry_id)
            return None
        return entry_id.decode(), task, StageIO(input_ids=self._input_ids(task))

    def _receive(self) -> tuple[str, PromptTask, StageIO] | None:
        assert self.endpoint is not None
        payload = self.endpoint.recv(Channel.ACTIVATION, timeout_s=0.05)
        if payload is None:
            return None
        try:
            msg = StageMessage.decode(payload)
            if msg.task is None or msg.entry is None:
                raise ValueError("a prompt activation without its task")
            if msg.task.task_id in self._failed:
                return None  # a later pass of a task this stage failed
            return msg.entry, msg.task, StageIO(hidden=msg.tensor)
        except ValueError as exc:
            log.error("dropped a malformed prompt activation: %s", exc)
            return None

    def _specs(self, task: PromptTask) -> dict[int, MicrobatchSpec]:
        assert self.redis is not None
        deadline = self.settings.transport.deadline_s
        return {p.mb_id: fetch_spec(self.redis, p.mb_id, deadline, self.epoch_changed) for p in task.pieces}

    def _rows(self, task: PromptTask) -> list[tuple[int, int]]:
        """(token microbatch, row) of each row of the prompt microbatch, in order."""
        return [(p.mb_id, r) for p in task.pieces for r in range(*p.dst_rows)]

    def _input_ids(self, task: PromptTask) -> torch.Tensor:
        specs = self._specs(task)
        prompts = [specs[mb].rows[r].prompt_ids for mb, r in self._rows(task)]
        longest = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p)
        return ids

    # -- one prompt microbatch ----------------------------------------------------------------
    def _process(self, entry: str, task: PromptTask, io: StageIO) -> None:
        """Run ``task`` on this stage (:meth:`_compute`), within a ``dejavu.prompt`` span per traced row (the
        last stage adds the event ``first_token``); a failure ends them with its error, and propagates."""
        specs = self._specs(task)
        spans = None
        if tracing.enabled():
            rows = [specs[mb].rows[r] for mb, r in self._rows(task)]
            attributes = {tracing.STAGE: self.stage_index, "dejavu.task": task.task_id, "dejavu.epoch": task.epoch}
            spans = RowSpans.start("dejavu.prompt", rows, attributes)
        if spans is None:
            return self._compute(entry, task, io, specs)
        try:
            self._compute(entry, task, io, specs)
        except BaseException as exc:
            spans.fail(exc)
            raise
        if self.next_peer is None:
            spans.event("first_token")
        spans.end()

    def _compute(self, entry: str, task: PromptTask, io: StageIO, specs: dict[int, MicrobatchSpec]) -> None:
        assert self.stage is not None and self.endpoint is not None and self.redis is not None
        if self.paged is not None:
            return self._compute_slices(entry, task, io, specs)
        started = time.perf_counter()
        rows = self._rows(task)
        lens = [len(specs[mb].rows[r].prompt_ids) for mb, r in rows]
        geometry = BatchGeometry.for_prompts(lens)
        cache = self.stage.allocate_cache(len(rows), geometry.cur_len)
        # Each layer's KV of every piece leaves for the token stage holding the layer as soon as the
        # layer is computed (packed on the endpoint's streaming thread while the next layer computes).
        pieces = [
            Piece(
                p.mb_id,
                p.dst_rows,
                max(len(specs[p.mb_id].rows[r].prompt_ids) for r in range(*p.dst_rows)),
                specs[p.mb_id].prompt_len,
            )
            for p in task.pieces
        ]
        stages = sorted(self.token_stages, key=lambda a: a.stage)
        transfers = plan_pieces(pieces, geometry.cur_len, self.stage.layers, [a.layers for a in stages])
        peers = {a.stage: a.worker_id for a in stages}
        streamer = LayerStreamer(self.endpoint.streamer, cache, transfers, peers, self.settings.transport.deadline_s)
        # Rows that ask for their prompt's log probabilities need logits at every position (on every stage: an
        # earlier stage then does not pack the prompts, which would leave only the last position's).
        all_logits = any(specs[mb].rows[r].sampling.prompt_logprobs is not None for mb, r in rows)
        out = self.stage.prefill(io, cache, geometry, on_layer_done=streamer.on_layer_done, all_logits=all_logits)
        if self.next_peer is not None:
            msg = StageMessage(Kind.PREFILL, task.task_id, 0, out.hidden, task=task, entry=entry)
            self.endpoint.send(self.next_peer, Channel.ACTIVATION, msg.encode())
            self.metrics.observe_pass(PassKind.PREFILL, time.perf_counter() - started, sum(lens))
            return
        assert out.logits is not None  # the last stage returns logits
        wants = [specs[mb].rows[r].sampling.prompt_logprobs is not None for mb, r in rows]
        every = [out.logits[i, geometry.pad_lens[i] :] if w else None for i, w in enumerate(wants)]
        self._first_tokens(task, specs, out.logits[:, -1], every)
        self.redis.xack(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, entry)
        self.metrics.observe_pass(PassKind.PREFILL, time.perf_counter() - started, sum(lens))

    def _compute_slices(self, entry: str, task: PromptTask, io: StageIO, specs: dict[int, MicrobatchSpec]) -> None:
        """Run ``task`` over this stage's paged pool (:mod:`dejavu_prompt_worker.paged`). Stage 0 plans its slices
        (what each request's prompt finds cached), splits them into passes of at most ``prompt_task_tokens``
        positions and runs them one after the other, each sent on as it is done; a later stage runs the pass it
        received. Its blocks enter stage 0's prefix cache once its last pass is done here."""
        prompts = self._prompts(task, specs)
        planner = self.planner
        if planner is None:
            return self._pass(entry, task, io, specs, prompts)
        ordered = [prompts[p.mb_id] for p in task.pieces]
        plan = planner.plan(task.task_id, ordered)
        whole = {i for i, p in enumerate(ordered) if not p.looks_up}
        passes = split_passes(plan, self.settings.controller.prompt_task_tokens, planner.book.block_size, whole)
        try:
            for k, slices in enumerate(passes):
                one = task.model_copy(update={"slices": slices, "final": k == len(passes) - 1})
                io = StageIO(input_ids=input_ids(slices, [prompts[s.mb] for s in slices]))
                self._pass(entry, one, io, specs, prompts)
        except BaseException:
            planner.abort(plan)
            raise
        planner.finish(task.task_id, plan, ordered)

    def _prompts(self, task: PromptTask, specs: dict[int, MicrobatchSpec]) -> dict[int, Prompt]:
        """Each request of ``task`` (a one-row microbatch) as its prompt, by request."""
        if any(p.dst_rows != (0, 1) or len(specs[p.mb_id].rows) != 1 for p in task.pieces):
            raise ValueError(f"task {task.task_id}: a request-scheduled prompt task is made of one-row microbatches")
        rows = {p.mb_id: specs[p.mb_id].rows[0] for p in task.pieces}
        return {mb: Prompt(mb, row.prompt_ids, row.sampling.prompt_logprobs is None) for mb, row in rows.items()}

    def _pass(
        self, entry: str, task: PromptTask, io: StageIO, specs: dict[int, MicrobatchSpec], prompts: dict[int, Prompt]
    ) -> None:
        """One pass of ``task`` (its ``slices``) on this stage: computed, each layer's KV streamed to the token stage
        holding it, then sent on; the last stage keeps the logits of the requests whose prompt the pass ends and, at
        the task's final pass, samples every request's first token."""
        assert self.endpoint is not None and self.redis is not None and self.paged is not None
        started = time.perf_counter()
        slices = task.slices
        if not slices or any(s.mb not in prompts or s.end > len(prompts[s.mb].ids) for s in slices):
            raise ValueError(f"task {task.task_id} came without its requests' slices")
        self.paged.check(task.task_id, slices)
        streamers = self._slice_streamers(slices)

        def on_layer_done(layer: int) -> None:
            for streamer in streamers:
                streamer.on_layer_done(layer)

        every = {i for i, s in enumerate(slices) if not prompts[s.mb].looks_up}
        out = self.paged.run(io, slices, every, on_layer_done)
        for streamer in streamers:  # the blocks go back (to a next task) only once their KV has left
            streamer.wait(self.settings.transport.deadline_s)
        self.paged.computed(task.task_id, slices)
        if isinstance(out, SliceLogits):
            firsts = self._firsts.setdefault(task.task_id, {})
            for i, s in enumerate(slices):
                if s.end == len(prompts[s.mb].ids):
                    firsts[s.mb] = (out.last[i], out.every.get(i))
            if task.final:
                self._firsts.pop(task.task_id)
                if set(firsts) != set(prompts):
                    raise ValueError(f"task {task.task_id} ended without every prompt's last position")
                ordered = [firsts[p.mb_id] for p in task.pieces]
                self._first_tokens(task, specs, torch.stack([last for last, _ in ordered]), [e for _, e in ordered])
                self.redis.xack(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, entry)
        else:
            msg = StageMessage(Kind.PREFILL, task.task_id, 0, out, task=task, entry=entry)
            self.endpoint.send(self.next_peer, Channel.ACTIVATION, msg.encode())
        if task.final:
            self.paged.forget(prompts)
        self.metrics.observe_pass(PassKind.PREFILL, time.perf_counter() - started, sum(s.end - s.start for s in slices))

    def _slice_streamers(self, slices: Iterable[PromptSlice]) -> list[LayerStreamer]:
        """Per slice of a pass, what streams each layer's KV of the positions it adds to its request's prompt (on
        its first pass, the cached ones too) to the token stage holding the layer, as the layer is computed."""
        assert self.stage is not None and self.endpoint is not None and self.paged is not None
        stages = sorted(self.token_stages, key=lambda a: a.stage)
        peers = {a.stage: a.worker_id for a in stages}
        deadline = self.settings.transport.deadline_s
        size = self.paged.pool.geometry.block_size
        streamers = []
        for s in slices:
            first = 0 if s.start == len(s.writers) * size else s.start
            transfers = plan_pieces([Piece(s.mb, (0, 1), s.end - first, s.end)], s.end, self.stage.layers,
                                    [a.layers for a in stages])  # fmt: skip
            streamers.append(LayerStreamer(self.endpoint.streamer, self.paged.view(s), transfers, peers, deadline))
        return streamers

    def _fail_task(self, entry: str, task: PromptTask, error: Exception) -> None:
        """Fail every row of ``task``: an ERROR finish at step 0 on each token stream (the controller
        fails those requests) and in the ready announcement (token stage 0 frees a microbatch whose rows
        all failed, and a partly failed one stops waiting for the failed rows' KV at its deadline);
        the task is acknowledged, so it is never claimed again."""
        assert self.redis is not None
        log.error("prompt task %d failed, failing its requests: %r", task.task_id, error)
        if self.paged is not None:  # its later passes are dropped here
            self._failed[task.task_id] = None
            while len(self._failed) > _FAILED_TASKS:
                del self._failed[next(iter(self._failed))]
            self._firsts.pop(task.task_id, None)
            self.paged.forget(p.mb_id for p in task.pieces)
        pipe = self.redis.pipeline(transaction=False)
        for piece in task.pieces:
            try:
                spec = fetch_spec(self.redis, piece.mb_id, 0.0)
            except DeadlineExceeded:
                continue  # the controller has already forgotten this microbatch
            rows = range(*piece.dst_rows)
            failed = tuple(FinishReason.ERROR if r in rows else None for r in range(len(spec.rows)))
            step = TokenStep(mb_id=piece.mb_id, step=0, tokens=(-1,) * len(spec.rows), finished=failed)
            pipe.xadd(keys.tokens(piece.mb_id), token_entry(self.signer, keys.tokens(piece.mb_id), step.encode()))
            done = PromptDone(
                mb_id=piece.mb_id,
                dst_rows=piece.dst_rows,
                tokens=(-1,) * len(rows),
                finished=(FinishReason.ERROR,) * len(rows),
                epoch=self.serve_epoch,
            )
            pipe.xadd(keys.READY_QUEUE, {"done": done.encode()}, maxlen=keys.STREAM_MAXLEN, approximate=True)
        pipe.xack(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, entry)
        pipe.execute()

    def _first_tokens(
        self,
        task: PromptTask,
        specs: dict[int, MicrobatchSpec],
        last: torch.Tensor,
        every: list[torch.Tensor | None],
    ) -> None:
        """Sample step 0 for every row from ``last`` (``[rows, vocab]``, after each prompt's last position), with
        the log probabilities of the rows that ask (their prompt's from ``every[i]``, ``[prompt, vocab]``: after each
        of its positions), publish it, and announce the rows to token stage 0."""
        assert self.redis is not None and self.stage is not None
        rows = self._rows(task)
        eos = self.stage.spec.eos_token_ids
        params = [specs[mb].rows[r].sampling for mb, r in rows]
        contexts = [
            RowContext(specs[mb].rows[r].prompt_ids, (), StopCriteria.of(params[i], eos).stop_ids)
            for i, (mb, r) in enumerate(rows)
        ]
        sampled = sample_rows(last, params, [0] * len(rows), contexts)
        prompts: list[tuple[Logprob | None, ...] | None] = []
        for i, (mb, r) in enumerate(rows):
            ids, top, logits = specs[mb].rows[r].prompt_ids, params[i].prompt_logprobs, every[i]
            prompts.append(None if top is None or logits is None else prompt_logprobs(logits, ids, top))
        pipe = self.redis.pipeline(transaction=False)
        src = 0
        for piece in task.pieces:
            n = piece.dst_rows[1] - piece.dst_rows[0]
            tracker = RowTracker(specs[piece.mb_id], eos)
            mine = sampled[src : src + n]
            refused = {r: s.refused for r, s in zip(range(*piece.dst_rows), mine, strict=True) if s.refused is not None}
            for r, reason in refused.items():
                log.info("row %d of microbatch %d refused: its grammar does not compile: %s", r, piece.mb_id, reason)
            entry = tracker.step(
                0,
                [s.token for s in mine],
                rows=range(*piece.dst_rows),
                logprobs=[s.logprob for s in mine],
                prompt_logprobs=prompts[src : src + n] if any(p is not None for p in prompts) else (),
                refused=refused,
            )
            src += n
            pipe.xadd(keys.tokens(piece.mb_id), token_entry(self.signer, keys.tokens(piece.mb_id), entry.encode()))
            done = PromptDone(
                mb_id=piece.mb_id,
                dst_rows=piece.dst_rows,
                tokens=tuple(entry.tokens[r] for r in range(*piece.dst_rows)),
                finished=tuple(entry.finished[r] for r in range(*piece.dst_rows)),
                epoch=self.serve_epoch,
            )
            pipe.xadd(keys.READY_QUEUE, {"done": done.encode()}, maxlen=keys.STREAM_MAXLEN, approximate=True)
        pipe.execute()


def _ensure_group(client) -> None:
    try:
        client.xgroup_create(keys.PROMPT_QUEUE, keys.PROMPT_GROUP, id="0", mkstream=True)
    except Exception as exc:  # BUSYGROUP: it exists already
        if "BUSYGROUP" not in str(exc):
            raise

"""One token stage's compute: its microbatch caches, one pass of a step, and what follows the pass.

After its layers run, a stage either passes hidden states to the next stage, or (the last stage)
samples the step's tokens, publishes them on the microbatch's token stream and returns them to
stage 0. Every pass that writes KV also replicates the written positions to the successor.
Not thread-safe except :meth:`state`, which the prompt-KV receiver thread also calls.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, Logprob, MicrobatchSpec, TokenStep
from dejavu_common.signing import EntrySigner, token_entry
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.sampling import RowContext, prompt_logprobs, sample_rows
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_token_worker.replication import ReplicaSender, ReplicaStore
from dejavu_worker.dataplane import Kind, Returned, StageMessage, TokenReturn
from dejavu_worker.endpoint import Channel, DataEndpoint
from dejavu_worker.metrics import PassKind, Preemption, WorkerMetrics
from dejavu_worker.microbatch import KVStatus, MicrobatchState, fetch_spec
from dejavu_worker.rows import RowTracker
from dejavu_worker.swap import SwapManager, SwapState
from dejavulib.kvcache import KVCache
from dejavulib.paged import BlockPool, PagedKVCache, PoolExhausted

log = logging.getLogger("dejavu.token_worker")

# What one microbatch's step can raise that concerns that microbatch alone (its prompt KV never came,
# its spec is gone, its values break the computation): the microbatch is failed to its clients and the
# stage goes on serving the others. Transport errors (``DejaVuLibError``) are not among them.
STEP_FAILURES: tuple[type[Exception], ...] = (DeadlineExceeded, ValueError, IndexError, RuntimeError)

# Positions a new cache holds beyond the prompt; it doubles when decoding reaches its end.
_INITIAL_ROOM = 64
# Finished microbatches a stage remembers (ids grow monotonically, so older ones cannot recur).
_FINISHED_REMEMBERED = 65_536


class PassMember(NamedTuple):
    """A microbatch in one pass: its state, the step the pass produces, and the rows the pass computes
    (its unfinished rows, in order; a prefill computes every row)."""

    state: MicrobatchState
    step: int
    rows: tuple[int, ...]


class FinishedMicrobatch(Exception):
    """The microbatch finished and was released here; nothing may bring its state back."""


class PrefillRefused(Exception):
    """A mixed pass could not take the blocks of its prompt: nothing ran; that microbatch alone fails."""

    def __init__(self, mb_id: int, error: Exception) -> None:
        super().__init__(f"microbatch {mb_id}: {error}")
        self.mb_id = mb_id
        self.error = error


@dataclass(frozen=True)
class Position:
    """Where this stage sits in the token pipeline at the current epoch."""

    index: int
    depth: int
    next_peer: str | None
    first_peer: str
    colocated: bool

    @property
    def is_first(self) -> bool:
        return self.index == 0


class StageRunner:
    def __init__(
        self,
        stage: Stage,
        client: redis.Redis,
        endpoint: DataEndpoint,
        deadline_s: float,
        swap: SwapManager | None = None,
        abandon: Callable[[], bool] | None = None,
        pool: BlockPool | None = None,
        mixed_passes: bool = True,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.stage = stage
        # Where passes and preemptions are recorded (the worker's; a runner of its own in tests).
        self.metrics = metrics if metrics is not None else WorkerMetrics("standalone", "token")
        # Decode steps and prefills in one pass (run_mixed): a one-stage pipeline over a paged pool whose
        # stage runs both attentions natively.
        self.mixes = mixed_passes and pool is not None and swap is None and stage.mixes
        self.pool = pool  # the paged KV pool every microbatch's cache takes blocks from (None: contiguous)
        self.abandon = abandon  # stops a wait for a spec once a newer epoch exists
        self.swap = swap  # microbatch swapping: caches live in host memory, two device buffers
        self.redis = client
        # Signs the token-stream entries it writes (the worker's key, dejavu_common.signing; None: unsigned).
        self.signer: EntrySigner | None = None
        self.endpoint = endpoint
        self.deadline_s = deadline_s
        self.states: dict[int, MicrobatchState] = {}
        self.replicas: ReplicaSender | None = None
        self.held_replicas: ReplicaStore | None = None  # the predecessor's replicas kept here
        # With a paged pool: the host memory preempted caches may take; past it, preemption forgets a
        # microbatch's KV instead, and stage 0's driver recomputes it (None: preemption always moves to host memory).
        self.host_budget: int | None = None
        self._lock = threading.Lock()
        self._passes = 0  # passes run, for the least-recently-computed order of preemption
        self._in_pass: set[int] = set()  # the microbatches of the pass being set up
        self._finished: collections.deque[int] = collections.deque()
        self._finished_set: set[int] = set()

    # -- microbatch states --------------------------------------------------------------------
    def state(self, mb_id: int) -> MicrobatchState:
        """This stage's state of ``mb_id``, created on first use (spec from Redis, zeroed cache). Raises
        :class:`FinishedMicrobatch` for one released as finished (late prompt KV must not revive it)."""
        with self._lock:
            st = self.states.get(mb_id)
            if st is None and mb_id in self._finished_set:
                raise FinishedMicrobatch(f"microbatch {mb_id} finished")
        if st is not None:
            return st
        # Waited for without the lock: a spec that is slow to appear must not stall the other threads.
        spec = fetch_spec(self.redis, mb_id, self.deadline_s, self.abandon)
        with self._lock:
            st = self.states.get(mb_id)
            if st is None and mb_id in self._finished_set:
                raise FinishedMicrobatch(f"microbatch {mb_id} finished")
            if st is None:
                cache: KVCache | PagedKVCache
                if self.swap is not None:  # swapped caches keep their whole span (fixed device buffers)
                    cache = self.swap.add(mb_id, self.stage.kv_layout(len(spec.rows), spec.max_len))
                elif self.pool is not None:  # blocks taken as positions are written, none for padding
                    cache = self.pool.cache(self.stage.kv_layout(len(spec.rows), spec.max_len), spec.pad_lens)
                else:  # grows as tokens are written (MicrobatchState.ensure_capacity)
                    initial = min(spec.max_len, spec.prompt_len + _INITIAL_ROOM)
                    cache = self.stage.allocate_cache(len(spec.rows), initial)
                st = MicrobatchState(spec, cache, expected_cells=self.stage.num_layers * len(spec.rows))
                if self.pool is not None:
                    st.pool_wait_s = self.deadline_s
                self.states[mb_id] = st
            return st

    def release(self, mb_id: int, finished: bool = True) -> None:
        """Free ``mb_id``'s state. ``finished``: it never comes back (unlike a prompt re-run after recovery)."""
        with self._lock:
            st = self.states.pop(mb_id, None)
            if st is not None:
                st.release()  # a paged cache's blocks go back to the pool now
                if self.swap is not None:
                    self.swap.drop(mb_id)
            if finished and mb_id not in self._finished_set:
                self._finished.append(mb_id)
                self._finished_set.add(mb_id)
                if len(self._finished) > _FINISHED_REMEMBERED:
                    self._finished_set.discard(self._finished.popleft())

    def fail(self, mb_id: int, step: int, error: Exception) -> None:
        """Fail ``mb_id`` to its clients: publish an ERROR finish of every row at ``step`` on its token
        stream (the controller fails those requests and frees the microbatch; rows already finished
        ignore it). The caller releases the microbatch along the pipeline."""
        log.error("microbatch %d failed at step %d, failing its requests: %r", mb_id, step, error)
        with self._lock:
            st = self.states.get(mb_id)
        try:
            spec = st.spec if st is not None else fetch_spec(self.redis, mb_id, 0.0)
        except DeadlineExceeded:
            return  # the controller has already forgotten it
        n = len(spec.rows)
        entry = TokenStep(mb_id=mb_id, step=step, tokens=(-1,) * n, finished=(FinishReason.ERROR,) * n)
        self.redis.xadd(keys.tokens(mb_id), token_entry(self.signer, keys.tokens(mb_id), entry.encode()))

    def progress(self) -> dict[int, int]:
        """Per microbatch, the last step whose KV this stage holds (-1: prompt KV incomplete, or discarded)."""
        with self._lock:
            return {mb: st.done_step if st.holds_kv else -1 for mb, st in self.states.items()}

    # -- one pass -----------------------------------------------------------------------------
    def run(
        self,
        pos: Position,
        members: list[PassMember],
        kind: Kind,
        io: StageIO,
        cohort: int = -1,
        next_mb: int | None = None,
        deferred: tuple[tuple[int, int], ...] = (),
    ) -> TokenReturn | None:
        """Run this stage's layers for one pass of ``members`` (each microbatch at its own step; rows of
        ``io`` are the members' computed rows in order) and hand the result on.

        A DECODE pass batches every member (iteration-level batching: each attends over its own cache
        and length) and computes only each member's unfinished rows; a PREFILL pass has one member and
        computes all its rows, positions ``[0, cur_len)`` of its step: step 0 is its prompt, a later step
        *recomputes* a microbatch whose KV was discarded (its prompt and the tokens of every step before, so
        each stage forgets what it holds of it and rewrites it all; only the member's ``rows`` are sampled).
        ``next_mb`` is the microbatch stage 0 expects to run next: with swapping, its cache is prefetched
        while this pass computes. ``deferred``: (microbatch, step) of members an earlier stage took out of
        the pass to be recomputed, handed on to the last stage, which returns them to stage 0. Returns the pass's
        :class:`TokenReturn` on the last stage (also sent to stage 0 when this is not stage 0).
        """
        started = time.perf_counter()
        if kind is Kind.PREFILL:
            if len(members) != 1:
                raise ValueError("a prefill pass runs one microbatch")
            geometries = [members[0].state.geometry(members[0].step)]  # every row: the tokens come for all
            if members[0].step > 0:  # a recompute: whatever this stage holds of it is rewritten
                members[0].state.discard()
        else:
            geometries = [m.state.geometry(m.step).only(m.rows) for m in members]
            for m in members:
                if m.state.status is KVStatus.DISCARDED:
                    raise ValueError(f"microbatch {m.state.mb_id} was discarded here: it must be recomputed first")
        self._begin_pass(members)
        # Blocks for every position the pass writes (a paged prefill's too, so a short pool preempts first);
        # a swapped prefill reads nothing back in.
        prefill_from = 0 if self.swap is not None else 1
        caches = [
            self._acquire(m.state, g.cur_len - (prefill_from if kind is Kind.PREFILL else 1), m.rows)
            for m, g in zip(members, geometries, strict=True)
        ]
        if next_mb is not None:
            self.prefetch(next_mb)
        # A prompt whose log probabilities a row asks for is computed with logits at every position (on every
        # stage: an earlier stage then does not pack the prompts, which would leave only the last position's).
        all_logits = kind is Kind.PREFILL and members[0].step == 0 and wants_prompt_logprobs(members[0].state.spec)
        if kind is Kind.PREFILL:
            out = self.stage.prefill(io, caches[0], geometries[0], all_logits=all_logits)
        else:
            out = self.stage.decode_groups(io, list(zip(caches, geometries, strict=True)))
        self._commit(
            [
                (m.state, m.step, (0, g.cur_len) if kind is Kind.PREFILL else (g.cur_len - 1, g.cur_len))
                for m, g in zip(members, geometries, strict=True)
            ]
        )
        steps = tuple((state.mb_id, step, rows) for state, step, rows in members)
        if not self.stage.is_last:
            assert pos.next_peer is not None and out.hidden is not None
            msg = StageMessage(kind, cohort, 0, out.hidden, members=steps, deferred=deferred, next_mb=next_mb)
            self.endpoint.send(pos.next_peer, Channel.ACTIVATION, msg.encode())
            self._observe_pass(kind, members, geometries, started)
            return None
        assert out.logits is not None
        logits = out.logits
        if kind is Kind.PREFILL and len(members[0].rows) != geometries[0].batch:
            logits = logits[list(members[0].rows)]  # a recompute samples the rows still running only
        ret = self._publish(pos, members, logits, cohort, deferred)
        self._observe_pass(kind, members, geometries, started)
        return ret

    def _observe_pass(
        self, kind: Kind, members: list[PassMember], geometries: list[BatchGeometry], started: float
    ) -> None:
        """Record a pass that began at ``started`` (``time.perf_counter``): its kind, duration and tokens."""
        if kind is Kind.PREFILL:
            pass_kind = PassKind.RECOMPUTE if members[0].step > 0 else PassKind.PREFILL
            tokens = prompt_tokens(geometries[0])
        else:
            pass_kind, tokens = PassKind.DECODE, sum(len(m.rows) for m in members)
        self.metrics.observe_pass(pass_kind, time.perf_counter() - started, tokens)

    def follow(self, pos: Position, msg: StageMessage) -> None:
        """Run one pass of a cohort that arrived from the previous stage. A member whose prompt KV never
        completes (or whose spec is gone) is failed on its own and leaves the pass; one whose KV this stage
        discarded to make room leaves it too, *deferred* (the last stage hands it back to stage 0, which
        recomputes it); the others run."""
        assert msg.tensor is not None
        members, failed, kept, row = [], [], [], 0
        deferred = list(msg.deferred)
        for mb, step, rows in msg.members:
            first, row = row, row + len(rows)
            try:
                state = self.state(mb)
                if msg.kind is Kind.PREFILL:
                    state.mark_complete(0)
                else:
                    state.wait_complete(self.deadline_s)
                    if state.status is KVStatus.DISCARDED:
                        deferred.append((mb, step))
                        continue
                    self.replicate_prompt(state)
                members.append(PassMember(state, step, rows))
                # A prefill's one member may come packed (a ragged prefill: one row of every prompt's tokens).
                kept.append(msg.tensor if msg.kind is Kind.PREFILL else msg.tensor[first:row])
            except STEP_FAILURES as exc:
                self.fail(mb, step, exc)
                failed.append(Returned(mb, step, (), True))
        if not members:  # this ends the pass
            back = failed + [Returned(mb, step, (), False, None, recompute=True) for mb, step in deferred]
            self.endpoint.send(pos.first_peer, Channel.TOKENS, TokenReturn(msg.mb_id, tuple(back)).encode())
            return
        if failed:  # stage 0 learns of these apart (cohort -1)
            self.endpoint.send(pos.first_peer, Channel.TOKENS, TokenReturn(-1, tuple(failed)).encode())
        hidden = kept[0] if len(kept) == 1 else torch.cat(kept)
        self.run(
            pos,
            members,
            msg.kind,
            StageIO(hidden=hidden),
            msg.mb_id,
            next_mb=msg.next_mb,
            deferred=tuple(deferred),
        )

    def run_mixed(
        self, pos: Position, members: list[PassMember], io: StageIO, prefill: PassMember, prompts: StageIO, cohort: int
    ) -> TokenReturn:
        """One pass of a one-stage pipeline (:attr:`mixes`) that runs a decode step of ``members`` (as a DECODE
        pass: ``io`` holds their computed rows' tokens) and the prefill of ``prefill`` (a microbatch at step
        0, every row; ``prompts`` its left-padded prompt ids) together (:meth:`Stage.mixed`): the decoding
        rows get their next token in the pass that prefills, instead of waiting for it. Raises
        :class:`PrefillRefused` (nothing ran) when the prompt's blocks cannot be had, and what a DECODE pass
        raises otherwise."""
        started = time.perf_counter()
        if not self.mixes or pos.depth != 1:
            raise ValueError("mixed passes run on a one-stage pipeline over a paged pool with native kernels")
        geometries = [m.state.geometry(m.step).only(m.rows) for m in members]
        prompt_geometry = prefill.state.geometry(0).only(prefill.rows)
        self._begin_pass([*members, prefill])
        try:  # every prompt position's blocks first: a prompt that cannot have them fails alone
            prompt_cache = self._acquire(prefill.state, prompt_geometry.cur_len - 1, prefill.rows)
        except STEP_FAILURES as exc:
            raise PrefillRefused(prefill.state.mb_id, exc) from exc
        caches = [self._acquire(m.state, g.cur_len - 1, m.rows) for m, g in zip(members, geometries, strict=True)]
        assert isinstance(prompt_cache, PagedKVCache) and all(isinstance(c, PagedKVCache) for c in caches)
        groups = list(zip(caches, geometries, strict=True))
        out = self.stage.mixed(io, groups, (prompts, prompt_cache, prompt_geometry))  # type: ignore[arg-type]
        written = [(m.state, m.step, (g.cur_len - 1, g.cur_len)) for m, g in zip(members, geometries, strict=True)]
        self._commit([*written, (prefill.state, 0, (0, prompt_geometry.cur_len))])
        assert out.logits is not None
        ret = self._publish(pos, [*members, prefill], out.logits, cohort)
        tokens = sum(len(m.rows) for m in members) + prompt_tokens(prompt_geometry)
        self.metrics.observe_pass(PassKind.MIXED, time.perf_counter() - started, tokens)
        return ret

    def _begin_pass(self, members: list[PassMember]) -> None:
        """Mark ``members`` as the pass being set up (preemption leaves them) and as the most recently computed."""
        self._passes += 1
        self._in_pass = {m.state.mb_id for m in members}
        for m in members:
            m.state.last_pass = self._passes

    def _commit(self, written: list[tuple[MicrobatchState, int, tuple[int, int]]]) -> None:
        """After a pass: each ``(state, step, positions)`` holds ``step`` now; with swapping its new positions go
        back to host memory, and they are replicated to the successor."""
        for state, step, positions in written:
            if self.swap is not None:
                self.swap.commit(state.mb_id, positions)  # only the new positions go back to host memory
            state.done_step = step
        if self.replicas is not None:
            self.replicas.send_pass(written)

    def _publish(
        self,
        pos: Position,
        members: list[PassMember],
        logits: torch.Tensor,
        cohort: int,
        deferred: tuple[tuple[int, int], ...] = (),
    ) -> TokenReturn:
        """The last stage's end of a pass: sample each member's rows from ``logits`` (its rows in order), publish
        the tokens on the members' token streams, and return them (to stage 0, when this is not stage 0), with
        the ``deferred`` members to recompute."""
        # Two Redis round trips per pass, whatever the number of members: cancellations, then tokens.
        pipe = self.redis.pipeline(transaction=False)
        for m in members:
            pipe.smembers(keys.microbatch_cancel(m.state.mb_id))
        cancels = pipe.execute()
        returned, entries, row = [], [], 0
        for (state, step, rows), cancelled in zip(members, cancels, strict=True):
            n = len(rows)
            prompt = None  # a prefill's logits at every prompt position, when a row asks for their log probabilities
            if step == 0 and wants_prompt_logprobs(state.spec) and logits.shape[1] == state.spec.prompt_len:
                prompt = logits[row : row + n]
            entry = self._sample(state, step, logits[row : row + n, -1], {int(x) for x in cancelled}, rows, prompt)
            entries.append(entry)
            row += n
            feed = tuple(t if t >= 0 else 0 for t in entry.tokens)
            tracker = state.tracker
            assert tracker is not None
            returned.append(Returned(state.mb_id, step, feed, tracker.done, tuple(tracker.active_rows)))
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            pipe.xadd(keys.tokens(entry.mb_id), token_entry(self.signer, keys.tokens(entry.mb_id), entry.encode()))
        pipe.execute()
        returned += [Returned(mb, step, (), False, None, recompute=True) for mb, step in deferred]
        ret = TokenReturn(cohort, tuple(returned))
        if not pos.is_first:
            self.endpoint.send(pos.first_peer, Channel.TOKENS, ret.encode())
        return ret

    def _acquire(self, state: MicrobatchState, filled: int, rows: tuple[int, ...] = ()) -> KVCache | PagedKVCache:
        """The cache to compute on: the device buffer holding ``state`` (swapping) or its own cache. A paged
        cache first returns the blocks of its rows that finished (every row not in ``rows``) to the pool,
        then takes the blocks the pass writes (moving its host copy back if it was preempted); when the pool
        is full, microbatches not in this pass are preempted to host memory to make room. The replica of
        the predecessor's cache kept here returns its finished rows' blocks too."""
        if rows and self.held_replicas is not None:
            self.held_replicas.retire_rows(state.mb_id, rows)
        if self.swap is None:
            cache = state.cache
            if isinstance(cache, PagedKVCache):
                if rows:
                    done = [r for r, live in enumerate(cache.live) if live and r not in rows]
                    if done:
                        cache.free_rows(done)
                for attempt in range(3):  # prompt KV placed meanwhile may take the blocks made free first
                    try:
                        state.ensure_capacity(filled + 1)
                        break
                    except PoolExhausted:
                        if attempt == 2:
                            raise  # nothing left to move out: this microbatch fails, not the stage
                        self._make_room(cache.blocks_needed(filled + 1), keep=state.mb_id)
                return state.cache
            state.ensure_capacity(filled + 1)
            return state.cache
        if self.swap.state(state.mb_id) is SwapState.HOST:  # not prefetched (a missed hint)
            self.swap.make_room(keep=state.mb_id)
            self.swap.prefetch(state.mb_id, filled)
        end = time.monotonic() + self.deadline_s
        while True:
            try:
                return self.swap.acquire(state.mb_id, 0.05)
            except DeadlineExceeded:
                if time.monotonic() > end:
                    raise
                self.swap.make_room(keep=state.mb_id)  # stale guesses must not starve this swap-in

    def evictable_blocks(self, exclude: set[int]) -> int:
        """Blocks held by microbatches that could be preempted to make room (READY, not in ``exclude``)."""
        with self._lock:
            states = [st for mb, st in self.states.items() if mb not in exclude and st.status is KVStatus.READY]
        return sum(st.cache.blocks_held for st in states if isinstance(st.cache, PagedKVCache))

    def blocks_to_run(self, state: MicrobatchState, step: int) -> int:
        """Blocks a pass producing ``step`` of ``state`` takes (all of them for a preempted cache)."""
        if not isinstance(state.cache, PagedKVCache):
            return 0
        return state.cache.blocks_needed(state.geometry(step).cur_len)

    def host_held(self) -> int:
        """Bytes of the host copies of the caches preempted out of the pool."""
        with self._lock:
            states = [st for st in self.states.values() if st.status is KVStatus.PREEMPTED]
        return sum(st.cache.nbytes for st in states)

    def _make_room(self, blocks: int, keep: int) -> None:
        """Preempt: move the caches of microbatches not in the pass being set up to host memory, least
        recently computed first, until ``blocks`` blocks are free (they come back when next computed). Past
        :attr:`host_budget` (stage 0), forget them instead: the driver recomputes each before its next step."""
        assert self.pool is not None
        with self._lock:
            candidates = [
                st
                for mb, st in self.states.items()
                if mb != keep and mb not in self._in_pass and st.status is KVStatus.READY
            ]  # fmt: skip
        for st in sorted(candidates, key=lambda st: st.last_pass):
            if self.pool.free_blocks >= blocks:
                break
            if self.host_budget is not None and self.host_held() + st.cache.nbytes > self.host_budget:
                freed = st.discard()
                if freed:
                    self.metrics.count_preemption(Preemption.RECOMPUTE)
                    log.info("KV pool full and host memory short: microbatch %d discarded (%d blocks), to be "
                             "recomputed", st.mb_id, freed)  # fmt: skip
                continue
            freed = st.preempt()
            if freed:
                self.metrics.count_preemption(Preemption.SWAP)
                log.info("KV pool full: microbatch %d moved to host memory (%d blocks)", st.mb_id, freed)

    def prefetch(self, mb_id: int) -> None:
        """Start swapping ``mb_id``'s cache in (swapping only; a no-op when it is not resident here yet)."""
        if self.swap is None:
            return
        with self._lock:
            st = self.states.get(mb_id)
        if st is None or not st.complete.is_set():
            return
        if self.swap.state(mb_id) is SwapState.HOST and self.swap.free_slots() > 0:
            self.swap.prefetch(mb_id, st.spec.prompt_len + max(st.done_step, 0))

    def replicate_prompt(self, state: MicrobatchState) -> None:
        """Ship the prompt part of ``state`` to the successor once (disaggregated mode)."""
        if self.replicas is not None and not state.prompt_replicated:
            self.replicas.send(state, 0, (0, state.spec.prompt_len))
            state.prompt_replicated = True

    def _sample(
        self,
        state: MicrobatchState,
        step: int,
        logits: torch.Tensor,
        cancelled: set[int],
        rows: tuple[int, ...],
        prompt: torch.Tensor | None = None,
    ) -> TokenStep:
        """Sample ``step``'s tokens of ``rows`` (``logits[i]`` is row ``rows[i]``'s) and track finishes
        (``cancelled``: rows the controller cancelled); the caller publishes the returned entry on the
        token stream. Each row's penalties see its prompt and the tokens it emitted before (the tracker's,
        rebuilt from the token stream after recovery). ``prompt``: the step-0 logits at every prompt
        position (``[len(rows), prompt_len, vocab]``), whose log probabilities the rows asking for them get."""
        spec = state.spec
        tracker = state.tracker
        if tracker is None:
            tracker = state.tracker = RowTracker(spec, self.stage.spec.eos_token_ids)
            tracker.replay(history(self.redis, spec.mb_id, before_step=step))
        params = [spec.rows[i].sampling for i in rows]
        contexts = None
        if not all(p.plain_greedy for p in params):
            contexts = [
                RowContext(spec.rows[i].prompt_ids, tracker.outputs[i], tracker.stops[i].stop_ids) for i in rows
            ]
        sampled = sample_rows(logits, params, [step] * len(rows), contexts)
        prompts = row_prompt_logprobs(spec, rows, prompt) if prompt is not None else ()
        refused = {r: s.refused for r, s in zip(rows, sampled, strict=True) if s.refused is not None}
        for r, reason in refused.items():
            log.info("row %d of microbatch %d refused: its grammar does not compile: %s", r, spec.mb_id, reason)
        tokens, logprobs = [s.token for s in sampled], [s.logprob for s in sampled]
        return tracker.step(step, tokens, cancelled, rows, logprobs, prompts, refused=refused)


def prompt_tokens(geometry: BatchGeometry) -> int:
    """Tokens a prefill over ``geometry`` computes: each of its rows' positions but the left padding."""
    return sum(geometry.cur_len - pad for pad in geometry.pad_lens)


def wants_prompt_logprobs(spec: MicrobatchSpec) -> bool:
    """Whether a row of ``spec`` asks for its prompt's log probabilities (its prefill computes every logit)."""
    return any(row.sampling.prompt_logprobs is not None for row in spec.rows)


def row_prompt_logprobs(
    spec: MicrobatchSpec, rows: tuple[int, ...], logits: torch.Tensor
) -> list[tuple[Logprob | None, ...] | None]:
    """Per row of ``rows``, its prompt's log probabilities where it asks for them (None elsewhere), from
    ``logits`` ``[len(rows), prompt_len, vocab]`` of the left-padded prompts."""
    out: list[tuple[Logprob | None, ...] | None] = []
    for i, r in enumerate(rows):
        row = spec.rows[r]
        top = row.sampling.prompt_logprobs
        ids = row.prompt_ids
        out.append(None if top is None else prompt_logprobs(logits[i, spec.prompt_len - len(ids) :], ids, top))
    return out


def history(client: redis.Redis, mb_id: int, before_step: int) -> list[TokenStep]:
    """The published entries of ``mb_id`` with step < ``before_step``, one per step in order (partial
    entries of one step — step 0 arrives per prompt piece — and re-executed duplicates are merged)."""
    seen: dict[int, TokenStep] = {}
    for entry_id, fields in client.xrange(keys.tokens(mb_id)):
        try:
            entry = TokenStep.decode(fields[b"step"])
        except (KeyError, ValueError) as exc:  # any worker may append to a stream: one bad entry is skipped
            log.error("skipping malformed entry %r of microbatch %d's token stream: %s", entry_id, mb_id, exc)
            continue
        if entry.mb_id != mb_id or len(entry.finished) != len(entry.tokens):
            log.error("skipping entry %r of microbatch %d's token stream: not one of its steps", entry_id, mb_id)
            continue
        if entry.step < before_step:
            prev = seen.get(entry.step)
            if prev is not None and len(prev.tokens) != len(entry.tokens):
                log.error("skipping entry %r of microbatch %d's token stream: its rows differ", entry_id, mb_id)
                continue
            seen[entry.step] = entry if prev is None else merge(prev, entry)
    return [seen[s] for s in sorted(seen)]


def merge(a: TokenStep, b: TokenStep) -> TokenStep:
    tokens = tuple(x if x >= 0 else y for x, y in zip(a.tokens, b.tokens, strict=True))
    finished = tuple(x if x is not None else y for x, y in zip(a.finished, b.finished, strict=True))
    return TokenStep(
        mb_id=a.mb_id,
        step=a.step,
        tokens=tokens,
        finished=finished,
        logprobs=_merged(a.logprobs, b.logprobs),
        prompt_logprobs=_merged(a.prompt_logprobs, b.prompt_logprobs),
    )


def _merged(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per row, ``a``'s value or else ``b``'s (either may be empty: no row of it had one)."""
    if not a or not b:
        return a or b
    return tuple(x if x is not None else y for x, y in zip(a, b, strict=True))

"""Prompts over a paged pool with a prefix cache: the prompt stages of a request-scheduled deployment.

Each request of a prompt task is a one-row microbatch. Prompt stage 0 keeps the book of the pipeline's pools
(:class:`PromptPlanner`, over :class:`~dejavu_common.sched.BlockBook`): for every request it finds the longest
prefix of whole blocks already computed (a system prompt, the history of a conversation), references those blocks,
takes fresh ones for the rest and plans the request's :class:`~dejavu_common.messages.PromptSlice` (positions
``[start, end)``, the table). The plan travels with the task, so every later stage writes the same block ids
(:class:`PagedPrompts` keeps no book); each stage computes only the uncached positions, attending over the cached
prefix in its own pool, and streams each layer's KV of the whole prompt, cached part included, to the token stages.
Once stage 0 has computed a task, the task's full blocks enter its cache and its references go back: a block
nobody references keeps its prefix until the pool needs it (least recently used first).

A later stage writes a block only when it computes the task that took it, so it remembers which task wrote each
block (``written``) and stage 0 names, for each cached block of a slice, the task that wrote it: a later stage
whose copy of a block is not that task's (it failed that task) refuses the task rather than read KV it never wrote.
Every change of topology starts every prompt stage's pool and book anew.

A task whose prompts pass ``controller.prompt_task_tokens`` runs in several passes (:func:`split_passes`): a long
prompt is computed in chunks, each chunk attending over the earlier ones in the pool, and each chunk's KV streams to
the token stages as its layers are done, so a pipeline of several prompt stages computes one long prompt's chunks
on all of them at once. The last stage samples a request's first token after its last chunk.

Requests that ask for their prompt's log probabilities are never looked up (the cached positions' logits are not
computed again), though their blocks are cached for others.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from dejavu_common.messages import PromptSlice
from dejavu_common.sched import BlockBook, OutOfBlocks
from dejavu_engine.geometry import LogitPicks, Slice
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavulib.layout import KVLayout
from dejavulib.paged import BlockPool, PagedKVCache


@dataclass(frozen=True)
class Prompt:
    """One request of a task as stage 0 plans it: its one-row microbatch, its prompt, and whether it may hit the
    prefix cache (not when it asks for its prompt's log probabilities)."""

    mb: int
    ids: Sequence[int]
    looks_up: bool = True


class PromptPlanner:
    """Prompt stage 0's book of the pipeline's pools: plans each task's slices and caches what it computed."""

    def __init__(self, book: BlockBook) -> None:
        self.book = book
        self._writers: dict[int, int] = {}  # block -> the task whose computation of it is cached

    def plan(self, task_id: int, prompts: Sequence[Prompt]) -> tuple[PromptSlice, ...]:
        """The slices of task ``task_id``'s ``prompts``, in order, their blocks referenced. Raises ValueError where
        the pool cannot hold the task (nothing stays referenced then)."""
        book, size = self.book, self.book.block_size
        slices: list[PromptSlice] = []
        try:
            for p in prompts:
                cached: list[int] = []
                if p.looks_up:
                    # Whole blocks only, and never the last position: the pass needs a token to compute.
                    cached = book.cached_prefix(book.hashes(p.ids), (len(p.ids) - 1) // size)
                    book.count_lookup(len(p.ids), len(cached) * size)
                book.attach(cached)
                try:
                    fresh = book.allocate(book.blocks_for(len(p.ids)) - len(cached))
                except OutOfBlocks:
                    book.release(cached)
                    raise
                writers = tuple(self._writers[b] for b in cached)
                slices.append(PromptSlice(mb=p.mb, start=len(cached) * size, end=len(p.ids), table=(*cached, *fresh),
                                          writers=writers))  # fmt: skip
        except OutOfBlocks as exc:
            self.abort(slices)
            raise ValueError(f"the prompt pool cannot hold task {task_id}'s {len(prompts)} prompts: {exc}") from exc
        return tuple(slices)

    def finish(self, task_id: int, slices: Sequence[PromptSlice], prompts: Sequence[Prompt]) -> None:
        """Task ``task_id`` was computed here: its full blocks enter the cache and its references go back."""
        book, size = self.book, self.book.block_size
        for s, p in zip(slices, prompts, strict=True):
            hashes = book.hashes(p.ids)  # one per full block
            for i in range(s.start // size, len(hashes)):
                book.commit(s.table[i], hashes[i])
                self._writers[s.table[i]] = task_id
        self.abort(slices)

    def abort(self, slices: Iterable[PromptSlice]) -> None:
        """Give back the references of ``slices`` (a task that failed: nothing of it is cached)."""
        for s in slices:
            self.book.release(s.table)


@dataclass(frozen=True)
class SliceLogits:
    """What the last prompt stage computed: the logits after each slice's last position (``last``, ``[slices,
    vocab]``) and, for the slices asked for, after each of its positions (``every[i]``, ``[length, vocab]``)."""

    last: torch.Tensor
    every: dict[int, torch.Tensor]


class PagedPrompts:
    """One prompt stage's paged pool: computes planned slices into the blocks they name (see the module)."""

    def __init__(self, stage: Stage, pool: BlockPool) -> None:
        self.stage = stage
        self.pool = pool
        self.written: dict[int, int] = {}  # block -> the task that last wrote it here
        self.reached: dict[int, int] = {}  # request -> the end of its last pass here (a prompt computed in chunks)

    def check(self, task_id: int, slices: Sequence[PromptSlice]) -> None:
        """Raises ValueError where what a slice reads before its ``start`` is not here: a cached prefix this stage did
        not write in the task that cached it, or a chunk before it this stage did not compute (see the module)."""
        size = self.pool.geometry.block_size
        for s in slices:
            if len(s.table) * size < s.end:
                raise ValueError(f"task {task_id}: request {s.mb}'s table does not hold positions up to {s.end}")
            if s.start != len(s.writers) * size:  # a later chunk: the earlier ones were computed here
                if self.reached.get(s.mb) != s.start:
                    raise ValueError(f"task {task_id}: request {s.mb}'s positions before {s.start} were not computed "
                                     "here")  # fmt: skip
                continue
            for block, writer in zip(s.table, s.writers, strict=False):
                if self.written.get(block) != writer:
                    raise ValueError(f"task {task_id}: request {s.mb}'s cached block {block} was not written here by "
                                     f"task {writer} (this stage failed that task)")  # fmt: skip

    def run(
        self,
        io: StageIO,
        slices: Sequence[PromptSlice],
        every: Collection[int] = (),
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor | SliceLogits:
        """Compute ``slices`` (their tokens back to back in ``io``: ids into stage 0, hidden states into the others):
        hidden states ``[1, tokens, hidden]`` from a stage that is not the last, else :class:`SliceLogits` (every
        position's of the slices whose indices are in ``every``)."""
        self.pool.ensure(b for s in slices for b in s.table[s.start // self.pool.geometry.block_size :])
        pieces = [Slice(s.table, s.start, s.end - s.start) for s in slices]
        if not self.stage.is_last:
            hidden = self.stage.forward_slices(io, self.pool, pieces, on_layer_done=on_layer_done).hidden
            assert hidden is not None  # a stage that is not the last returns hidden states
            return hidden
        picks = LogitPicks.of([p.length for p in pieces], every)
        out = self.stage.forward_slices(io, self.pool, pieces, on_layer_done=on_layer_done, logits_at=picks.at)
        assert out.logits is not None  # a last stage returns logits
        logits = out.logits[:, 0]
        last = logits[torch.tensor(picks.last, dtype=torch.long, device=logits.device)]
        return SliceLogits(last, {i: logits[a:b] for i, (a, b) in picks.spans.items()})

    def computed(self, task_id: int, slices: Iterable[PromptSlice]) -> None:
        """This stage computed a pass of task ``task_id``: the blocks it wrote are that task's."""
        size = self.pool.geometry.block_size
        for s in slices:
            for block in s.table[s.start // size : -(-s.end // size)]:
                self.written[block] = task_id
            self.reached[s.mb] = s.end

    def forget(self, mbs: Iterable[int]) -> None:
        """Requests ``mbs`` are done here (their task ended, or failed)."""
        for mb in mbs:
            self.reached.pop(mb, None)

    def view(self, s: PromptSlice) -> PagedKVCache:
        """Request ``s.mb``'s prompt KV on this stage up to ``s.end`` as a one-row cache (what DejaVuLib streams
        out)."""
        g = self.pool.geometry
        layout = KVLayout(g.layers, 1, g.kv_heads, len(s.table) * g.block_size, g.head_dim, g.dtype, g.first_layer)
        return PagedKVCache.view(self.pool, layout, s.table, s.end)


def input_ids(slices: Sequence[PromptSlice], prompts: Sequence[Prompt]) -> torch.Tensor:
    """Stage 0's input: each slice's uncached prompt tokens, back to back, ``[1, tokens]``."""
    ids: list[int] = []
    for s, p in zip(slices, prompts, strict=True):
        ids += p.ids[s.start : s.end]
    return torch.tensor(ids, dtype=torch.long).unsqueeze(0)


def split_passes(
    slices: Sequence[PromptSlice], tokens: int, block_size: int, whole: Collection[int] = ()
) -> list[tuple[PromptSlice, ...]]:
    """A task's planned ``slices`` as passes of at most ``tokens`` computed positions each, in order: a slice that does
    not fit what is left of a pass is split, its first part closing the pass, the rest in the next (its later parts
    without ``writers``: they read the earlier ones). The slices whose indices are in ``whole`` (they need every
    position's logits in one pass) are never split; one longer than ``tokens`` is a pass of its own."""
    if tokens < 1:
        raise ValueError(f"a prompt pass computes >= 1 position, not {tokens}")
    passes: list[tuple[PromptSlice, ...]] = []
    current: list[PromptSlice] = []
    room = tokens
    for i, s in enumerate(slices):
        start, writers = s.start, s.writers
        while start < s.end:
            left = s.end - start
            if current and (room == 0 or (i in whole and left > room)):
                passes.append(tuple(current))
                current, room = [], tokens
            take = left if i in whole else min(left, room)
            end = start + take
            table = s.table[: -(-end // block_size)]
            current.append(PromptSlice(mb=s.mb, start=start, end=end, table=table, writers=writers))
            room = max(room - take, 0)
            start, writers = end, ()
    if current:
        passes.append(tuple(current))
    return passes

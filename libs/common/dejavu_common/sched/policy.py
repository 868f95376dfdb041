"""The one scheduling policy of a pipeline: which requests the next pass computes, and how many tokens of each.

Pure and torch-free: the pipeline's first stage runs it before every pass, and the planner's simulator runs the
very same object over simulated time. There are no phases and no microbatches: every request has one progress
counter (:attr:`RequestState.computed`) that chases its token ids, and each pass takes, under one token budget:

1. **running requests first**, in admission order: a decode (the one token sampled last) or the next chunk of a
   prompt. Decodes per pass are capped at ``ceil(max_running / depth)``, so the ``depth`` passes a pipeline keeps
   in flight stay balanced (a request is in at most one of them: it waits for its pass to return). A request whose
   next position needs a block the pool cannot give preempts the most recently admitted request not in flight
   (recompute preemption: its blocks go back, cached prefixes kept, and it is queued again at the head, so it
   resumes on hits and recomputes the rest);
2. **then waiting requests**, first come first served, while fewer than ``max_running`` hold blocks: each looks up
   its longest cached prefix (full blocks, at least one token left to compute), and only the rest counts against
   the budget. A request is admitted only if the pool can give its first chunk's blocks and still leave one block
   per running request for their next tokens (hits make admission look cheap).

A prompt longer than what is left of the budget is split into chunks (chunked prefill) that end on block
boundaries, so every chunk but a prompt's last fills whole blocks, and its blocks enter the prefix cache as soon
as the pass that wrote them returns. The last chunk of a prompt samples the first token.

**Sliding windows.** A scheduler made with a ``window`` serves stages whose every layer attends within that sliding
window (a query at ``i`` sees keys ``j`` with ``i - window < j <= i``: Mistral, Phi-3 with a window, Qwen2 with
every layer windowed). Once a request has computed ``c`` positions, no query still to come (at ``c`` or later)
reads a position before ``c - window + 1``, so every block wholly before it is given back as the request advances
(its reference dropped; a block in the prefix cache stays there, evictable as any free block), and its table entry
becomes :data:`FREED`; an admission on a prefix hit references only the hit blocks inside its first query's window.
A long generation then holds at most ``ceil(window / block_size) + 1`` blocks of its own, and a request is refused
as too long, and a pool sized (:func:`most_blocks`), by what it holds at once, not by its whole length. Where a
stage mixes windowed and global layers (Gemma 2/3, Qwen2 below ``max_window_layers``), one block table serves every
layer and the global ones read every position: such a pipeline's scheduler has no window and keeps every block.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dejavu_common.sched.blocks import FREED, BlockBook, OutOfBlocks
from dejavu_common.sched.state import RequestState, Status


class RequestTooLong(ValueError):
    """A request whose prompt and longest answer need more blocks than the whole pool has."""


def most_blocks(positions: int, block_size: int, window: int | None = None, chunk: int | None = None) -> int:
    """The most blocks of ``block_size`` positions that a request of ``positions`` positions holds at once: all of
    them, or under a sliding ``window`` (see the module's docstring) at most those of the window before a pass's
    first position and of the pass's ``chunk`` positions (its longest slice; None: its whole length), one more where
    they straddle a block boundary."""
    whole = -(-positions // block_size)
    if window is None:
        return whole
    span = window - 1 + (positions if chunk is None else chunk)
    return min(whole, -(-span // block_size) + 1)


@dataclass(frozen=True)
class Budget:
    """``tokens``: positions one pass computes at most; ``max_running``: requests holding blocks at once;
    ``depth``: passes in flight (the pipeline's stages); ``chunk``: the longest prompt chunk (default the budget)."""

    tokens: int
    max_running: int
    depth: int = 1
    chunk: int | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.max_running < 1 or self.depth < 1:
            raise ValueError(f"invalid budget {self}: tokens, max_running and depth must be >= 1")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"invalid budget {self}: chunk must be >= 1")

    @property
    def decodes_per_pass(self) -> int:
        return math.ceil(self.max_running / self.depth)


@dataclass(frozen=True)
class Slice:
    """What one pass computes of one request: positions ``[start, start + length)``, whose KV goes into ``table``
    (``new_blocks`` were added to it for this pass). ``samples``: the slice ends at the request's last known
    token, so the pass samples its next one."""

    request: RequestState
    start: int
    length: int
    table: tuple[int, ...]
    new_blocks: tuple[int, ...]
    samples: bool

    @property
    def decode(self) -> bool:
        return self.length == 1 and self.start >= self.request.prompt_len


@dataclass(frozen=True)
class ScheduledPass:
    slices: tuple[Slice, ...]
    preempted: tuple[RequestState, ...]

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.slices)

    def __bool__(self) -> bool:
        return bool(self.slices)


class Scheduler:
    """The queues and the book of one pipeline, and the policy over them (see the module's docstring). ``window``:
    the sliding window every layer of the pipeline's stages attends within (its blocks out of it are given back),
    None where a layer attends fully."""

    def __init__(self, book: BlockBook, budget: Budget, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a sliding window spans >= 1 position, got {window}")
        self.book = book
        self.budget = budget
        self.window = window
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # holding blocks (arriving or running), in admission order
        self._by_id: dict[str, RequestState] = {}

    # -- intake -----------------------------------------------------------------------------------
    def add(self, request: RequestState) -> None:
        """Queue a request whose prompt this pipeline computes. Raises :class:`RequestTooLong` for one whose
        longest answer the whole pool could not hold."""
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id} is already scheduled")
        self._check_fits(request)
        if request.status is not Status.WAITING:
            raise ValueError(f"request {request.request_id} is {request.status}, not waiting")
        self._by_id[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: RequestState) -> bool:
        """Disaggregated intake: take the blocks of a request whose prompt KV another pipeline computes and
        streams here (its cached prefix attached, the rest allocated), or False (nothing taken) when the pool
        or ``max_running`` has no room. :attr:`RequestState.cached_tokens` is then what need not be sent."""
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id} is already scheduled")
        self._check_fits(request, streamed=True)
        if len(self.running) >= self.budget.max_running:
            return False
        hits = self._lookup(request, len(request.token_ids))
        need = self.book.blocks_for(request.prompt_len + 1) - len(hits)
        live = hits[self._gone(len(hits) * self.book.block_size) :]
        if not self.book.can_allocate(need + self.book.idle(live) + self._headroom()):
            return False
        self.book.count_lookup(request.prompt_len, len(hits) * self.book.block_size)
        new = self._take(request, hits, need)
        request.table.extend(new)
        request.move(Status.ARRIVING)
        self._by_id[request.request_id] = request
        self.running.append(request)
        return True

    def arrived(self, request: RequestState, first_token: int) -> None:
        """Its prompt KV is all here and the prompt pipeline sampled ``first_token``: it decodes from now on. Its
        prompt blocks enter the prefix cache when its first pass returns (every stage holds their KV then)."""
        if request.status is not Status.ARRIVING:
            raise ValueError(f"request {request.request_id} is {request.status}, not arriving")
        request.computed = request.prompt_len
        request.token_ids.append(first_token)
        request.move(Status.RUNNING)

    def adopt(self, request: RequestState, table: Sequence[int], computed: int, more: int = 0) -> None:
        """A repair gave this book a pipeline whose requests other stages still hold: take ``request`` running in
        the blocks of ``table`` (the ids every other stage keeps its KV in; leading FREED entries are out of its
        window), its first ``computed`` positions written on every stage, and ``more`` fresh blocks after them
        (where a restore brings this stage more positions than the table holds). Raises :class:`RequestTooLong`
        for one the pool could never hold, ValueError for a table that cannot be its own (nothing taken then)."""
        if request.request_id in self._by_id or request.status is not Status.WAITING:
            raise ValueError(f"request {request.request_id} is already scheduled")
        self._check_fits(request)
        freed = next((i for i, b in enumerate(table) if b != FREED), len(table))
        if freed == len(table) or (len(table) + more) * self.book.block_size < computed or computed < 1:
            raise ValueError(f"request {request.request_id}: table {list(table)} does not hold {computed} positions")
        if not self.book.can_allocate(more):
            raise OutOfBlocks(f"request {request.request_id}: {more} more blocks, {self.book.free} free")
        self.book.adopt(table[freed:])
        request.table = [*table, *self.book.allocate(more)]
        request.freed = request.committed = freed
        request.computed = computed
        request.move(Status.RUNNING)
        self._by_id[request.request_id] = request
        self.running.append(request)

    def finish(self, request_id: str) -> RequestState | None:
        """End a request now (cancelled, failed, stopped): its blocks go back at once, or when its pass returns."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.move(Status.FINISHED)
        if not request.in_flight:
            self._free(request)
        return request

    def get(self, request_id: str) -> RequestState | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        return len(self._by_id)

    # -- the policy -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledPass:
        """The next pass; every request in it is in flight until :meth:`update` takes its results."""
        left = self.budget.tokens
        decodes = 0
        slices: list[Slice] = []
        preempted: list[RequestState] = []
        # Decodes before chunks of prompts (a stable sort keeps admission order within each).
        for request in sorted(self.running, key=lambda r: r.prefilling):
            if left <= 0:
                break
            if request.in_flight or request.status is not Status.RUNNING or request.pending <= 0:
                continue
            if not request.prefilling:
                if decodes >= self.budget.decodes_per_pass:
                    continue
                decodes += 1
            n = self._chunk(request, request.computed, left)
            need = self.book.blocks_for(request.computed + n) - len(request.table)
            while not self.book.can_allocate(need):
                victim = self._victim(exclude=request)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if not self.book.can_allocate(need):
                self._preempt(request)  # nothing else to take blocks from: it waits at the head instead
                preempted.append(request)
                continue
            slices.append(self._slice(request, request.computed, n, self.book.allocate(need)))
            left -= n
        computing = self._computing()
        for request in list(self.waiting):
            if left <= 0 or len(self.running) >= self.budget.max_running:
                break
            hits = self._lookup(request, len(request.token_ids))
            if self._computed_meanwhile(request, len(hits), computing):
                continue  # its next blocks are being computed for another request: it hits them next pass
            start = len(hits) * self.book.block_size
            n = self._chunk(request, start, left)
            need = self.book.blocks_for(start + n) - len(hits)
            live = hits[self._gone(start) :]  # the hits its first query's window reads: the ones it references
            if not self.book.can_allocate(need + self.book.idle(live) + self._headroom()):
                break
            self.waiting.remove(request)
            self.book.count_lookup(min(request.prompt_len, len(request.token_ids)), start)
            new = self._take(request, hits, need)
            request.computed = start
            request.move(Status.RUNNING)
            self.running.append(request)
            if computing is not None:
                computing.update(self._uncommitted(request))
            slices.append(self._slice(request, start, n, new))
            left -= n
        return ScheduledPass(tuple(slices), tuple(preempted))

    def update(
        self, done: ScheduledPass, sampled: Mapping[str, int], stopped: Iterable[str] = ()
    ) -> list[RequestState]:
        """The pass ``done`` returned: each slice's positions are written, ``sampled`` maps the requests whose
        slice sampled to their new token, ``stopped`` names requests that end with it (a stop token, a stop string,
        a cancellation). Returns the requests that finished (those and the ones at ``max_tokens``)."""
        stop = set(stopped)
        finished: list[RequestState] = []
        for s in done.slices:
            request = s.request
            request.in_flight = False
            if request.status is Status.FINISHED:  # ended while its pass ran: its blocks go back now
                self._free(request)
                continue
            request.computed = s.start + s.length
            self._commit(request)
            self._slide(request)
            wants = request.generated < request.max_tokens  # max_tokens 0: the prompt alone (its log probabilities)
            if s.samples and wants:
                token = sampled.get(request.request_id)
                if token is None:
                    raise ValueError(f"request {request.request_id}'s slice samples but no token came back")
                request.token_ids.append(token)
            if request.request_id in stop or (s.samples and request.generated >= request.max_tokens):
                self.finish(request.request_id)
                finished.append(request)
        return finished

    def abandon(self, broken: ScheduledPass) -> None:
        """The pass ``broken`` will never return (an error stopped it on the way): its requests are no longer in
        flight, and the positions it was to write count as unwritten (a later pass computes them again); one that
        ended meanwhile returns its blocks now."""
        for s in broken.slices:
            request = s.request
            if not request.in_flight:
                continue
            request.in_flight = False
            if request.status is Status.FINISHED:
                self._free(request)

    # -- helpers ----------------------------------------------------------------------------------
    def _check_fits(self, request: RequestState, streamed: bool = False) -> None:
        """Raises :class:`RequestTooLong` where the pool could never hold what ``request`` holds at once (with
        ``streamed``, its whole prompt and first token, all reserved before its prompt KV streams in)."""
        longest = request.prompt_len + request.max_tokens
        chunk = min(self.budget.tokens, self.budget.chunk or self.budget.tokens)
        held = most_blocks(longest, self.book.block_size, self.window, chunk)
        if streamed:
            held = max(held, self.book.blocks_for(request.prompt_len + 1))
        if held > self.book.num_blocks:
            window = "" if self.window is None else f" ({held} blocks at once under its sliding window)"
            raise RequestTooLong(
                f"request {request.request_id} may need {longest} positions{window}; the KV pool holds "
                f"{self.book.num_blocks * self.book.block_size}"
            )

    def _chunk(self, request: RequestState, start: int, left: int) -> int:
        """Positions from ``start`` the pass computes: all that are pending if they fit, else a chunk that ends on
        a block boundary (or, where no boundary is in reach, whatever fits)."""
        pending = len(request.token_ids) - start
        cap = min(left, self.budget.chunk or left)
        if pending <= cap:
            return pending
        end = (start + cap) // self.book.block_size * self.book.block_size
        return end - start if end > start else cap

    def _slice(self, request: RequestState, start: int, n: int, new: list[int]) -> Slice:
        request.table.extend(new)
        request.in_flight = True
        samples = start + n == len(request.token_ids)
        return Slice(request, start, n, tuple(request.table), tuple(new), samples)

    def _lookup(self, request: RequestState, known: int) -> list[int]:
        """The cached blocks of ``request``'s leading full blocks, leaving at least one position to compute (the
        caller counts the lookup in the book's figures once the request is admitted)."""
        most = (known - 1) // self.book.block_size
        return self.book.cached_prefix(request.block_hashes(self.book, most), most)

    def _computing(self) -> set[bytes] | None:
        """The hashes of the full blocks running requests are computing and have not committed yet (prompts, and
        recomputes after a preemption): blocks a waiting request with the same prefix would otherwise compute twice."""
        if not self.book.caching:
            return None
        out: set[bytes] = set()
        for r in self.running:
            if r.status is Status.RUNNING:
                out.update(self._uncommitted(r))
        return out

    def _uncommitted(self, request: RequestState) -> list[bytes]:
        """The hashes of ``request``'s full blocks not committed yet (none once only its last token is pending)."""
        if not request.prefilling:
            return []
        full = len(request.token_ids) // self.book.block_size
        return request.block_hashes(self.book, full)[request.committed :]

    def _computed_meanwhile(self, request: RequestState, hits: int, computing: set[bytes] | None) -> bool:
        """Whether ``request``'s first block past its ``hits`` cached ones is a full block that a running request is
        computing now (n > 1 choices of one prompt, or a burst sharing a system prompt): it waits for that block to be
        committed and then reads it, instead of computing it a second time beside the other."""
        if not computing or (hits + 1) * self.book.block_size >= len(request.token_ids):
            return False  # nothing computing, or its next block is its last (never shared): it computes that anyway
        return request.block_hashes(self.book, hits + 1)[hits] in computing

    def _take(self, request: RequestState, hits: list[int], need: int) -> list[int]:
        """Reference ``request``'s hits (those inside its first query's window; the others are FREED entries of its
        table from the start) and allocate ``need`` fresh blocks; returns those."""
        gone = self._gone(len(hits) * self.book.block_size)
        self.book.attach(hits[gone:])
        new = self.book.allocate(need)
        request.table = [FREED] * gone + hits[gone:]
        request.freed = gone
        request.committed = len(hits)
        request.cached_tokens = len(hits) * self.book.block_size
        return new

    def _gone(self, computed: int) -> int:
        """How many leading blocks no query at position ``computed`` or later reads (its window starts at
        ``computed - window + 1``): none without a window."""
        if self.window is None:
            return 0
        return max(0, (computed - self.window + 1) // self.book.block_size)

    def _slide(self, request: RequestState) -> None:
        """Give back the blocks of ``request`` that fell out of the window (committed ones stay in the cache)."""
        gone = min(self._gone(request.computed), request.committed, len(request.table))
        if gone <= request.freed:
            return
        self.book.release(request.table[request.freed : gone])
        request.table[request.freed : gone] = [FREED] * (gone - request.freed)
        request.freed = gone

    def _headroom(self) -> int:
        """Blocks kept free for the running requests' next positions (one each) when admitting another."""
        return sum(1 for r in self.running if r.status is Status.RUNNING)

    def _victim(self, exclude: RequestState) -> RequestState | None:
        for request in reversed(self.running):
            if request is not exclude and not request.in_flight and request.status is Status.RUNNING:
                return request
        return None

    def _preempt(self, request: RequestState) -> None:
        self.running.remove(request)
        self._free(request)
        request.computed = 0
        request.preemptions += 1
        request.move(Status.PREEMPTED)
        self.waiting.appendleft(request)

    def _free(self, request: RequestState) -> None:
        self.book.release(request.table[request.freed :])
        request.table = []
        request.committed = 0
        request.freed = 0

    def _commit(self, request: RequestState) -> None:
        """Enter the request's blocks that its written positions fill into the prefix cache."""
        full = request.computed // self.book.block_size
        if full <= request.committed:
            return
        hashes = request.block_hashes(self.book, full)
        for i in range(request.committed, full):
            self.book.commit(request.table[i], hashes[i])
        request.committed = full

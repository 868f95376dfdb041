"""One request as a pipeline schedules it: its token ids, its one progress counter, its block table.

A request owns its state: :class:`RequestState` moves between the :class:`Status` values by
:meth:`RequestState.move` only, along the legal transitions in ``_NEXT``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dejavu_common.sched.blocks import BlockBook, chain_hashes


class Status(enum.StrEnum):
    WAITING = "waiting"  # queued; holds no blocks
    ARRIVING = "arriving"  # its blocks are reserved and its prompt KV streams in from a prompt pipeline
    RUNNING = "running"  # holds blocks; scheduled pass after pass until it finishes
    PREEMPTED = "preempted"  # its blocks were taken back: queued again at the head, recomputed from its tokens
    FINISHED = "finished"


_NEXT: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.ARRIVING, Status.RUNNING, Status.FINISHED}),
    Status.ARRIVING: frozenset({Status.RUNNING, Status.FINISHED}),
    Status.RUNNING: frozenset({Status.PREEMPTED, Status.FINISHED}),
    Status.PREEMPTED: frozenset({Status.RUNNING, Status.FINISHED}),
    Status.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(eq=False)
class RequestState:
    """``token_ids`` are the prompt and then every sampled token; ``computed`` counts the leading positions whose
    KV is written (on every stage). The tokens from ``computed`` on are what the next pass computes: a prompt's
    rest (prefill, whole or a chunk), or the one token sampled last (decode)."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    max_tokens: int
    extra_key: bytes = b""  # a cache salt or adapter: part of every block hash of this request
    computed: int = 0
    table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    in_flight: bool = False  # in a pass that has not returned: not scheduled again until it does
    committed: int = 0  # leading full blocks entered into the prefix cache
    freed: int = 0  # leading table entries given back out of a sliding window (FREED), never more than committed
    cached_tokens: int = 0  # prompt positions found cached when it was last admitted
    preemptions: int = 0
    _hashes: list[bytes] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_len <= len(self.token_ids):
            raise ValueError(f"request {self.request_id}: prompt_len {self.prompt_len} of {len(self.token_ids)} ids")
        if self.max_tokens < 0:
            raise ValueError(f"request {self.request_id}: max_tokens {self.max_tokens} < 0")

    @property
    def pending(self) -> int:
        """Positions the next pass of this request computes at most: those past ``computed``."""
        return len(self.token_ids) - self.computed

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        """Whether more than its last sampled token is left to compute (a prompt, or a recompute after preemption)."""
        return self.pending > 1

    def move(self, status: Status) -> None:
        if status not in _NEXT[self.status]:
            raise IllegalTransition(f"request {self.request_id}: {self.status} -> {status}")
        self.status = status

    def block_hashes(self, book: BlockBook, full_blocks: int) -> list[bytes]:
        """The hashes of its first ``full_blocks`` blocks (every one full of known token ids), chained and kept."""
        have = len(self._hashes)
        if full_blocks > have:
            bs = book.block_size
            if full_blocks * bs > len(self.token_ids):
                raise ValueError(f"request {self.request_id}: block {full_blocks - 1} is not full")
            seed = self._hashes[-1] if have else book.seed(self.extra_key)
            self._hashes += chain_hashes(self.token_ids[have * bs : full_blocks * bs], bs, seed)
        return self._hashes[:full_blocks]

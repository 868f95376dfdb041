"""Where a pass's tokens sit in the KV cache.

:class:`BatchGeometry` is a left-padded microbatch's: all its rows share one cache position per step (left
padding aligns their ends), so two numbers per microbatch describe everything a forward pass needs: the pad
length of each row and how many cache positions are filled. A worker rebuilds the geometry from a message.

:class:`Slice` is one request's share of a pass over a paged pool: its own positions (no padding) and its own
block table, so requests of any lengths, at any stage of their prompt or generation, share a pass.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from dejavu_common.sched import FREED


@dataclass(frozen=True)
class BatchGeometry:
    """Left padding and fill level of one microbatch's cache.

    ``pad_lens[r]`` pad slots precede row ``r``'s tokens; ``cur_len`` is the number of filled cache
    positions once the forward pass that receives this geometry has written its new tokens. A pass
    feeding ``n`` tokens per row writes positions ``[cur_len - n, cur_len)``.

    ``rows`` names the cache rows the geometry's rows are, when a decode pass computes only some rows
    of the microbatch (the others finished): row ``r`` of the pass is cache row ``rows[r]``. None:
    every cache row, in order.
    """

    pad_lens: tuple[int, ...]
    cur_len: int
    rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.pad_lens:
            raise ValueError("BatchGeometry needs at least one row")
        if self.cur_len <= 0 or any(not 0 <= p < self.cur_len for p in self.pad_lens):
            raise ValueError(f"pad lengths {self.pad_lens} must lie in [0, cur_len={self.cur_len})")
        if self.rows is not None and (
            len(self.rows) != len(self.pad_lens)
            or any(b <= a for a, b in zip(self.rows, self.rows[1:], strict=False))
            or self.rows[0] < 0
        ):
            raise ValueError(f"rows {self.rows} must be {len(self.pad_lens)} increasing cache rows")

    @classmethod
    def for_prompts(cls, prompt_lens: Sequence[int]) -> BatchGeometry:
        """Geometry after prefilling prompts of these lengths, left-padded to the longest one."""
        if not prompt_lens or min(prompt_lens) <= 0:
            raise ValueError(f"every prompt needs at least one token, got lengths {list(prompt_lens)}")
        longest = max(prompt_lens)
        return cls(tuple(longest - n for n in prompt_lens), longest)

    @property
    def batch(self) -> int:
        return len(self.pad_lens)

    @property
    def cache_rows(self) -> tuple[int, ...]:
        """The cache row of each row of the pass."""
        return self.rows if self.rows is not None else tuple(range(len(self.pad_lens)))

    def only(self, rows: tuple[int, ...]) -> BatchGeometry:
        """This geometry (of every cache row) restricted to cache ``rows``; itself when that is every row."""
        if self.rows is not None:
            raise ValueError("only() restricts a geometry of every cache row")
        if tuple(rows) == tuple(range(len(self.pad_lens))):
            return self
        if not rows or not all(0 <= r < len(self.pad_lens) for r in rows):
            raise ValueError(f"rows {rows} not within the {len(self.pad_lens)} rows of the microbatch")
        return BatchGeometry(tuple(self.pad_lens[r] for r in rows), self.cur_len, tuple(rows))

    @property
    def padded(self) -> bool:
        return any(self.pad_lens)

    def advance(self, steps: int = 1) -> BatchGeometry:
        """Geometry of the next decode step (one more filled position per step)."""
        return BatchGeometry(self.pad_lens, self.cur_len + steps, self.rows)


@dataclass(frozen=True)
class Slice:
    """One request's share of a pass over a paged pool: ``length`` new tokens at positions ``[start, start +
    length)`` of the request's own sequence, no padding.

    ``table`` lists the pool blocks of the request's logical blocks in order (block ``i`` holds positions ``[i *
    block_size, (i + 1) * block_size)``) and covers ``[0, end)``: the pass writes the new tokens' K/V into them
    and each new token attends causally over positions ``[0, its own]`` of them: the cached prefix ``[0, start)``
    and the slice's tokens up to itself. One form covers a decode step (``length`` 1), a whole prompt
    (``start`` 0), a chunk of a prompt over its earlier chunks (chunked prefill) and a prompt after a prefix-cache
    hit (``start`` = the cached length).

    In a stage whose every layer attends within a sliding window, the table's leading ``freed`` entries may be
    :data:`~dejavu_common.sched.FREED`: blocks given back because no query of the slice (nor any later one) reads
    their positions. Attention reads the table from entry ``freed`` on (:meth:`Stage.check_slices` checks that the
    window needs nothing before it).
    """

    table: tuple[int, ...]
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 1:
            raise ValueError(f"a slice feeds >= 1 token from a position >= 0: start {self.start}, length {self.length}")
        freed = self.freed
        if any(b < 0 for b in self.table[freed:]) or (self.table and freed == len(self.table)):
            # Freed entries only lead a table, before the blocks the slice writes.
            raise ValueError(f"block ids are >= 0 (freed entries lead a table, never end it), got table {self.table}")

    @property
    def freed(self) -> int:
        """How many leading entries of the table are FREED (given back: never read)."""
        n = 0
        while n < len(self.table) and self.table[n] == FREED:
            n += 1
        return n

    @property
    def end(self) -> int:
        """One past the slice's last position: the request's length once the pass has run."""
        return self.start + self.length


@dataclass(frozen=True)
class LogitPicks:
    """Which logits a last stage computes for a pass of slices: the pass's token indices ``at`` (what
    :meth:`~dejavu_engine.stage.Stage.forward_slices` takes as ``logits_at``), per slice the index in ``at`` of its
    last position (``last``), and for the slices that want every position's, their range in ``at`` (``spans``)."""

    at: tuple[int, ...]
    last: tuple[int, ...]
    spans: dict[int, tuple[int, int]]

    @classmethod
    def of(cls, lengths: Sequence[int], every: Collection[int] = ()) -> LogitPicks:
        """For slices of ``lengths`` tokens back to back, every position's logits of the slices in ``every`` and
        the last position's of the others."""
        at: list[int] = []
        last: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        first = 0
        for i, n in enumerate(lengths):
            if i in every:
                spans[i] = (len(at), len(at) + n)
                at += range(first, first + n)
            else:
                at.append(first + n - 1)
            first += n
            last.append(len(at) - 1)
        return cls(tuple(at), tuple(last), spans)

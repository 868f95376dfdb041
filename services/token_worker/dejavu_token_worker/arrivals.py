"""Prompt KV arriving at a token stage of a request-scheduled pipeline from the prompt pipeline (disaggregated).

The prompt pipeline streams each layer's KV of a request's prompt to the token stage holding the layer as it is
computed, addressed by the request's id, layers and positions (DejaVuLib's headers), before token stage 0 has given
the request any block: which blocks it gets is decided when stage 0 admits it, once its prompt is done and its own
KV is here. So a stage keeps each arriving region as it came (its packed bytes) until the request's first pass names
its table, then writes them into those blocks in one go (:meth:`PromptArrivals.place`). A request's prompt KV is
complete on a stage when every layer of the stage holds positions ``[0, prompt_len)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import MicrobatchSpec
from dejavu_token_worker.executor import request_layout
from dejavulib.endpoint import Message
from dejavulib.layout import Region
from dejavulib.paged import BlockPool, PagedKVCache
from dejavulib.streaming import stream_in

log = logging.getLogger("dejavu.token_worker.arrivals")

_FORGOTTEN = 65_536  # requests forgotten as ended, remembered so a region still on its way does not revive one


@dataclass
class Arrival:
    """One request's prompt KV on this stage so far (its first region came at ``first_ns``, ``time.time_ns()``)."""

    spec: MicrobatchSpec
    first_ns: int = field(default_factory=time.time_ns)
    parts: list[tuple[Region, Message]] = field(default_factory=list)
    covered: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # layer -> position ranges

    def add(self, region: Region, message: Message) -> None:
        self.parts.append((region, message))
        for layer in range(*region.layers):
            self.covered.setdefault(layer, []).append(tuple(region.positions))

    @property
    def prompt_len(self) -> int:
        return self.spec.prompt_len

    def complete(self, layers: tuple[int, int]) -> bool:
        return all(_covers(self.covered.get(layer, []), self.prompt_len) for layer in range(*layers))

    @property
    def nbytes(self) -> int:
        return sum(m.payload.nbytes for _r, m in self.parts)


def _covers(ranges: Sequence[tuple[int, int]], end: int) -> bool:
    reach = 0
    for a, b in sorted(ranges):
        if a > reach:
            return False
        reach = max(reach, b)
    return reach >= end


class PromptArrivals:
    """The prompt KV regions that reached this stage (of global ``layers``), per request; thread-safe (the
    receiver adds while the compute thread places). ``spec_of(request)`` reads a request's spec, once per request;
    ``on_complete(arrival)`` runs when a request's prompt KV is first complete here (its trace's span)."""

    def __init__(
        self,
        layers: tuple[int, int],
        spec_of: Callable[[int], MicrobatchSpec],
        on_complete: Callable[[Arrival], None] = lambda arrival: None,
    ) -> None:
        self.layers = layers
        self.spec_of = spec_of
        self.on_complete = on_complete
        self._arrivals: dict[int, Arrival] = {}
        self._forgotten: dict[int, None] = {}
        self._changed = threading.Condition()

    def add(self, region: Region, message: Message) -> None:
        """Keep ``message`` (the packed KV of ``region``) for its request. Raises ValueError for a region outside
        this stage's layers or the request's prompt."""
        mb = region.microbatch
        if region.layers[0] < self.layers[0] or region.layers[1] > self.layers[1] or region.rows != (0, 1):
            raise ValueError(f"prompt KV of layers {region.layers}, rows {region.rows} is not this stage's")
        with self._changed:
            if mb in self._forgotten:
                return
            arrival = self._arrivals.get(mb)
        if arrival is None:
            arrival = Arrival(self.spec_of(mb))  # may read Redis: not under the lock
        if region.positions[1] > arrival.prompt_len:
            raise ValueError(f"prompt KV of positions {region.positions} past request {mb}'s prompt")
        with self._changed:
            if mb in self._forgotten:
                return
            arrival = self._arrivals.setdefault(mb, arrival)
            was = arrival.complete(self.layers)
            arrival.add(region, message)
            done = not was and arrival.complete(self.layers)
            self._changed.notify_all()
        if done:
            self.on_complete(arrival)

    def complete(self, mb: int) -> bool:
        with self._changed:
            arrival = self._arrivals.get(mb)
            return arrival is not None and arrival.complete(self.layers)

    def wait(self, mb: int, timeout_s: float, abandon: Callable[[], bool] = lambda: False) -> None:
        """Wait until request ``mb``'s prompt KV is complete here; :class:`DeadlineExceeded` after ``timeout_s`` or
        once ``abandon()`` is true."""
        end = time.monotonic() + timeout_s
        with self._changed:
            while True:
                arrival = self._arrivals.get(mb)
                if arrival is not None and arrival.complete(self.layers):
                    return
                left = end - time.monotonic()
                if left <= 0 or abandon():
                    raise DeadlineExceeded(f"the prompt KV of request {mb} is incomplete after {timeout_s:.0f} s")
                self._changed.wait(min(left, 0.05))

    def place(self, mb: int, pool: BlockPool, table: Sequence[int], cached: int = 0) -> int:
        """Write request ``mb``'s prompt KV into the blocks of ``table`` in ``pool`` and forget it here; returns the
        prompt's length. Its first ``cached`` positions (whole blocks found in the prefix cache, which other
        requests may be reading) are left as they are. Raises ValueError where it is not complete, or where a
        region does not fit its request (it fails alone)."""
        with self._changed:
            arrival = self._arrivals.pop(mb, None)
        if arrival is None or not arrival.complete(self.layers):
            raise ValueError(f"the prompt KV of request {mb} is not complete on this stage")
        g = pool.geometry
        if len(table) * g.block_size < arrival.prompt_len:
            raise ValueError(f"request {mb}'s table of {len(table)} blocks does not hold its prompt")
        pool.ensure(b for b in table if b >= 0)
        skip = cached // g.block_size
        targets = [-1] * skip + list(table[skip:])  # no block: nothing written there
        view = PagedKVCache.view(pool, request_layout(pool, len(table)), targets, arrival.prompt_len)
        for region, message in arrival.parts:
            if region.nbytes(view.layout) != message.payload.nbytes:
                raise ValueError(f"prompt KV of request {mb}: {message.payload.nbytes} bytes for region {region}")
            stream_in(view, message, region)
        return arrival.prompt_len

    def drop(self, mbs: Iterable[int], ended: bool = True) -> None:
        """Forget requests ``mbs`` (``ended``: for good, so a region of theirs still arriving is ignored)."""
        with self._changed:
            for mb in mbs:
                self._arrivals.pop(mb, None)
                if ended:
                    self._forgotten[mb] = None
            while len(self._forgotten) > _FORGOTTEN:
                del self._forgotten[next(iter(self._forgotten))]

    def keep(self, mbs: Iterable[int]) -> None:
        """Forget every request but ``mbs`` (a repair: the rest re-run their prompts, whose KV comes again)."""
        keep = set(mbs)
        with self._changed:
            self._arrivals = {mb: a for mb, a in self._arrivals.items() if mb in keep}
            self._forgotten.clear()

    def requests(self) -> set[int]:
        with self._changed:
            return set(self._arrivals)

    @property
    def nbytes(self) -> int:
        with self._changed:
            return sum(a.nbytes for a in self._arrivals.values())

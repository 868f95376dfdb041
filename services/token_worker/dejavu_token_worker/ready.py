"""Token stage 0's view of prompt microbatches the prompt pipeline has finished (the READY stream)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis
from pydantic import ValidationError

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, MicrobatchSpec, PromptDone
from dejavu_worker.microbatch import fetch_spec

log = logging.getLogger("dejavu.token_worker.ready")


@dataclass(frozen=True)
class ReadyMicrobatch:
    spec: MicrobatchSpec
    first_tokens: tuple[int, ...]
    finished: tuple[FinishReason | None, ...]

    @property
    def all_finished(self) -> bool:
        return all(f is not None for f in self.finished)


class ReadyPrompts:
    """Collects :class:`PromptDone` entries per token microbatch until every row has its first token.

    The cursor starts at the stream's end when created, so a restarted stage 0 does not replay
    microbatches the pipeline already handled (those resume through recovery instead).
    """

    def __init__(self, client: redis.Redis, deadline_s: float, abandon: Callable[[], bool] | None = None) -> None:
        self.redis = client
        self.deadline_s = deadline_s
        self.abandon = abandon  # stops a wait for a spec once a newer epoch exists
        last = client.xrevrange(keys.READY_QUEUE, count=1)
        self.cursor: bytes | str = last[0][0] if last else "0-0"
        self._partial: dict[int, tuple[MicrobatchSpec, list[int | None], list[FinishReason | None]]] = {}
        self._ready: collections.deque[ReadyMicrobatch] = collections.deque()
        self.ignored: set[int] = set()  # microbatches already admitted (a re-run prompt announces them again)

    def poll(self, block_ms: int | None = None) -> None:
        resp = self.redis.xread({keys.READY_QUEUE: self.cursor}, count=64, block=block_ms)
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                self.cursor = entry_id
                try:
                    self._add(PromptDone.decode(fields[b"done"]))
                except (KeyError, ValidationError, DeadlineExceeded) as exc:
                    log.error("dropped a ready entry: %s", exc)

    def _add(self, done: PromptDone) -> None:
        if done.mb_id in self.ignored:
            return
        if done.mb_id not in self._partial:
            spec = fetch_spec(self.redis, done.mb_id, self.deadline_s, self.abandon)
            n = len(spec.rows)
            self._partial[done.mb_id] = (spec, [None] * n, [None] * n)
        spec, first, finished = self._partial[done.mb_id]
        for i, r in enumerate(range(*done.dst_rows)):
            first[r] = done.tokens[i]
            finished[r] = done.finished[i]
        if all(t is not None for t in first):
            del self._partial[done.mb_id]
            self.ignored.add(done.mb_id)
            self._ready.append(ReadyMicrobatch(spec, tuple(max(t, 0) for t in first), tuple(finished)))

    def reset(self) -> None:
        """A fresh pipeline: microbatch ids start over, so nothing seen before counts."""
        self.ignored.clear()
        self._partial.clear()
        self._ready.clear()

    def forget(self, mb_ids: set[int]) -> None:
        """Microbatches that re-run their prompts: accept their announcements again."""
        self.ignored -= mb_ids
        for mb in mb_ids:
            self._partial.pop(mb, None)

    def pop(self, block_ms: int | None = None) -> ReadyMicrobatch | None:
        if not self._ready:
            self.poll(block_ms)
        return self._ready.popleft() if self._ready else None

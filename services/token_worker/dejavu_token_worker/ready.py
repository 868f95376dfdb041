"""Token stage 0's view of prompt microbatches the prompt pipeline has finished (the READY stream)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from dejavu_common import keys
from dejavu_common.messages import FinishReason, MicrobatchSpec, PromptDone, TokenStep
from dejavu_common.signing import EntrySigner, token_entry

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

    The cursor starts at the stream's end when created, and again when this worker takes stage 0 over
    (:meth:`start_over`), so a stage-0 holder never reads announcements made before it held the stage:
    their microbatches resume or re-run through recovery instead.

    Two kinds of announcement are stale, and dropped at once: one whose microbatch has no spec (the
    controller writes it before it queues the prompt, so the microbatch has ended: its id goes to
    :attr:`ended`, for the driver to free the prompt KV that may have reached the stages before the
    microbatch ended, as one whose rows all finish at their first token does), and one of an older
    epoch than this stage serves (its KV, sealed with that epoch, was dropped on arrival; the microbatch
    resumes, re-runs or has failed by the recovery or fresh start that began this epoch). Admitted, it
    would wait for KV that never comes, and the driver reads announcements between steps, so every
    microbatch of this stage would wait with it. One of a newer epoch is left for when this stage serves it.

    A microbatch announced in part and still not whole ``partial_deadline_s`` after its first announcement
    (the task of its other rows was lost, and its re-run too) fails: an error finish for each of its rows
    on its token stream (the controller fails their requests), then it is handed on with every row
    finished, so the driver frees it on every stage.
    """

    def __init__(
        self,
        client: redis.Redis,
        partial_deadline_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        signer: EntrySigner | None = None,
    ) -> None:
        self.redis = client
        self.signer = signer  # signs the token-stream entries it writes (dejavu_common.signing; None: unsigned)
        self.clock = clock  # of the partials' deadline
        self.epoch = 0  # the epoch this stage serves (``serving``)
        self.cursor: bytes | str = "0-0"
        self.partial_deadline_s = partial_deadline_s  # None: a partial waits as long as it takes
        self._partial: dict[int, tuple[MicrobatchSpec, list[int | None], list[FinishReason | None]]] = {}
        self._partial_since: dict[int, float] = {}  # clock() at each partial's first announcement
        self._ready: collections.deque[ReadyMicrobatch] = collections.deque()
        self.ignored: set[int] = set()  # microbatches already admitted (a re-run prompt announces them again)
        self.ended: collections.deque[int] = collections.deque()  # announced after they ended, to be freed
        self.start_over()

    def start_over(self) -> None:
        """Forget everything read so far and read only what is announced from now on."""
        last = self.redis.xrevrange(keys.READY_QUEUE, count=1)
        self.cursor = last[0][0] if last else "0-0"
        self.reset()

    def serving(self, epoch: int) -> None:
        """This stage serves ``epoch`` now."""
        self.epoch = epoch

    def poll(self, block_ms: int | None = None) -> None:
        self._expire_partials()
        resp = self.redis.xread({keys.READY_QUEUE: self.cursor}, count=64, block=block_ms)
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                try:
                    done = PromptDone.decode(fields[b"done"])
                except (KeyError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
                    log.error("dropped a ready entry: %s", exc)
                    self.cursor = entry_id
                    continue
                if done.epoch > self.epoch:
                    return  # read once this stage serves that epoch: the cursor stays before it
                if 0 < done.epoch < self.epoch:
                    log.warning("dropped the announcement of microbatch %d: of epoch %d, before this one (%d)",
                                done.mb_id, done.epoch, self.epoch)  # fmt: skip
                    self.cursor = entry_id
                    continue
                try:
                    self._add(done)  # a Redis error leaves the cursor before this entry: it is read again
                except ValueError as exc:
                    log.error("dropped a ready entry: %s", exc)
                self.cursor = entry_id

    def _expire_partials(self) -> None:
        """Fail each partial older than ``partial_deadline_s`` (see the class docstring)."""
        if self.partial_deadline_s is None:
            return
        now = self.clock()
        for mb, since in list(self._partial_since.items()):
            if now - since <= self.partial_deadline_s:
                continue
            spec, first, _ = self._partial[mb]
            missing = [r for r, t in enumerate(first) if t is None]
            log.error("microbatch %d: rows %s not announced %.0f s after its first rows: failing it",
                      mb, missing, now - since)  # fmt: skip
            n = len(spec.rows)
            failed = (FinishReason.ERROR,) * n
            if self.redis.exists(keys.microbatch(mb)):  # the controller still waits for it (a Redis error: retried)
                step = TokenStep(mb_id=mb, step=0, tokens=(-1,) * n, finished=failed)
                self.redis.xadd(keys.tokens(mb), token_entry(self.signer, keys.tokens(mb), step.encode()))
            del self._partial[mb], self._partial_since[mb]
            self.ignored.add(mb)
            self._ready.append(ReadyMicrobatch(spec, (0,) * n, failed))

    def _add(self, done: PromptDone) -> None:
        if done.mb_id in self.ignored:
            return
        if done.mb_id not in self._partial:
            raw = self.redis.get(keys.microbatch(done.mb_id))  # written before its prompt was queued: no wait
            if raw is None:
                log.warning("dropped the announcement of microbatch %d: it has ended (no spec)", done.mb_id)
                self.ignored.add(done.mb_id)
                self.ended.append(done.mb_id)
                return
            spec = MicrobatchSpec.decode(raw)
            n = len(spec.rows)
            self._partial[done.mb_id] = (spec, [None] * n, [None] * n)
            self._partial_since[done.mb_id] = self.clock()
        spec, first, finished = self._partial[done.mb_id]
        start, stop = done.dst_rows
        if not 0 <= start < stop <= len(first) or not len(done.tokens) == len(done.finished) == stop - start:
            raise ValueError(f"rows {done.dst_rows} with {len(done.tokens)} tokens do not fit microbatch {done.mb_id}")
        for i, r in enumerate(range(*done.dst_rows)):
            first[r] = done.tokens[i]
            finished[r] = done.finished[i]
        if all(t is not None for t in first):
            del self._partial[done.mb_id], self._partial_since[done.mb_id]
            self.ignored.add(done.mb_id)
            self._ready.append(ReadyMicrobatch(spec, tuple(max(t, 0) for t in first), tuple(finished)))

    def reset(self) -> None:
        """A fresh pipeline: microbatch ids start over, so nothing seen before counts (the controller
        deleted the stream, and new entries are numbered after the cursor)."""
        self.ignored.clear()
        self._partial.clear()
        self._partial_since.clear()
        self._ready.clear()
        self.ended.clear()

    def forget(self, mb_ids: set[int]) -> None:
        """Microbatches that re-run their prompts: accept their announcements again."""
        self.ignored -= mb_ids
        for mb in mb_ids:
            self._partial.pop(mb, None)
            self._partial_since.pop(mb, None)

    def pop(self, block_ms: int | None = None) -> ReadyMicrobatch | None:
        if not self._ready:
            self.poll(block_ms)
        return self._ready.popleft() if self._ready else None

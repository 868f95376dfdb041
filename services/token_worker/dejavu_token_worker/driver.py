"""Token stage 0's loop: admission into D_t slots, round-robin steps, token returns.

Up to D_t microbatches are in flight. A free slot takes the next microbatch whose prompt is done
(disaggregated: announced on the READY stream; colocated: claimed from the colocated queue and
prefilled here). A microbatch's next step starts when the last stage has returned the previous
step's tokens; when every row is done its caches are released along the pipeline and the slot
goes to the next microbatch (microbatch-level replacement).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import redis
import torch
from pydantic import ValidationError

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import PromptTask
from dejavu_engine.stage_io import StageIO
from dejavu_token_worker.ready import ReadyPrompts
from dejavu_token_worker.runner import STEP_FAILURES, Position, StageRunner, history
from dejavu_worker.dataplane import Kind, StageMessage, TokenReturn
from dejavu_worker.endpoint import Channel, DataEndpoint

log = logging.getLogger("dejavu.token_worker.driver")


class Driver:
    def __init__(
        self,
        runner: StageRunner,
        endpoint: DataEndpoint,
        client: redis.Redis,
        worker_id: str,
        pos: Position,
        ready: ReadyPrompts | None,
        deadline_s: float,
    ) -> None:
        self.runner = runner
        self.endpoint = endpoint
        self.redis = client
        self.worker_id = worker_id
        self.pos = pos
        self.ready = ready
        self.deadline_s = deadline_s
        self.inflight: dict[int, tuple[int, ...]] = {}  # mb -> tokens to feed at its next step
        self.next_step: dict[int, int] = {}
        self.runnable: collections.deque[int] = collections.deque()

    def resume(self, points: dict[int, int]) -> None:
        """Re-admit microbatches after recovery, each at the step it resumes from."""
        for mb, step in sorted(points.items()):
            entries = history(self.redis, mb, before_step=step)
            if not entries or entries[-1].step != step - 1:
                log.error("no tokens of step %d for microbatch %d: cannot resume it", step - 1, mb)
                continue
            n_rows = len(entries[-1].tokens)
            if all(any(e.finished[r] is not None for e in entries) for r in range(n_rows)):
                self._release_everywhere(mb)
                continue
            self.inflight[mb], self.next_step[mb] = tuple(self._latest_tokens(entries)), step
            self.runnable.append(mb)
        log.info("resumed microbatches %s", {m: self.next_step[m] for m in self.inflight})

    @staticmethod
    def _latest_tokens(entries) -> list[int]:
        """Per row, the token to feed next: its newest emitted token (finished rows: any)."""
        out = [0] * len(entries[-1].tokens)
        for e in entries:
            for r, t in enumerate(e.tokens):
                if t >= 0:
                    out[r] = t
        return out

    def run(self, stop: Callable[[], bool]) -> None:
        while not stop():
            self._admit()
            if self.runnable:
                mb_id = self.runnable.popleft()
                try:
                    self._step(mb_id)
                except STEP_FAILURES as exc:
                    self._fail(mb_id, exc)
                continue
            if self.pos.depth == 1:
                if not self.inflight and self.ready is not None:
                    self.ready.poll(block_ms=5)
                continue
            payload = self.endpoint.recv(Channel.TOKENS, timeout_s=0.005)
            if payload is not None:
                self._returned(TokenReturn.decode(payload))

    # -- admission ----------------------------------------------------------------------------
    def _admit(self) -> None:
        while len(self.inflight) < self.pos.depth:
            if self.pos.colocated:
                if not self._admit_colocated():
                    return
                continue
            assert self.ready is not None
            mb = self.ready.pop()
            if mb is None:
                return
            if mb.all_finished:
                self._release_everywhere(mb.spec.mb_id)
                continue
            self.inflight[mb.spec.mb_id], self.next_step[mb.spec.mb_id] = mb.first_tokens, 1
            self.runnable.append(mb.spec.mb_id)

    def _admit_colocated(self) -> bool:
        resp = self.redis.xreadgroup(
            keys.COLOCATED_GROUP,
            self.worker_id,
            {keys.COLOCATED_QUEUE: ">"},
            count=1,
            block=None if self.inflight else 5,
        )
        entries = [e for _s, es in resp or [] for e in es]
        if not entries:
            return False
        entry_id, fields = entries[0]
        self.redis.xack(keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP, entry_id)
        try:
            task = PromptTask.decode(fields[b"task"])
        except (KeyError, ValidationError) as exc:
            log.error("dropped a malformed colocated task: %s", exc)
            return True
        (piece,) = task.pieces  # a colocated task carries one whole token microbatch
        self.runner.release(piece.mb_id)  # a re-run prompt starts from a clean cache
        try:
            state = self.runner.state(piece.mb_id)
        except DeadlineExceeded as exc:
            log.error("dropped a colocated task: %s", exc)  # its microbatch is gone (a stale entry)
            return True
        spec = state.spec
        ids = torch.zeros((len(spec.rows), spec.prompt_len), dtype=torch.long)
        for r, row in enumerate(spec.rows):
            ids[r, spec.prompt_len - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
        state.mark_complete(0)
        self.inflight[spec.mb_id], self.next_step[spec.mb_id] = (), 0
        try:
            self.runner.run(self.pos, state, Kind.PREFILL, 0, StageIO(input_ids=ids))
        except STEP_FAILURES as exc:
            self._fail(spec.mb_id, exc)
            return True
        if self.pos.depth == 1:
            self._local_return(spec.mb_id)
        return True

    # -- steps --------------------------------------------------------------------------------
    def _step(self, mb_id: int) -> None:
        self.inflight[mb_id] = self.inflight.pop(mb_id)  # dict order = least recently run first
        state = self.runner.state(mb_id)
        state.wait_complete(self.deadline_s)
        self.runner.replicate_prompt(state)
        ids = torch.tensor([[t] for t in self.inflight[mb_id]], dtype=torch.long)
        self.runner.run(
            self.pos, state, Kind.DECODE, self.next_step[mb_id], StageIO(input_ids=ids), next_mb=self._guess_next(mb_id)
        )
        if self.pos.depth == 1:
            self._local_return(mb_id)

    def _guess_next(self, current: int) -> int | None:
        """The microbatch likely to run after ``current``: the head of the queue, else the one that
        has waited longest (round-robin). Stages use it to prefetch swapped-out caches."""
        if self.runnable:
            return self.runnable[0]
        others = [mb for mb in self.inflight if mb != current]
        return others[0] if others else None

    def _local_return(self, mb_id: int) -> None:
        """Single-stage pipeline: the step's tokens come back without a network hop."""
        if self.runner.trackers[mb_id].done:
            self._finish(mb_id)
            return
        self.inflight[mb_id] = self.runner.last_tokens[mb_id]
        self.next_step[mb_id] += 1
        self.runnable.append(mb_id)

    def _returned(self, ret: TokenReturn) -> None:
        if ret.mb_id not in self.inflight or ret.step != self.next_step[ret.mb_id]:
            return  # a stale return (re-executed step after recovery)
        if ret.done:
            self._finish(ret.mb_id)
            return
        self.inflight[ret.mb_id] = ret.tokens
        self.next_step[ret.mb_id] = ret.step + 1
        self.runnable.append(ret.mb_id)

    def _fail(self, mb_id: int, error: Exception) -> None:
        """One microbatch's step failed: fail its requests, free it everywhere, serve the others."""
        self.runner.fail(mb_id, self.next_step.get(mb_id, 0), error)
        self._finish(mb_id)

    def _finish(self, mb_id: int) -> None:
        self.inflight.pop(mb_id, None)
        self.next_step.pop(mb_id, None)
        self._release_everywhere(mb_id)

    def _release_everywhere(self, mb_id: int) -> None:
        self.runner.release(mb_id)
        if self.pos.next_peer is not None:
            self.endpoint.send(self.pos.next_peer, Channel.ACTIVATION, StageMessage(Kind.RELEASE, mb_id, 0).encode())


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) unless it exists."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise

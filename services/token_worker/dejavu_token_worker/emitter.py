"""The sampling end of a request-scheduled pipeline: its last stage's books of what each request emitted.

The last stage samples every request whose slice ended at its last known token (penalties seeing its prompt and
its tokens, draws numbered by its step), records its prompt's log probabilities where it asked for them, and
publishes the pass's entries on the requests' token streams in one pipelined Redis write. What a request emitted
is a function of its spec and its token stream: a record is made from the spec (carried in the request's first
slice after stage 0 admitted it, or given by stage 0 itself on a one-stage pipeline) and the stream's history, and
made again whenever stage 0's count of the request's tokens differs from the record's (a pass an error broke, a
restart), so no step is emitted twice and none is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis
import torch

from dejavu_common import keys
from dejavu_common.errors import DeadlineExceeded
from dejavu_common.messages import FinishReason, Logprob, MicrobatchSpec, TokenStep
from dejavu_common.signing import EntrySigner, token_entry
from dejavu_engine.sampling import RowContext, logprob, sample_rows
from dejavu_token_worker.runner import history
from dejavu_worker.dataplane import Outcome, WireSlice
from dejavu_worker.microbatch import fetch_spec
from dejavu_worker.rows import RowTracker

log = logging.getLogger("dejavu.token_worker.emitter")


@dataclass
class Record:
    """One request as the last stage knows it: its spec (one row), what it emitted, and its prompt's log
    probabilities as the passes computing its prompt produce them (when its request asks and nothing was
    emitted yet)."""

    spec: MicrobatchSpec
    tracker: RowTracker
    prompt_logprobs: dict[int, Logprob] | None = None  # position -> log probability

    @property
    def mb_id(self) -> int:
        return self.spec.mb_id

    @property
    def generated(self) -> int:
        return self.tracker.generated[0]


class Emitter:
    """The last stage's records and sampler (stage 0 itself on a one-stage pipeline)."""

    def __init__(self, client: redis.Redis, signer: EntrySigner | None, eos_ids: frozenset[int]) -> None:
        self.redis = client
        self.signer = signer
        self.eos_ids = eos_ids
        self.records: dict[int, Record] = {}

    def begin(self, spec: MicrobatchSpec, tracker: RowTracker | None = None) -> Record:
        """(Re)start the record of ``spec``'s request from ``tracker`` (or from its token stream's history)."""
        if tracker is None:
            tracker = RowTracker(spec, self.eos_ids)
            tracker.replay(history(self.redis, spec.mb_id, before_step=1 << 30))
        top = spec.rows[0].sampling.prompt_logprobs
        wants_prompt = top is not None and not tracker.outputs[0]
        record = Record(spec, tracker, {} if wants_prompt else None)
        self.records[spec.mb_id] = record
        return record

    def forget(self, mb_ids: Iterable[int]) -> None:
        for mb in mb_ids:
            self.records.pop(mb, None)

    def clear(self) -> None:
        self.records.clear()

    def record(self, piece: WireSlice) -> Record | None:
        """The record ``piece`` computes for: begun from its spec when it carries one, from the stream when stage 0
        counts other tokens than the record does; None when its spec is gone (the request ended)."""
        if piece.spec is not None:
            return self.begin(piece.spec)
        record = self.records.get(piece.mb)
        if record is not None and record.generated == piece.generated:
            return record
        spec = record.spec if record is not None else None
        if spec is None:
            try:
                spec = fetch_spec(self.redis, piece.mb, 0.0)
            except DeadlineExceeded:
                return None
        return self.begin(spec)

    def note_prompt_logprobs(self, record: Record, start: int, logits: torch.Tensor) -> None:
        """Record the log probabilities of the prompt tokens that the logits after positions ``start..`` predict."""
        if record.prompt_logprobs is None:
            return
        ids, top = record.spec.rows[0].prompt_ids, record.spec.rows[0].sampling.prompt_logprobs or 0
        log_probs = torch.log_softmax(logits.float(), -1)
        for i in range(logits.shape[0]):
            target = start + i + 1
            if target < len(ids):
                record.prompt_logprobs[target] = logprob(log_probs[i], ids[target], top)

    def sample(
        self, records: Sequence[Record], logits: torch.Tensor, cancels: Mapping[int, set[int]] | None = None
    ) -> list[Outcome]:
        """Sample each of ``records`` from its row of ``logits`` ``[len(records), vocab]``, publish the entries in
        one pipelined Redis write and return each one's outcome. A request cancelled meanwhile (``cancels``, read
        here when not given) ends CANCELLED instead, one whose grammar does not compile REFUSED (the gateway
        answers it 400)."""
        if not records:
            return []
        if cancels is None:
            cancels = self.cancelled([r.mb_id for r in records])
        params = [r.spec.rows[0].sampling for r in records]
        contexts = None
        if not all(p.plain_greedy for p in params):
            contexts = [RowContext(r.spec.rows[0].prompt_ids, r.tracker.outputs[0], r.tracker.stops[0].stop_ids)
                        for r in records]  # fmt: skip
        rows = sample_rows(logits, params, [r.generated for r in records], contexts)
        entries: list[TokenStep] = []
        for r, row in zip(records, rows, strict=True):
            prompts = [self._prompt_logprobs(r)] if r.prompt_logprobs is not None and not r.tracker.outputs[0] else []
            if row.refused is not None:
                log.info("request of microbatch %d refused: its grammar does not compile: %s", r.mb_id, row.refused)
            refused = {0: row.refused} if row.refused is not None else None
            entries.append(r.tracker.step(r.generated, [row.token], cancels.get(r.mb_id, ()), (0,), [row.logprob],
                                          prompts, refused=refused))  # fmt: skip
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            key = keys.tokens(entry.mb_id)
            pipe.xadd(key, token_entry(self.signer, key, entry.encode()))
        pipe.execute()
        outcomes = []
        for r, entry in zip(records, entries, strict=True):
            ended = entry.finished[0] is not None
            outcomes.append(Outcome(mb=r.mb_id, token=entry.tokens[0], ended=ended))
            if ended:
                self.records.pop(r.mb_id, None)
        return outcomes

    def publish_end(self, mb_id: int, step: int, reason: FinishReason) -> None:
        """End request ``mb_id``'s stream with ``reason`` at ``step``, without a token."""
        self._append(TokenStep(mb_id=mb_id, step=step, tokens=(-1,), finished=(reason,)))

    def publish_failure(self, spec: MicrobatchSpec, step: int, error: Exception) -> None:
        """End every row of ``spec``'s stream at ``step`` with an error (the controller fails its requests)."""
        log.error("request of microbatch %d failed at step %d: %r", spec.mb_id, step, error)
        n = len(spec.rows)
        self._append(TokenStep(mb_id=spec.mb_id, step=step, tokens=(-1,) * n, finished=(FinishReason.ERROR,) * n))

    def _append(self, entry: TokenStep) -> None:
        key = keys.tokens(entry.mb_id)
        self.redis.xadd(key, token_entry(self.signer, key, entry.encode()))

    def cancelled(self, mb_ids: Sequence[int]) -> dict[int, set[int]]:
        """Per request, the rows its controller cancelled (``{0}`` or nothing), in one Redis round trip."""
        if not mb_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for mb in mb_ids:
            pipe.smembers(keys.microbatch_cancel(mb))
        return {mb: {int(x) for x in rows} for mb, rows in zip(mb_ids, pipe.execute(), strict=True)}

    @staticmethod
    def _prompt_logprobs(record: Record) -> tuple[Logprob | None, ...]:
        assert record.prompt_logprobs is not None
        n = len(record.spec.rows[0].prompt_ids)
        return (None, *(record.prompt_logprobs.get(p) for p in range(1, n)))

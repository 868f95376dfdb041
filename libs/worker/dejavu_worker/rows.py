"""Per-row progress of a token microbatch at a sampling stage: what each step emits and when rows stop.

Pure Python. Step 0 is the first token (sampled by the last prompt stage, or by the last token stage
in colocated mode); decode step ``s`` emits token ``s``. A row stops on an EOS (unless its request
has ``ignore_eos``) or one of its stop tokens, at ``max_tokens``, when its slot of the cache is full,
or when the controller cancelled it; a stopped row emits -1 from then on. The state after step ``s``
(each row's tokens so far, which its penalties and ``min_tokens`` read) is a pure function of the tokens
emitted so far, so a resumed microbatch rebuilds it from the token history.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dejavu_common.messages import FinishReason, Logprob, MicrobatchSpec, TokenStep
from dejavu_common.stopping import StopCriteria


@dataclass
class RowTracker:
    spec: MicrobatchSpec
    eos_ids: frozenset[int]
    generated: list[int] = field(init=False)
    outputs: list[list[int]] = field(init=False)  # per row, the tokens it emitted, in order
    finished: list[FinishReason | None] = field(init=False)
    stops: list[StopCriteria] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.spec.rows)
        self.generated = [0] * n
        self.outputs = [[] for _ in range(n)]
        self.finished = [None] * n
        self.stops = [StopCriteria.of(row.sampling, self.eos_ids) for row in self.spec.rows]

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finished)

    @property
    def active_rows(self) -> list[int]:
        return [r for r, f in enumerate(self.finished) if f is None]

    def step(
        self,
        step: int,
        sampled: Sequence[int],
        cancelled: Iterable[int] = (),
        rows: Sequence[int] | None = None,
        logprobs: Sequence[Logprob | None] = (),
        prompt_logprobs: Sequence[tuple[Logprob | None, ...] | None] = (),
        refused: Mapping[int, str] | None = None,
    ) -> TokenStep:
        """Record the tokens sampled at ``step`` for ``rows`` (default: all rows) and return the step's entry.

        ``sampled[i]`` is the token of row ``rows[i]``; rows outside ``rows`` emit -1 in the entry. Rows in
        ``cancelled`` end CANCELLED and rows in ``refused`` (the sampler could not run their grammar; the value
        says why) REFUSED, both without a token.
        ``logprobs[i]`` and ``prompt_logprobs[i]`` (empty: none) are that row's log probabilities, which the
        entry carries for the rows that emit a token.
        """
        rows = list(range(len(self.spec.rows))) if rows is None else list(rows)
        cancelled, refused = set(cancelled), refused or {}
        tokens = [-1] * len(self.spec.rows)
        finished: list[FinishReason | None] = [None] * len(self.spec.rows)
        row_logprobs: list[Logprob | None] = [None] * len(self.spec.rows)
        row_prompt: list[tuple[Logprob | None, ...] | None] = [None] * len(self.spec.rows)
        refusals: list[str | None] = [None] * len(self.spec.rows)
        for i, r in enumerate(rows):
            if self.finished[r] is not None:
                continue
            if r in cancelled or r in refused:
                ended = FinishReason.CANCELLED if r in cancelled else FinishReason.REFUSED
                self.finished[r] = finished[r] = ended
                refusals[r] = refused.get(r)
                continue
            tok = int(sampled[i])
            tokens[r] = tok
            if logprobs:
                row_logprobs[r] = logprobs[i]
            if prompt_logprobs:
                row_prompt[r] = prompt_logprobs[i]
            self.generated[r] += 1
            self.outputs[r].append(tok)
            reason = self._finish(r, tok, step)
            if reason is not None:
                self.finished[r] = finished[r] = reason
        return TokenStep(
            mb_id=self.spec.mb_id,
            step=step,
            tokens=tuple(tokens),
            finished=tuple(finished),
            logprobs=tuple(row_logprobs) if any(lp is not None for lp in row_logprobs) else (),
            prompt_logprobs=tuple(row_prompt) if any(lp is not None for lp in row_prompt) else (),
            refusals=tuple(refusals) if any(reason is not None for reason in refusals) else (),
        )

    def _finish(self, row: int, token: int, step: int) -> FinishReason | None:
        reason = self.stops[row].check(token, self.generated[row])
        if reason is not None:
            return reason
        # The next decode step would write cache position prompt_len + step: stop when it is full.
        if self.spec.prompt_len + step + 1 > self.spec.max_len:
            return FinishReason.LENGTH
        return None

    def replay(self, history: Sequence[TokenStep]) -> None:
        """Rebuild the state from emitted steps (recovery): apply each entry's tokens and finishes."""
        for entry in history:
            for r, (tok, fin) in enumerate(zip(entry.tokens, entry.finished, strict=True)):
                if tok >= 0:
                    self.generated[r] += 1
                    self.outputs[r].append(tok)
                if fin is not None:
                    self.finished[r] = fin

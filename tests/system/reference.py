"""Failure-free reference outputs from the in-process engine (what ``dejavu generate`` computes)."""

from __future__ import annotations

from pathlib import Path

from dejavu_common.messages import SamplingSpec
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.generate import Request, generate_batch
from dejavu_engine.pipeline import Pipeline


class Reference:
    """Greedy completions, one request at a time (no batching effects), cached; the model loads once."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.pipeline = Pipeline(model, 1)
        self.eos = self.pipeline.spec.eos_token_ids | self.tokenizer.eos_token_ids
        self._cache: dict[tuple[str, int, bool, bool], str] = {}

    def text(self, prompt: str, max_tokens: int, chat: bool = False, ignore_eos: bool = False) -> str:
        key = (prompt, max_tokens, chat, ignore_eos)
        if key not in self._cache:
            ids = (
                self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                if chat
                else self.tokenizer.encode(prompt)
            )
            sampling = SamplingSpec(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
            request = Request(tuple(ids), sampling, self.eos)
            (completion,), _ = generate_batch(self.pipeline, [request])
            self._cache[key] = self.tokenizer.decode(completion.token_ids)
        return self._cache[key]

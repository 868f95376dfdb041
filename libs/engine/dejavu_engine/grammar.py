"""Structured outputs: which tokens a row's grammar (``SamplingSpec.grammar``) lets it sample next, with
xgrammar (the engine vLLM and SGLang use).

A row's grammar state is a pure function of the tokens it emitted: :func:`allowed_tokens` takes them
(``RowContext.generated``) at every step, so a row resumed on another worker after a failure, its tokens
rebuilt from its token stream, gets exactly the masks the failed worker would have computed. Two bounded
per-process LRU caches keep that cheap:

* compiled grammars, keyed by the vocabulary and the :class:`GrammarSpec` (a schema compiles once per
  process, the first time a row needs it); a spec xgrammar cannot compile is remembered as such;
* row matchers, keyed by the row's sampling spec, prompt and stop ids: a matcher is advanced over the new
  tokens when a row's tokens extend the ones it has seen, and rebuilt from all of them otherwise (a resumed
  row, an evicted matcher, another row with the same key).

The grammar ends the row: its stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) are allowed only
where the grammar is complete. A row that has no stop id, or whose grammar has ended or rejected a token
(a token the mask did not allow: see ``sampling.process_logits``), is no longer constrained (None). A
grammar the worker cannot compile raises :class:`GrammarError` for the row: the worker ends the row with
``FinishReason.REFUSED`` before its first token, and the gateway answers that request 400 with xgrammar's
reason (its own checks refuse what they can tell cheaply before a worker sees the request).

xgrammar needs the tokenizer's vocabulary: the last stage of a pipeline registers its checkpoint folder
(:func:`register_vocabulary`), and a row's logits width picks it. The mask is computed on the CPU and is
applied with torch's own ops (no triton kernel).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dejavu_common.messages import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

#: Compiled grammars one process keeps (a compiled JSON schema over a 50k vocabulary is a few hundred KiB).
MAX_COMPILED = 64
#: Row matchers one process keeps (a few KiB each): more than the rows one worker runs at a time.
MAX_MATCHERS = 4096
#: The schema of ``json_object``: any JSON object.
_ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A grammar that xgrammar cannot compile; its message is xgrammar's reason."""


def compile_source(spec: GrammarSpec) -> xgrammar.Grammar:
    """The vocabulary-independent grammar of ``spec``; raises :class:`GrammarError` if xgrammar rejects it.

    JSON is generated compactly (``", "`` and ``": "`` separators, no other whitespace): a small model left
    free to emit whitespace can loop on it until ``max_tokens``."""
    import xgrammar as xgr

    try:
        if spec.kind is GrammarKind.JSON_OBJECT:
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False)
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
        if spec.kind is GrammarKind.REGEX:
            return xgr.Grammar.from_regex(spec.source)
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choices)  # EBNF strings escape as JSON
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    except (RuntimeError, ValueError) as exc:  # xgrammar reports parse errors as RuntimeError
        raise GrammarError(_first_line(str(exc))) from exc


def _first_line(message: str) -> str:
    """xgrammar's message without its C++ location prefix (``[time] file.cc:line: ``)."""
    text = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text


@dataclass
class _Vocabulary:
    """xgrammar's view of one checkpoint's tokenizer at one logits width, built on first use."""

    folder: Path
    size: int
    compiler: Any = None

    def get_compiler(self) -> Any:
        if self.compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.folder))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.size)
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self.compiler


@dataclass
class _RowMatcher:
    """One row's matcher and the tokens it has consumed; ``live`` until the grammar ends or rejects a token."""

    matcher: Any
    seen: list[int] = field(default_factory=list)
    live: bool = True

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.seen.append(token)
            if self.live and not self.matcher.accept_token(token):
                self.live = False
            if self.live and self.matcher.is_terminated():
                self.live = False


_lock = threading.Lock()
_vocabularies: dict[int, _Vocabulary] = {}
_compiled: OrderedDict[tuple[Hashable, ...], Any] = OrderedDict()
_matchers: OrderedDict[Hashable, _RowMatcher] = OrderedDict()


def register_vocabulary(folder: str | Path, vocab_size: int) -> None:
    """Rows whose logits are ``vocab_size`` wide take their grammar's tokens from the tokenizer in ``folder``
    (loaded on the first constrained row; the latest registration of a width wins)."""
    with _lock:
        known = _vocabularies.get(vocab_size)
        if known is None or known.folder != Path(folder):
            _vocabularies[vocab_size] = _Vocabulary(Path(folder), vocab_size)


def allowed_tokens(
    spec: GrammarSpec, vocab_size: int, row_key: Hashable, generated: Sequence[int], stop_ids: frozenset[int]
) -> torch.Tensor | None:
    """A ``[vocab_size]`` bool mask (CPU) of the tokens the grammar lets the row sample after ``generated``
    (its stop ids where the grammar is complete); None where it no longer constrains the row.

    ``row_key`` tells rows apart for the matcher cache (any hashable that differs between concurrent rows;
    a collision costs a rebuild, never a wrong mask). Raises :class:`GrammarError` if the grammar does not
    compile, ValueError if no vocabulary of that width is registered."""
    with _lock:
        vocabulary = _vocabularies.get(vocab_size)
        if vocabulary is None:
            raise ValueError(f"no tokenizer registered for logits of width {vocab_size}: grammars cannot apply")
        compiled = _compiled_grammar(vocabulary, spec)
        if isinstance(compiled, GrammarError):
            raise GrammarError(str(compiled))  # a fresh one: the cached one keeps no traceback
        row = _row_matcher(compiled, (spec, row_key, stop_ids, vocab_size), generated, stop_ids)
        if not row.live:
            return None
        return _mask(row.matcher, vocab_size)


def _compiled_grammar(vocabulary: _Vocabulary, spec: GrammarSpec) -> Any:
    """The compiled grammar of ``spec`` (a :class:`GrammarError` if it cannot compile), cached."""
    key = (vocabulary.folder, vocabulary.size, spec)
    compiled = _compiled.get(key)
    if compiled is not None:
        _compiled.move_to_end(key)
        return compiled
    try:
        compiled = vocabulary.get_compiler().compile_grammar(compile_source(spec))
    except (GrammarError, RuntimeError) as exc:  # RuntimeError: xgrammar's, from compiling over the vocabulary
        log.warning("a %s grammar does not compile, its requests are refused: %s", spec.kind.value, exc)
        compiled = exc if isinstance(exc, GrammarError) else GrammarError(_first_line(str(exc)))
    _compiled[key] = compiled
    if len(_compiled) > MAX_COMPILED:
        _compiled.popitem(last=False)
    return compiled


def _row_matcher(compiled: Any, key: Hashable, generated: Sequence[int], stop_ids: frozenset[int]) -> _RowMatcher:
    """The row's matcher advanced to ``generated``: the cached one when ``generated`` extends what it saw."""
    row = _matchers.get(key)
    if row is None or len(row.seen) > len(generated) or list(generated[: len(row.seen)]) != row.seen:
        import xgrammar as xgr

        if stop_ids:
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
        else:  # nothing stops the row: the grammar lets it go free once complete
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        row = _RowMatcher(matcher)
        _matchers[key] = row
        if len(_matchers) > MAX_MATCHERS:
            _matchers.popitem(last=False)
    else:
        _matchers.move_to_end(key)
    row.advance(generated[len(row.seen) :])
    return row


def _mask(matcher: Any, vocab_size: int) -> torch.Tensor:
    """The matcher's next-token bitmask as a ``[vocab_size]`` bool tensor."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


def clear() -> None:
    """Forget every compiled grammar and row matcher (the registered vocabularies stay)."""
    with _lock:
        _compiled.clear()
        _matchers.clear()

"""Torch-free tokenizer of a Hugging Face checkpoint folder: encode, decode, chat template, stop strings.

Wraps ``tokenizers.Tokenizer`` (``tokenizer.json``) and reads ``tokenizer_config.json`` for the
special tokens, the BOS convention and the chat template, so the controller can tokenize without
importing torch or transformers. Behaviour matches transformers' ``AutoTokenizer`` on the same folder:

* ``encode`` adds what the ``tokenizer.json`` post-processor adds, and honours ``add_bos_token`` /
  ``add_eos_token`` of ``tokenizer_config.json`` when the post-processor does not already do it.
* ``apply_chat_template`` renders the checkpoint's Jinja template in a sandbox with the variables
  transformers passes (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and the
  other special tokens, a ``raise_exception`` helper) and encodes without adding special tokens.
* :class:`IncrementalDetokenizer` turns a token stream into text deltas, holding back text that is an
  incomplete UTF-8 character or could be the start of a stop string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """The tokenizer files are missing or a chat template failed to render."""


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids_of(value: Any) -> set[int]:
    """``eos_token_id`` of config.json / generation_config.json: an int, a list of ints or null."""
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: removes spaces before punctuation and contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class Tokenizer:
    """Tokenizer of one checkpoint folder; build it with :meth:`from_pretrained`. Thread-safe for reads."""

    def __init__(
        self,
        backend: _HFTokenizer,
        config: dict[str, Any],
        model_eos_ids: set[int],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._config = config
        self.special_tokens: dict[str, str] = {
            key: content for key in _SPECIAL_KEYS if (content := _token_content(config.get(key))) is not None
        }
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))
        eos_id = self.token_to_id(self.special_tokens.get("eos_token"))
        self.eos_token_ids: frozenset[int] = frozenset(model_eos_ids | ({eos_id} if eos_id is not None else set()))
        self.chat_template = chat_template
        self._add_bos = bool(config.get("add_bos_token", False))
        self._add_eos = bool(config.get("add_eos_token", False))
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self._template: jinja2.Template | None = None

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (plus eos ids of config.json and
        generation_config.json, and ``chat_template.jinja`` if the config has no template) from ``folder``.

        Raises :class:`TokenizerError` if ``tokenizer.json`` is missing.
        """
        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {root}")
        backend = _HFTokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        eos_ids = _ids_of(_read_json(root / "config.json").get("eos_token_id"))
        eos_ids |= _ids_of(_read_json(root / "generation_config.json").get("eos_token_id"))
        template = config.get("chat_template")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: transformers uses the one called "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(backend, config, eos_ids, template)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS/EOS convention applies."""
        ids = list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids.insert(0, self.bos_token_id)
            eos_id = self.token_to_id(self.special_tokens.get("eos_token"))
            if self._add_eos and eos_id is not None and ids[-1:] != [eos_id]:
                ids.append(eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it reads a ``tools`` variable)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template rendered to text, with ``tools`` (OpenAI's tool definitions, as transformers
        passes them) where given. Raises :class:`TokenizerError` if there is no template or the template
        raises (e.g. through ``raise_exception`` for a bad role order)."""
        if self.chat_template is None:
            raise TokenizerError("this checkpoint has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template itself places any BOS, so none is added."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    def detokenizer(self, stop: Sequence[str] = ()) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self, stop)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does: sandboxed, trimmed blocks, loop controls."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, with stop-string detection.

    ``push`` returns only text that is final: a trailing incomplete UTF-8 character (decoded as
    U+FFFD) and any suffix that could begin a stop string are held back until later tokens settle
    them. Once a stop string appears, ``stopped`` becomes True, the text before it is returned and
    every later push returns ``""``. Not thread-safe: one instance per sequence.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        # The last emitted token is re-decoded with the new ones so that word-boundary spaces and
        # multi-token characters decode as they do in the full text.
        self._prefix_offset = 0
        self._read_offset = 0  # tokens before this offset are already turned into text
        self._pending = ""  # decoded text not yet returned (may start a stop string)
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became final."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._pending += self._decode_new()
        return self._release(final=False)

    def flush(self) -> str:
        """Return all text still held back (call once, when generation ends)."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):
            prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._tokenizer.decode(self._ids[self._prefix_offset :])
            self._pending += full[len(prefix) :]
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _decode_new(self) -> str:
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _release(self, final: bool) -> str:
        """Return the releasable part of ``_pending``; detect stop strings."""
        found = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if found:
            self.stopped = True
            out, self._pending = self._pending[: min(found)], ""
            return out
        keep = 0 if final else self._stop_prefix_len(self._pending)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best

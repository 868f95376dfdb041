"""The serving protocol between stages, over a DejaVuLib endpoint.

Kinds of traffic, each on its own channel so different threads can wait on each:

- stage messages (ACTIVATION): a pass moving down a pipeline — PREFILL / DECODE carry hidden states,
  RELEASE frees a microbatch's caches. A token pipeline's pass is a *cohort step*: it batches several
  microbatches (``members``: each one's id and step, in row order), iteration-level batching;
- token returns (TOKENS): the last token stage hands stage 0 a cohort step's tokens, per member;
- a request-scheduled pipeline's passes (ACTIVATION, :class:`SlicePass`: per-request slices and their hidden
  states) and their returns (TOKENS, :class:`PassReturn`: what each request sampled);
- KV (KV_PROMPT, KV_REPLICA, KV_RESTORE): regions of caches, moved by DejaVuLib itself
  (``stream_out`` / ``Streamer.submit_region`` / ``stream_in``): the message's sealed header names the
  destination microbatch, layers, rows, positions and step, and the payload is the packed region.
  Nothing here frames KV.

A stage message or token return is a small JSON ``meta`` plus at most one tensor, framed as
``[u32 meta length][meta JSON][tensor bytes]``; dtype and shape ride in ``meta``. No pickle. The meta
of each kind is a typed, versioned message like the Redis ones (``dejavu_common.messages.Message``:
a version ``v``, unknown fields and wrong types rejected), so a malformed or foreign payload raises
``ValueError`` (``pydantic.ValidationError``) from ``decode`` and is dropped by its receiver.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import Field

from dejavu_common.messages import Message, MicrobatchSpec, PromptTask

_LEN = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


class Kind(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    RELEASE = "release"


def frame(meta: dict[str, Any], tensor: torch.Tensor | None) -> bytes:
    """``meta`` and ``tensor`` as one contiguous payload (the tensor is copied once)."""
    meta = dict(meta)
    body = b""
    if tensor is not None:
        t = tensor.detach().to("cpu").contiguous()
        meta["dtype"], meta["shape"] = _NAMES[t.dtype], list(t.shape)
        body = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    head = json.dumps(meta, separators=(",", ":")).encode()
    return _LEN.pack(len(head)) + head + body


def unframe(payload: memoryview | bytes) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Inverse of :func:`frame`; raises ValueError on a malformed payload."""
    buf = memoryview(payload)
    if len(buf) < _LEN.size:
        raise ValueError("payload shorter than its length prefix")
    (n,) = _LEN.unpack_from(buf, 0)
    if _LEN.size + n > len(buf):
        raise ValueError("meta length beyond the payload")
    meta = json.loads(bytes(buf[_LEN.size : _LEN.size + n]))
    if not isinstance(meta, dict):
        raise ValueError("meta is not an object")
    if "dtype" not in meta:
        return meta, None
    dtype, shape = _DTYPES.get(meta.pop("dtype")), meta.pop("shape", None)
    if dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError("the tensor's dtype or shape is malformed")
    raw = np.frombuffer(buf[_LEN.size + n :], dtype=np.int16 if dtype == torch.bfloat16 else _np(dtype)).copy()
    t = torch.from_numpy(raw)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    if t.numel() != int(np.prod(shape)):
        raise ValueError(f"tensor bytes do not match shape {shape}")
    return meta, t.reshape(shape)


def _np(dtype: torch.dtype) -> Any:
    return {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}[dtype]


class StageMeta(Message):
    """A stage message's meta on the wire (see :class:`StageMessage`)."""

    kind: Kind
    mb: int
    step: int
    members: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    deferred: tuple[tuple[int, int], ...] = ()
    next_mb: int | None = None
    task: PromptTask | None = None
    entry: str | None = None


@dataclass(frozen=True)
class StageMessage:
    """One pass down a pipeline. In the token pipeline ``members`` lists (microbatch, step, rows) of
    each group of rows of ``tensor``, in row order — ``rows`` being the microbatch's rows the pass
    computes (its unfinished ones) — and ``mb_id`` is stage 0's cohort slot; a prompt pipeline's pass
    and RELEASE name one microbatch (or prompt task) in ``mb_id``. ``deferred`` lists (microbatch, step)
    of members an earlier stage of the pass took out because it had discarded their KV to make room: no
    later stage computes them, and the last stage hands them back to stage 0 to recompute.
    ``next_mb``: the token pipeline's hint of the cohort stage 0 runs next (a stage may prefetch it);
    ``task`` and ``entry``: a prompt pipeline's task and its prompt-queue entry."""

    kind: Kind
    mb_id: int
    step: int
    tensor: torch.Tensor | None = None
    members: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    deferred: tuple[tuple[int, int], ...] = ()
    next_mb: int | None = None
    task: PromptTask | None = None
    entry: str | None = None

    def encode(self) -> bytes:
        meta = StageMeta(kind=self.kind, mb=self.mb_id, step=self.step, members=self.members, deferred=self.deferred,
                         next_mb=self.next_mb, task=self.task, entry=self.entry)  # fmt: skip
        return frame(meta.model_dump(mode="json", exclude_none=True), self.tensor)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> StageMessage:
        """Raises ``ValueError`` for a payload that is not a stage message of this version."""
        raw, tensor = unframe(payload)
        m = StageMeta.model_validate(raw)
        return cls(m.kind, m.mb, m.step, tensor, m.members, m.deferred, m.next_mb, m.task, m.entry)


@dataclass(frozen=True)
class Returned:
    """One microbatch's part of a token return: its step, the tokens to feed at its next step (one per
    row), whether it is done (every row finished, or the microbatch failed), and the rows still running
    (``live``: what its next step computes; None: unchanged). ``recompute``: the step did not run, because
    a stage had discarded the microbatch's KV to make room; stage 0 recomputes it at that step."""

    mb_id: int
    step: int
    tokens: tuple[int, ...]
    done: bool
    live: tuple[int, ...] | None = None
    recompute: bool = False


@dataclass(frozen=True)
class TokenReturn:
    """What stage 0 learns at the end of cohort ``cohort``'s step: one :class:`Returned` per member.
    ``cohort == -1``: members a later stage failed on their own, outside any step's completion."""

    cohort: int
    members: tuple[Returned, ...]

    def encode(self) -> bytes:
        members = tuple((m.mb_id, m.step, m.tokens, m.done, m.live, m.recompute) for m in self.members)
        return frame(TokenReturnMeta(cohort=self.cohort, members=members).model_dump(mode="json"), None)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> TokenReturn:
        """Raises ``ValueError`` for a payload that is not a token return of this version."""
        raw, tensor = unframe(payload)
        if tensor is not None:
            raise ValueError("a token return carries no tensor")
        m = TokenReturnMeta.model_validate(raw)
        return cls(m.cohort, tuple(Returned(*member) for member in m.members))


class TokenReturnMeta(Message):
    """A token return on the wire: per member (microbatch, step, tokens, done, live rows, recompute)."""

    cohort: int
    members: tuple[tuple[int, int, tuple[int, ...], bool, tuple[int, ...] | None, bool], ...]


class WireSlice(Message):
    """One request's slice of a request-scheduled pass, as the stages after the first see it: the request
    (``mb``: its one-row microbatch), positions ``[start, start + length)`` written into the blocks of ``table``,
    whether the pass samples its next token (``samples``) and returns the logits of its every position
    (``every``: its prompt's log probabilities), and how many tokens it has emitted (``generated``). ``spec``: the
    controller's spec of the request, carried in its first slice after stage 0 (re)admitted it, so the last
    stage never polls Redis for it. ``streamed``: the first slice of a request whose prompt the prompt pipeline
    computed: each stage first writes the prompt KV it received into the request's blocks."""

    mb: int
    start: int = Field(ge=0)
    length: int = Field(ge=1)
    table: tuple[int, ...]
    samples: bool
    every: bool = False
    generated: int = Field(0, ge=0)
    spec: MicrobatchSpec | None = None
    streamed: bool = False  # its prompt KV came from the prompt pipeline: placed into its blocks first
    cached: int = Field(0, ge=0)  # streamed: its leading positions found in the prefix cache (not placed)


class SlicePassMeta(Message):
    """A request-scheduled pass's meta on the wire (see :class:`SlicePass`)."""

    pass_id: int
    slices: tuple[WireSlice, ...]
    ended: tuple[int, ...] = ()
    released: tuple[int, ...] = ()


@dataclass(frozen=True)
class SlicePass:
    """One pass of a request-scheduled pipeline moving down its stages: every slice's hidden states back to back
    (``tensor``, ``[1, tokens, hidden]``) and the slices in that order. ``ended``: requests stage 0 ended since its
    previous pass (every stage forgets them: the replicas it keeps, the last stage its records). ``released``:
    requests whose blocks stage 0 took back since without ending them (preempted, to be computed again): every stage
    forgets their tables, whose blocks other requests may get from this pass on. A pass without slices (and without
    a tensor) only says what ended or was released, when no pass followed soon."""

    pass_id: int
    slices: tuple[WireSlice, ...]
    tensor: torch.Tensor | None
    ended: tuple[int, ...] = ()
    released: tuple[int, ...] = ()

    def encode(self) -> bytes:
        meta = SlicePassMeta(pass_id=self.pass_id, slices=self.slices, ended=self.ended, released=self.released)
        return frame(meta.model_dump(mode="json", exclude_none=True), self.tensor)

    @classmethod
    def decode(cls, payload: memoryview | bytes) -> SlicePass:
        """Raises ``ValueError`` for a payload that is not a request-scheduled pass of this version."""
        raw, tensor = unframe(payload)
        m = SlicePassMeta.model_validate(raw)
        if (tensor is None) != (not m.slices):
            raise ValueError("a request-scheduled pass carries the hidden states of its slices, and only then")
        return cls(m.pass_id, m.slices, tensor, m.ended, m.released)


class Outcome(Message):
    """What the last stage sampled for one request of a pass: ``token`` (-1: none, the request ended without one:
    cancelled, or its grammar refused) and whether its stream ended with it (``ended``)."""

    mb: int
    token: int
    ended: bool


class PassReturn(Message):
    """The last stage's answer to a request-scheduled pass: each sampling request's :class:`Outcome`; or ``error``
    (the pass could not be computed on some stage: stage 0 fails the requests of ``failed``, or every request of
    the pass when it names none, and runs the others again from their token streams); or ``broken`` (an error the
    stage outlives, Redis refusing the tokens, stopped it: its requests run again from their token streams)."""

    pass_id: int
    outcomes: tuple[Outcome, ...] = ()
    error: str | None = None
    failed: tuple[int, ...] = ()
    broken: bool = False

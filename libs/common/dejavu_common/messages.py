"""Typed, versioned control-plane messages (JSON over Redis), in one place.

Every message is a frozen pydantic model with a version field ``v``; ``encode`` gives compact JSON
bytes and ``decode`` validates them (unknown fields and wrong types are rejected, so a malformed
stream entry raises :class:`pydantic.ValidationError` instead of reaching a worker's logic). No
pickle: only JSON crosses the wire. Bulk KV and activation bytes travel peer-to-peer through
DejaVuLib, never through Redis.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

SCHEMA_VERSION = 1


class Message(BaseModel):
    """Base of every control message."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    v: int = SCHEMA_VERSION

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Self:
        return cls.model_validate_json(data)


class WorkerRole(str, enum.Enum):
    PROMPT = "prompt"
    TOKEN = "token"


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    IDLE = "idle"  # registered, waiting for a stage (a spare stays here)
    LOADING = "loading"  # loading its stage's layers
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class KVHeld(Message):
    """What KV a token worker holds (its caches and replicas), as of its last heartbeat: zero and zero once
    every microbatch it held is released (``keys.worker_kv``)."""

    bytes: int = Field(0, ge=0)
    microbatches: int = Field(0, ge=0)


class WorkerInfo(Message):
    """A worker's registration record."""

    worker_id: str
    role: WorkerRole
    host: str
    pid: int
    instance: str = Field(description="unique per process start: a restarted worker is a new instance")
    data_address: str = Field(description="base64 of the DejaVuLib endpoint address")
    torch_threads: int = 1
    spare: bool = False
    metrics_url: str | None = Field(None, description="where Prometheus scrapes it (None: not served)")
    entry_key: str = Field("", description="base64 Ed25519 public key its token-stream entries are signed with")
    data_key: str = Field("", description="base64 X25519 public key its data-plane pair keys derive from")

    def encode(self) -> bytes:
        """Without ``metrics_url`` when it is None: the record then reads as it did before the field existed."""
        return self.model_dump_json(exclude={"metrics_url"} if self.metrics_url is None else None).encode()


class StageAssignment(Message):
    worker_id: str
    stage: int
    layers: tuple[int, int]


class Topology(Message):
    """The pipelines the controller assembled; a new epoch fences everything older."""

    epoch: int
    mode: str
    n_layers: int
    prompt_stages: tuple[StageAssignment, ...] = ()
    token_stages: tuple[StageAssignment, ...] = ()
    prompt_microbatch: int
    token_microbatch: int

    def stage_of(self, worker_id: str) -> StageAssignment | None:
        for a in (*self.prompt_stages, *self.token_stages):
            if a.worker_id == worker_id:
                return a
        return None


#: Bits of a drawn request seed.
SEED_BITS = 63


def draw_seed() -> int:
    """A fresh random request seed."""
    return secrets.randbits(SEED_BITS)


#: Most alternatives a request may ask log probabilities of, per position (OpenAI's and vLLM's bound).
MAX_LOGPROBS = 20
#: Most entries of a request's ``logit_bias`` (OpenAI's bound).
MAX_LOGIT_BIAS = 300
#: A ``logit_bias`` of +-``LOGIT_BIAS_LIMIT`` forces (+) or bans (-) a token instead of shifting its logit.
LOGIT_BIAS_LIMIT = 100.0
#: Longest source (a JSON schema's text, a regular expression) of a request's grammar.
MAX_GRAMMAR_CHARS = 65_536
#: Most alternatives of a ``choice`` grammar, and the longest one.
MAX_GRAMMAR_CHOICES = 256
MAX_GRAMMAR_CHOICE_CHARS = 1024


class GrammarKind(str, enum.Enum):
    """What a request's output must be (``GrammarSpec``)."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # a JSON value valid against the schema in ``source``
    REGEX = "regex"  # text that ``source`` matches in full
    CHOICE = "choice"  # exactly one of ``choices``


class GrammarSpec(Message):
    """The structured-output constraint of a request: the last stage masks every token the grammar cannot
    continue with (``dejavu_engine.grammar``). ``source`` is the JSON schema's text (``json_schema``) or the
    regular expression (``regex``), empty otherwise; ``choices`` the alternatives of ``choice``, empty
    otherwise. Frozen and hashable: workers key their compiled grammars by it."""

    kind: GrammarKind
    source: str = Field("", max_length=MAX_GRAMMAR_CHARS)
    choices: tuple[str, ...] = Field((), max_length=MAX_GRAMMAR_CHOICES)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        needs_source = self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.REGEX)
        if needs_source != bool(self.source):
            raise ValueError(f"a {self.kind.value} grammar {'needs' if needs_source else 'takes no'} source")
        needs_choices = self.kind is GrammarKind.CHOICE
        if needs_choices != bool(self.choices):
            raise ValueError(f"a {self.kind.value} grammar {'needs' if needs_choices else 'takes no'} choices")
        if any(not c or len(c) > MAX_GRAMMAR_CHOICE_CHARS for c in self.choices):
            raise ValueError(f"choices must be non-empty and at most {MAX_GRAMMAR_CHOICE_CHARS} characters long")
        return self


class SamplingSpec(Message):
    """How one request generates, the one sampling spec from the API to the workers and ``dejavu generate``:
    ``temperature == 0`` is greedy, ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters;
    it stops at ``max_tokens``, an EOS id (unless ``ignore_eos``) or one of ``stop_token_ids``
    (``stopping.StopCriteria``), never before ``min_tokens``. The penalties are vLLM's (``repetition_penalty``
    HF's, over the prompt and the generated tokens; ``presence_penalty`` and ``frequency_penalty`` OpenAI's,
    over the generated tokens); ``logit_bias`` is ``(token id, bias)`` pairs in id order. ``logprobs``: report
    the sampled token's log probability and that of the ``logprobs`` most likely tokens (None: report none),
    from the processed logits (after ``min_tokens``, bias and penalties) or, with ``raw_logprobs``, the
    model's own; ``prompt_logprobs`` the same for every prompt position (the model's: nothing processes a
    prompt). A request without a seed gets one at admission (:meth:`resolved`), so every row on the wire
    has one and a resumed row draws what the failed worker would have drawn. Out-of-range values raise
    ``pydantic.ValidationError`` (a ``ValueError``). ``grammar``: the structured output the row must produce
    (None: free text); its mask is part of the processed logits."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS ids do not stop the row (stop_token_ids still do); old messages lack it
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: tuple[tuple[int, float], ...] = Field((), max_length=MAX_LOGIT_BIAS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    raw_logprobs: bool = False
    grammar: GrammarSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(t < 0 for t in ids):
            raise ValueError("logit_bias must list distinct non-negative token ids in increasing order")
        if any(not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the model's logits before sampling (penalties, bias, ``min_tokens``, a
        grammar)."""
        return bool(
            self.grammar is not None
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits, reporting nothing more: the argmax of the logits is the whole sampling."""
        return self.greedy and not self.processes_logits and self.logprobs is None

    def resolved(self) -> SamplingSpec:
        """This spec with a seed: its own, or a random one drawn now (at admission)."""
        return self if self.seed is not None else self.model_copy(update={"seed": draw_seed()})

    def for_choice(self, index: int) -> SamplingSpec:
        """The spec of choice ``index`` of a request generating several (``n``): its own seed stream, a hash
        of this seed and the index (choice 0 keeps this seed, so its tokens are the ``n = 1`` request's). A
        spec without a seed stays without: each choice then draws its own at admission."""
        if index == 0 or self.seed is None:
            return self
        digest = hashlib.blake2b(f"{self.seed}:choice:{index}".encode(), digest_size=8).digest()
        return self.model_copy(update={"seed": int.from_bytes(digest, "little") >> (64 - SEED_BITS)})


#: A W3C ``traceparent`` (version 00): version, trace id, parent span id, flags, in lowercase hex.
TRACEPARENT = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"


class RowSpec(Message):
    """One request as a row of a token microbatch. ``traceparent``: the W3C trace context of the request's span
    at the controller, which the workers' spans of this row continue (None: the request is not traced)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    traceparent: str | None = Field(None, pattern=TRACEPARENT)

    @model_serializer(mode="wrap")
    def _untraced_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An untraced row is encoded without the field, as before it existed (older readers forbid extras)."""
        data = handler(self)
        if data.get("traceparent", "") is None:
            del data["traceparent"]
        return data


class MicrobatchSpec(Message):
    """A token microbatch: its rows and its cache geometry (left padding to ``prompt_len``)."""

    mb_id: int
    rows: tuple[RowSpec, ...]
    prompt_len: int
    max_len: int

    @property
    def pad_lens(self) -> tuple[int, ...]:
        return tuple(self.prompt_len - len(r.prompt_ids) for r in self.rows)


class PromptPiece(Message):
    """Rows [dst_rows) of token microbatch ``mb_id`` that a prompt microbatch computes."""

    mb_id: int
    dst_rows: tuple[int, int]


class PromptSlice(Message):
    """What one pass of a prompt pipeline over paged pools computes of one request (its one-row microbatch ``mb``):
    positions ``[start, end)`` of its prompt, written into the blocks of ``table`` (which covers ``[0, end)``). On the
    request's first pass, ``[0, start)`` are whole blocks found in the prompt stages' prefix cache, each written by
    the task ``writers[i]`` names (a later stage reads a cached block only if it wrote it in that task); on a later
    pass of a prompt computed in chunks, ``writers`` is empty and ``[0, start)`` are the request's earlier passes."""

    mb: int
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    table: tuple[int, ...]
    writers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.start >= self.end or not self.table or len(self.writers) > len(self.table):
            raise ValueError(f"a prompt slice computes >= 1 position of its table: {self}")
        return self


class PromptTask(Message):
    """A prompt microbatch: the concatenation of its pieces' rows, in order. ``epoch``: the topology
    epoch the controller queued it under (a prompt worker still serving an older epoch holds it until it
    serves that one, so its KV goes to that epoch's token stages, not to the ones it replaced). ``slices``: in a
    request-scheduled deployment, what one pass of the task computes, as prompt stage 0 planned it (a task whose
    prompts pass ``controller.prompt_task_tokens`` runs in several passes, ``final`` marking its last); the
    controller queues none."""

    task_id: int
    pieces: tuple[PromptPiece, ...]
    epoch: int = 0
    slices: tuple[PromptSlice, ...] = ()
    final: bool = True


class FinishReason(str, enum.Enum):
    """Why a request (a row) stopped; the controller's gateway and the workers share this one enum."""

    STOP = "stop"  # EOS token, stop token or stop string
    LENGTH = "length"  # max_tokens reached (or the context is full)
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"  # the serving runtime failed this request (the others go on)
    REFUSED = "refused"  # the last stage cannot run it as asked (its grammar does not compile): a 400, no token


class Logprob(BaseModel):
    """Log probabilities at one position: the chosen token's (``logprob``) and the ``top`` most likely
    tokens' as ``(token id, logprob)``, most likely first. A token the sampling could not choose (banned,
    or masked by ``min_tokens``) reports ``LOGPROB_FLOOR`` (JSON has no -inf)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


#: The log probability reported for a token of probability 0 (vLLM's floor).
LOGPROB_FLOOR = -9999.0


class TokenStep(Message):
    """The tokens of one step of a token microbatch (step 0: the first token, from the prompt).

    ``tokens[r]`` is -1 for a row that emitted nothing this step (it had already finished);
    ``finished[r]`` is set on the step a row finishes. ``logprobs[r]``: the log probabilities of row
    ``r``'s token, for a row whose request asked for them (empty when no row did). ``prompt_logprobs[r]``
    (step 0 only, for a row that asked): one entry per prompt position, None for the first. ``refusals[r]``:
    why row ``r`` ends REFUSED (the grammar engine's reason), for the rows that do (empty when none does).
    """

    mb_id: int
    step: int
    tokens: tuple[int, ...]
    finished: tuple[FinishReason | None, ...]
    logprobs: tuple[Logprob | None, ...] = ()
    prompt_logprobs: tuple[tuple[Logprob | None, ...] | None, ...] = ()
    refusals: tuple[str | None, ...] = ()

    @model_validator(mode="after")
    def _one_per_row(self) -> Self:
        rows = len(self.tokens)
        if any(len(x) not in (0, rows) for x in (self.logprobs, self.prompt_logprobs, self.refusals)):
            raise ValueError("a token step's log probabilities and refusals, if any, have one entry per row")
        return self


class PromptDone(Message):
    """The last prompt stage has sampled rows [dst_rows) of token microbatch ``mb_id`` (step 0) and its
    stages have streamed their KV; token stage 0 may start decoding once every row is done. ``epoch``:
    the epoch the prompt workers served, which sealed that KV (token stages drop KV of older epochs, so
    an announcement of an older epoch than stage 0 serves is stale); 0 from a worker that did not say."""

    mb_id: int
    dst_rows: tuple[int, int]
    tokens: tuple[int, ...]
    finished: tuple[FinishReason | None, ...]
    epoch: int = 0


class StageProgress(Message):
    """A token stage's report at a new epoch: per in-flight microbatch, the last step whose KV it holds
    (0: the prompt only; -1: its prompt KV is incomplete)."""

    epoch: int
    stage: int
    worker_id: str
    done: dict[int, int]
    # A request-scheduled stage after the first: each request's block table here (stage 0's book handed it out),
    # from which a replacement of stage 0 rebuilds its book.
    tables: dict[int, tuple[int, ...]] = {}


class RecoveryOrder(Message):
    """What the token stages do at a new epoch after failures: ``replaced`` maps a stage to its new
    worker; the stage after it sends the replica it keeps, the stage before it sends its own cache."""

    epoch: int
    replaced: dict[int, str]
    microbatches: tuple[int, ...]


class ResumePoint(Message):
    """Where the token pipeline resumes after recovery: microbatch -> step to re-execute first; the
    microbatches in ``rerun`` lost their KV and re-run their prompts; those in ``dropped`` were failed
    to their clients (work that kept failing), and every worker frees what it holds of them."""

    epoch: int
    resume: dict[int, int]
    rerun: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    # A request-scheduled pipeline whose stage 0 was replaced: each resumed request's block table as stage 1 reported
    # it (the new stage 0 takes those blocks in its book, so every stage keeps the ids it holds the request's KV in).
    tables: dict[int, tuple[int, ...]] = {}


class AdminAction(str, enum.Enum):
    KILL = "kill"
    PAUSE_HEARTBEATS = "pause-heartbeats"
    DRAIN = "drain"


class AdminCommand(Message):
    """An admin order for one worker instance; ``signature`` is Ed25519 over the other fields
    (``dejavu_common.admin``), ``command_id`` its single-use nonce, valid ``issued_at``..``expires_at``."""

    command_id: str = Field(min_length=16, max_length=64)
    worker_id: str = Field(max_length=128)
    instance: str = Field(max_length=128)
    action: AdminAction
    seconds: float = Field(0.0, ge=0.0, le=86_400.0)
    issued_at: float
    expires_at: float
    signature: str = Field(max_length=128)

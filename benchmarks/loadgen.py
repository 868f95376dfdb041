"""A load generator for OpenAI-compatible completion APIs (ours, or a peer's such as vLLM).

Requests are sent at the arrival times of a :class:`dejavu_planner.trace.Trace` (all at 0 for a
backlog, a Poisson or gamma process from :mod:`benchmarks.dataset`, or a replayed trace file)
whatever the server's progress: a slow server builds a queue, as in the paper's experiments,
instead of slowing the client down. With ``max_concurrency`` at most that many requests are in
flight; a request that arrives while all are busy waits for one to end (with a backlog this is a
closed loop of that many clients, as ``vllm bench serve --max-concurrency``).

Every request streams (``POST /v1/completions`` with ``stream: true``, usage requested; a prompt given
as chat messages goes to ``/v1/chat/completions`` as ``messages``) and its record keeps the send time,
the arrival of every streamed chunk, the end time, the server's token counts, the generated text and
how it ended. ``ignore_eos`` asks the server (vLLM's extension, also ours) to generate
exactly ``max_tokens``. Each request has a deadline and the whole run is bounded in time, so a run
always stops by itself. Metrics over the records are in :mod:`benchmarks.metrics`.

Times in records are seconds since the run's start (``time.perf_counter`` based).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import httpx

from dejavu_planner.trace import Request, Trace

if TYPE_CHECKING:
    from dejavu_common.tokenizer import Tokenizer

# Common English words; those that are one token (with their leading space) build exact-length prompts.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were their one all we can her has there been if more when will would who so no out up "
    "into do time than them only some could other its new two may about these also like first people any "
    "over after most made between many such city water house river music story light world small great "
    "long little old right large place year work school number part day night week game point home "
    "country family power money state group"
)


class Status(str, enum.Enum):
    """How a request ended."""

    OK = "ok"  # streamed to [DONE] with a finish reason
    HTTP_ERROR = "http_error"  # answered with a non-200 status before streaming
    STREAM_ERROR = "stream_error"  # an error event, a malformed stream, or the connection failed
    TIMEOUT = "timeout"  # its deadline (or the run's) passed first
    NOT_SENT = "not_sent"  # its arrival lay beyond the run's time bound (or an earlier turn of its chat failed)


@dataclass(frozen=True)
class RequestRecord:
    """What the client observed of one request; times are seconds since the run's start.

    ``chunk_times_s`` are the arrivals of the streamed chunks that carry a choice (for a chat, a
    choice whose delta has text: the opening role chunk and the closing one do not count). Servers send
    about one chunk per token, but may hold back text that could still become a stop string or an
    incomplete character, so the chunks approximate the token arrivals; counts come from
    ``generated`` (the server's ``usage.completion_tokens``, or the chunk count if it sent none) and
    ``prompt_tokens`` (its ``usage.prompt_tokens``, None if it sent none).
    """

    request: Request
    status: Status
    send_s: float | None = None
    chunk_times_s: tuple[float, ...] = ()
    end_s: float | None = None
    generated: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    text: str = ""  # the streamed text (completions' ``text``, chat's ``delta.content``), out of the JSON

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def e2e_s(self) -> float | None:
        """Send to end of stream."""
        return None if self.send_s is None or self.end_s is None else self.end_s - self.send_s

    @property
    def ttft_s(self) -> float | None:
        """Send to the first chunk (the gateway sends nothing before the first token)."""
        return None if self.send_s is None or not self.chunk_times_s else self.chunk_times_s[0] - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM: (e2e - ttft) / (generated - 1)."""
        e2e, ttft = self.e2e_s, self.ttft_s
        if e2e is None or ttft is None or self.generated < 2:
            return None
        return (e2e - ttft) / (self.generated - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Inter-token latencies: the gaps between successive chunks (a chunk may carry several tokens)."""
        times = self.chunk_times_s
        return tuple(b - a for a, b in itertools.pairwise(times))

    @property
    def input_tokens(self) -> int:
        """The server's prompt token count, or the requested prompt length if it reported none."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.request.prompt_len

    @property
    def normalized_latency_s(self) -> float | None:
        """End-to-end seconds per generated token (the paper's and vLLM's normalized latency)."""
        e2e = self.e2e_s
        return None if e2e is None or self.generated < 1 else e2e / self.generated

    def to_json(self) -> dict:
        out = asdict(self)
        del out["text"]
        out["status"] = self.status.value
        out["request"] = asdict(self.request)
        return out


class PromptBuilder:
    """Texts that the server's tokenizer encodes to exactly a given number of tokens.

    A prompt is a seeded random sequence of common words, each a single token with its leading
    space, so the text of ``n`` words has ``n`` tokens plus whatever special tokens ``encode`` adds;
    the count is verified with the tokenizer (the one the server uses: ``encode`` with special
    tokens) and corrected once for those. Raises ``ValueError`` if the tokenizer has too few such
    words or the count cannot be made exact.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self._tokenizer = tokenizer
        self._seed = seed
        self._words = [w for w in _WORDS.split() if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
        if len(self._words) < 16:
            raise ValueError("the tokenizer has too few single-token words to build exact prompts")

    def text(self, n_tokens: int, key: int = 0) -> str:
        """A text of exactly ``n_tokens`` tokens; ``key`` (e.g. a request id) varies the words."""
        rng = random.Random(self._seed * 1_000_003 + key)
        words = [rng.choice(self._words) for _ in range(n_tokens)]
        count = n_tokens
        for _ in range(2):
            text = "".join(" " + w for w in words[:count])
            got = len(self._tokenizer.encode(text))
            if got == n_tokens:
                return text
            count -= got - n_tokens  # special tokens added by encode (e.g. a BOS)
            if count < 1:
                break
        raise ValueError(f"cannot build a prompt of exactly {n_tokens} tokens (got {got})")


@dataclass(frozen=True)
class ClientConfig:
    """Where and how the load generator sends its requests."""

    base_url: str
    model: str
    api_key: str | None = None
    request_timeout_s: float = 300.0  # deadline of one request, from its send to the end of its stream
    run_timeout_s: float = 3600.0  # bound of the whole run: no send after it, every request ends by it
    connect_timeout_s: float = 10.0
    temperature: float = 0.0
    seed: int = 0  # request i is sent with seed + i
    max_concurrency: int | None = None  # requests in flight at most; None: unbounded (open loop)
    ignore_eos: bool = False  # sent as the request's ``ignore_eos`` when set
    endpoint: str = "/v1/completions"
    chat_endpoint: str = "/v1/chat/completions"  # where a :class:`Chat` prompt goes

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1 (or None for no bound)")


@dataclass(frozen=True)
class Chat:
    """A chat prompt: OpenAI messages (``{"role", "content"}``), sent to the chat endpoint."""

    messages: tuple[dict[str, str], ...]


Prompt = str | list[int] | Chat  # a completion's text or token ids, or a chat's messages


@dataclass
class _Observed:
    """The mutable observations of one request while it streams (frozen into a record at its end)."""

    send_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    generated: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    text: list[str] = field(default_factory=list)


class _StreamFailed(Exception):
    """The stream carried an error event or was malformed."""


class LoadGenerator:
    """Sends one trace's requests at their arrival times and records each; see the module docstring.

    ``prompt_of`` gives each request's prompt (text, token ids or chat messages); it is called for
    every request before the clock starts, so prompt building never delays a send. :meth:`run` is a
    coroutine (one event loop, one ``httpx.AsyncClient`` with an unbounded pool so that sends never
    queue in the client); :meth:`run_sync` wraps it in ``asyncio.run``. A driver whose requests
    depend on earlier answers (:mod:`benchmarks.conversations`) opens :meth:`session` and calls
    :meth:`submit` per request instead.
    """

    def __init__(self, config: ClientConfig, prompt_of: Callable[[Request], Prompt] | None = None) -> None:
        self.config = config
        self._prompt_of = prompt_of

    def run_sync(self, trace: Trace) -> list[RequestRecord]:
        return asyncio.run(self.run(trace))

    async def run(self, trace: Trace) -> list[RequestRecord]:
        """Replay ``trace``; returns one record per request, in trace order. Never raises for a
        request's failure (it is recorded); returns by ``run_timeout_s`` plus a short grace."""
        if self._prompt_of is None:
            raise ValueError("run needs prompt_of")
        prompts = [self._prompt_of(r) for r in trace.requests]
        async with self.session() as client:
            slots = self.slots()
            start = time.perf_counter()
            tasks = [
                asyncio.create_task(self.submit(client, r, p, start, slots))
                for r, p in zip(trace.requests, prompts, strict=True)
            ]
            return list(await asyncio.gather(*tasks))

    @asynccontextmanager
    async def session(self) -> AsyncIterator[httpx.AsyncClient]:
        """The HTTP client of a run: the configured server, key and timeouts, an unbounded pool."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=self.config.base_url, headers=headers, timeout=timeout, limits=limits
        ) as client:
            yield client

    def slots(self) -> asyncio.Semaphore | None:
        """A run's bound on requests in flight (None: no bound); create it inside the run's event loop."""
        return asyncio.Semaphore(self.config.max_concurrency) if self.config.max_concurrency else None

    async def submit(
        self,
        client: httpx.AsyncClient,
        request: Request,
        prompt: Prompt,
        start: float,
        slots: asyncio.Semaphore | None,
    ) -> RequestRecord:
        """Wait for the request's arrival time (seconds after ``start``, a ``time.perf_counter``) and
        a free slot, stream it within its deadline, and record it. A request whose arrival lies beyond
        the run's bound, or still waiting for a slot when the bound passes, is not sent."""

        def now() -> float:
            return time.perf_counter() - start

        if request.arrival_s > self.config.run_timeout_s:
            return RequestRecord(request, Status.NOT_SENT)
        await asyncio.sleep(max(0.0, request.arrival_s - now()))
        if slots is None:
            return await self._send(client, request, prompt, now)
        try:
            async with asyncio.timeout(max(self.config.run_timeout_s - now(), 0.0)):
                await slots.acquire()
        except TimeoutError:
            return RequestRecord(request, Status.NOT_SENT)
        try:
            return await self._send(client, request, prompt, now)
        finally:
            slots.release()

    async def _send(
        self, client: httpx.AsyncClient, request: Request, prompt: Prompt, now: Callable[[], float]
    ) -> RequestRecord:
        """Stream the request now, within its deadline and the run's bound, and record how it went."""
        seen = _Observed(send_s=now())
        budget = min(self.config.request_timeout_s, self.config.run_timeout_s - seen.send_s)
        status, error = Status.OK, None
        try:
            async with asyncio.timeout(max(budget, 0.0)):
                await self._stream(client, request, prompt, seen, now)
        except TimeoutError:
            status, error = Status.TIMEOUT, f"no end within {budget:.1f} s"
        except httpx.TimeoutException as exc:  # connect (or a silent read) past httpx's own timeouts
            status, error = Status.TIMEOUT, f"{type(exc).__name__}: {exc}"
        except _StreamFailed as exc:
            status, error = (Status.HTTP_ERROR if seen.http_status != 200 else Status.STREAM_ERROR), str(exc)
        except httpx.HTTPError as exc:  # connection refused or reset, protocol errors
            status, error = Status.STREAM_ERROR, f"{type(exc).__name__}: {exc}"
        generated = seen.generated if seen.generated is not None else len(seen.chunk_times_s)
        return RequestRecord(
            request=request,
            status=status,
            send_s=seen.send_s,
            chunk_times_s=tuple(seen.chunk_times_s),
            end_s=now(),
            generated=generated,
            finish_reason=seen.finish_reason,
            http_status=seen.http_status,
            error=error,
            prompt_tokens=seen.prompt_tokens,
            text="".join(seen.text),
        )

    async def _stream(
        self,
        client: httpx.AsyncClient,
        request: Request,
        prompt: Prompt,
        seen: _Observed,
        now: Callable[[], float],
    ) -> None:
        """POST one streaming completion and fill ``seen``; raises :class:`_StreamFailed` on errors."""
        if isinstance(prompt, Chat):
            endpoint, asked = self.config.chat_endpoint, {"messages": list(prompt.messages)}
        else:
            endpoint, asked = self.config.endpoint, {"prompt": prompt}
        body = {
            "model": self.config.model,
            **asked,
            "max_tokens": request.new_tokens,
            "temperature": self.config.temperature,
            "seed": self.config.seed + request.rid,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        async with client.stream("POST", endpoint, json=body) as response:
            seen.http_status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise _StreamFailed(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    if seen.finish_reason is None:
                        raise _StreamFailed("the stream ended without a finish reason")
                    return
                try:
                    chunk = json.loads(data)
                except ValueError as exc:
                    raise _StreamFailed(f"malformed event {data[:100]!r}") from exc
                _absorb(chunk, seen, now())
        raise _StreamFailed("the stream closed before [DONE]")


def _absorb(chunk: dict, seen: _Observed, at_s: float) -> None:
    """Fold one streamed chunk into ``seen``."""
    if "error" in chunk:
        raise _StreamFailed(f"error event: {chunk['error']}")
    choices = chunk.get("choices") or []
    if choices:
        choice = choices[0]
        seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
        delta = choice.get("delta")
        if isinstance(delta, dict):  # a chat chunk: the opening role chunk and the closing one carry no text
            content = delta.get("content")
            if isinstance(content, str) and content:
                seen.chunk_times_s.append(at_s)
                seen.text.append(content)
        else:
            seen.chunk_times_s.append(at_s)
            if isinstance(choice.get("text"), str):
                seen.text.append(choice["text"])
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            seen.generated = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            seen.prompt_tokens = usage["prompt_tokens"]

"""Fixtures of the gateway tests: a tiny real tokenizer folder, a scripted Backend double, and the
app served in-process (TestClient) or by a real uvicorn server on a free port."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.api import RuntimeMetrics, create_app, gateway_server
from dejavu_controller.backend import (
    BackendStats,
    FinishReason,
    GenerationRequest,
    Logprob,
    NotReadyError,
    QueueFullError,
    TokenEvent,
)

MODEL = "tiny-test-model"
API_KEY = "sk-test-key-1"
REPLY = "Hello world, this is DejaVu speaking. The answer is 42. Goodbye and thanks!"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    REPLY,
    "The quick brown fox jumps over the lazy dog. Tell me a story about KV caches and pipelines.",
    "system user assistant What is the answer? You are a helpful assistant. Say hello.",
    "0123456789 !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~` naïve café 日本語",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_tokenizer_folder(folder: Path) -> Path:
    """A byte-level BPE checkpoint folder (tokenizer.json, tokenizer_config.json with a ChatML template)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_folder(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tokenizer_dir)


def scripted_logprobs(
    request: GenerationRequest, index: int, token_id: int
) -> tuple[tuple[Logprob, ...], tuple[Logprob | None, ...] | None]:
    """What a backend reports with the ``index``-th token where the request asks: its log probability
    ``-(index + 1) / 10`` and, as the likeliest, itself then ids 0, 1, ... (each 1 lower); the prompt's with
    the first token (position ``p``: ``-p / 10``, its own token the likeliest)."""
    spec = request.sampling
    logprobs: tuple[Logprob, ...] = ()
    if spec.logprobs is not None:
        value = -(index + 1) / 10
        others = [t for t in range(spec.logprobs + 1) if t != token_id][: max(spec.logprobs - 1, 0)]
        top = [(token_id, value)] + [(t, value - 1 - k) for k, t in enumerate(others)]
        logprobs = (Logprob(logprob=value, top=tuple(top[: spec.logprobs])),)
    prompt = None
    if spec.prompt_logprobs is not None and index == 0:
        ids = request.prompt_token_ids
        top_n = min(spec.prompt_logprobs, 1)
        prompt = (None, *(Logprob(logprob=-p / 10, top=((ids[p], -p / 10),)[:top_n]) for p in range(1, len(ids))))
    return logprobs, prompt


@dataclass
class ScriptedBackend:
    """A Backend double: answers every request with the tokens of ``reply`` (then EOS), one per event.

    ``max_tokens`` cuts the reply (finish LENGTH); ``fail_after`` ends with FinishReason.ERROR after
    that many tokens (or ``fail_reason``). At most ``queue_bound`` requests run at once (QueueFullError beyond). It
    records what it saw; ``cancelled`` holds ids whose iterator was closed before the finish.
    Built outside any event loop; thread-safe records for tests that serve it from another thread.
    """

    tokenizer: Tokenizer
    reply: str = REPLY
    end_with_eos: bool = True
    token_delay_s: float = 0.0
    queue_bound: int = 8
    ready: bool = True
    fail_after: int | None = None
    fail_reason: FinishReason = FinishReason.ERROR
    refusal: str | None = None  # the reason a REFUSED ``fail_reason`` carries
    kv_bytes_per_token: int = 1024
    requests: list[GenerationRequest] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    active: int = 0
    runtime_metrics: RuntimeMetrics | None = None
    started_event: threading.Event = field(default_factory=threading.Event)
    closed_event: threading.Event = field(default_factory=threading.Event)
    midway_event: threading.Event = field(default_factory=threading.Event)  # set once 3 tokens were yielded

    def is_ready(self) -> bool:
        return self.ready

    def stats(self) -> BackendStats:
        return BackendStats(queue_depth=self.active, workers={"prompt-0": "serving", "token-0": "serving"})

    def script(self, request: GenerationRequest) -> list[int]:
        eos = min(self.tokenizer.eos_token_ids)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False) + ([eos] if self.end_with_eos else [])
        return ids[: request.sampling.max_tokens]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self.ready:
            raise NotReadyError("no complete pipeline")
        if self.active >= self.queue_bound:
            raise QueueFullError(retry_after_s=2.5)
        self.active += 1
        self.requests.append(request)
        self.started_event.set()
        done = False
        try:
            ids = self.script(request)
            for i, token_id in enumerate(ids):
                if i == 3:
                    self.midway_event.set()
                await asyncio.sleep(self.token_delay_s)
                if self.fail_after is not None and i == self.fail_after:
                    done = True
                    yield TokenEvent((), self.fail_reason, refusal=self.refusal)
                    return
                if self.runtime_metrics is not None:
                    self.runtime_metrics.add_kv_bytes(self.kv_bytes_per_token)
                reason = None
                if i == len(ids) - 1:
                    reason = FinishReason.STOP if token_id in self.tokenizer.eos_token_ids else FinishReason.LENGTH
                done = reason is not None  # set before yielding: the consumer may close right after
                yield TokenEvent((token_id,), reason, *scripted_logprobs(request, i, token_id))
        finally:
            self.active -= 1
            (self.finished if done else self.cancelled).add(request.request_id)
            self.closed_event.set()

    def factory(self):
        @asynccontextmanager
        async def enter(settings: Settings, metrics: RuntimeMetrics) -> AsyncIterator[ScriptedBackend]:
            self.runtime_metrics = metrics
            yield self

        return enter


class EagerBackend(ScriptedBackend):
    """Like :class:`ScriptedBackend`, but ``generate`` is a coroutine that admits the request (raising
    QueueFullError/NotReadyError at once) and returns the event iterator, as PipelineBackend does."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:  # type: ignore[override]
        if not self.ready:
            raise NotReadyError("no complete pipeline")
        if self.active >= self.queue_bound:
            raise QueueFullError(retry_after_s=1.0)
        return super().generate(request)


def sse_payloads(body: str) -> list[dict | str]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the final ``[DONE]``."""
    payloads: list[dict | str] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def make_settings(tokenizer_dir: Path, *, keys: tuple[str, ...] = (API_KEY,), max_context: int = 256) -> Settings:
    return Settings(
        model={"name": MODEL, "path": tokenizer_dir},
        engine={"max_context": max_context},
        controller={"host": "127.0.0.1", "port": 0, "api_keys": [SecretStr(k) for k in keys]},
    )


@pytest.fixture
def backend(tokenizer: Tokenizer) -> ScriptedBackend:
    return ScriptedBackend(tokenizer)


@pytest.fixture
def settings(tokenizer_dir: Path) -> Settings:
    return make_settings(tokenizer_dir)


@pytest.fixture
def client(settings: Settings, backend: ScriptedBackend, tokenizer: Tokenizer) -> Iterator[TestClient]:
    """The app in-process, lifespan run, with a valid key on every request."""
    app = create_app(settings, backend.factory(), tokenizer=tokenizer)
    with TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {API_KEY}"}) as test:
        yield test


class LiveServer:
    """The gateway served by a real uvicorn server on a free loopback port, in a thread of this process
    (and its probe listener too, when ``controller.probe_port`` is set)."""

    def __init__(self, settings: Settings, backend: ScriptedBackend) -> None:
        settings = settings.model_copy(
            update={"controller": settings.controller.model_copy(update={"port": free_port()})}
        )
        self.port = settings.controller.port
        self.server = gateway_server(settings, backend.factory())
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():
            raise RuntimeError("uvicorn did not stop within 15 s")


@pytest.fixture
def live_server(settings: Settings, backend: ScriptedBackend) -> Iterator[LiveServer]:
    server = LiveServer(settings, backend)
    server.start()
    try:
        yield server
    finally:
        server.stop()

"""Sampling controls, log probabilities and ``n`` through real workers: the streamed choices of a penalised,
seeded ``n = 2`` request with log probabilities equal the in-process engine's (each choice its own seed
stream), in a disaggregated 1 prompt + 2 token deployment and colocated on one stage; ``echo`` with
``max_tokens: 0`` scores the prompt; and a token stage SIGKILLed mid-stream resumes every choice exactly."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from dejavu_common.messages import SamplingSpec
from dejavu_common.settings import Mode
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.generate import Completion, Request, generate_batch
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from dejavu_engine.sampling import prompt_logprobs

from .cluster import cluster_settings, killed_mid_stream, logs, running, token_stage_worker

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

PROMPT = "Once upon a time, in a small village by the mountains,"
MAX_TOKENS = 24
SEED = 1234
# What the request asks (the API's fields) and the spec the workers sample each choice with.
CONTROLS = {"temperature": 0.8, "frequency_penalty": 0.7, "presence_penalty": 0.3, "logprobs": 2, "seed": SEED}
SPEC = SamplingSpec(
    max_tokens=MAX_TOKENS, temperature=0.8, frequency_penalty=0.7, presence_penalty=0.3, logprobs=2, seed=SEED
)
# Float32 on both sides; the workers' passes batch and page differently from the one-row engine run, which moves
# log probabilities by a few 1e-5 (as against transformers: tests/engine/test_smollm2.py): they agree to 1e-4.
TOLERANCE = 1e-4


class Engine:
    """The failure-free reference: the staged engine in this process, one row at a time."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.pipeline = Pipeline(model, 1)
        self.eos = self.pipeline.spec.eos_token_ids

    def choice(self, prompt_ids: list[int], index: int) -> Completion:
        request = Request(tuple(prompt_ids), SPEC.for_choice(index), self.eos)
        (completion,), _ = generate_batch(self.pipeline, [request])
        return completion

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        geometry = BatchGeometry.for_prompts([len(prompt_ids)])
        caches = self.pipeline.allocate(1, geometry.cur_len)
        logits = self.pipeline.forward(torch.tensor([prompt_ids]), caches, geometry, all_logits=True)[0]
        return [lp.logprob for lp in prompt_logprobs(logits, prompt_ids, 1)[1:] if lp is not None]


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return Engine(model)


def stream_choices(client: OpenAI, model: str, progress: threading.Event | None = None) -> dict[int, dict]:
    """The streamed ``n = 2`` request: per choice index, its text, token texts and log probabilities."""
    out: dict[int, dict] = {i: {"text": "", "tokens": [], "logprobs": [], "finish": None} for i in range(2)}
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, n=2, stream=True, **CONTROLS)
    for chunk in stream:
        for choice in chunk.choices:
            got = out[choice.index]
            got["text"] += choice.text
            if choice.logprobs is not None:
                got["tokens"] += choice.logprobs.tokens or []
                got["logprobs"] += choice.logprobs.token_logprobs or []
            if choice.finish_reason is not None:
                got["finish"] = choice.finish_reason
        if progress is not None and len(out[0]["tokens"]) >= 6:
            progress.set()
    return out


def check_choices(got: dict[int, dict], engine: Engine, launcher) -> None:
    prompt_ids = engine.tokenizer.encode(PROMPT)
    for index in range(2):
        ref = engine.choice(prompt_ids, index)
        texts = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
        assert got[index]["tokens"] == texts, f"choice {index}\n{logs(launcher)}"
        assert got[index]["text"] == engine.tokenizer.decode(ref.token_ids)
        assert got[index]["logprobs"] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=TOLERANCE)
    assert got[0]["tokens"] != got[1]["tokens"]  # two seed streams


@pytest.mark.parametrize(
    "deployment",
    [
        pytest.param(dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2), id="1P+2T"),
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1, token_microbatch=2), id="colocated-1"),
    ],
)
def test_penalised_n2_stream_with_logprobs_and_echo(deployment, redis_url, model, engine: Engine) -> None:
    settings = cluster_settings(redis_url, model, **deployment)
    with running(settings) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)
        check_choices(stream_choices(client, settings.model.name), engine, launcher)
        # lm-evaluation-harness's loglikelihood request: the prompt's own log probabilities
        prompt_ids = engine.tokenizer.encode(PROMPT)
        scored = client.completions.create(
            model=settings.model.name, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        values = scored.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
        assert values is not None and values[0] is None and len(values) == len(prompt_ids)
        assert values[1:] == pytest.approx(engine.prompt_logprobs(prompt_ids), abs=TOLERANCE)
        assert scored.usage is not None and scored.usage.completion_tokens == 0


@pytest.mark.parametrize(
    "deployment",
    [
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=2, token_microbatch=2), id="colocated-2"),
        pytest.param(dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2), id="1P+2T"),
    ],
)
def test_a_token_stage_killed_mid_stream_resumes_every_choice_exactly(
    deployment, redis_url, model, engine: Engine
) -> None:
    """Two token stages and a spare: SIGKILL the last token stage (the one that samples and keeps each row's
    history) while the penalised n = 2 stream is under way; the spare takes it over, rebuilds the histories from
    the token streams, and both choices (tokens and log probabilities) equal the failure-free run."""
    settings = cluster_settings(redis_url, model, **deployment)
    with running(settings, spares=1) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)
        victim = token_stage_worker(settings, 1)
        got = killed_mid_stream(launcher, victim, lambda seen: stream_choices(client, settings.model.name, seen))
        check_choices(got, engine, launcher)

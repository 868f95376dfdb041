"""Structured outputs through real workers and the official openai client: a JSON-schema chat answer is JSON
that satisfies the schema, token for token the in-process engine's; and a constrained, penalised, seeded
``n = 2`` stream with log probabilities whose last token stage is SIGKILLed mid-stream resumes every choice
exactly (the spare rebuilds each row's grammar state from its delivered tokens)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from dejavu_common.messages import GrammarKind, GrammarSpec, SamplingSpec
from dejavu_common.settings import Mode
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.generate import Completion, Request, generate_batch
from dejavu_engine.pipeline import Pipeline

from .cluster import cluster_settings, killed_mid_stream, logs, running, token_stage_worker

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

QUESTION = "Invent a character for a story: give their name, age, home city and a one-sentence story."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "story": {"type": "string", "minLength": 20, "maxLength": 160},
    },
    "required": ["name", "age", "city", "story"],
}
MAX_TOKENS = 120
SEED = 77
# What the request asks (the API's fields) and the spec the workers sample each choice with.
CONTROLS: dict[str, Any] = {
    "temperature": 0.8,
    "frequency_penalty": 0.4,
    "logprobs": True,
    "top_logprobs": 2,
    "seed": SEED,
    "max_tokens": MAX_TOKENS,
    "response_format": {"type": "json_schema", "json_schema": {"name": "character", "schema": SCHEMA, "strict": True}},
}
SPEC = SamplingSpec(
    max_tokens=MAX_TOKENS,
    temperature=0.8,
    frequency_penalty=0.4,
    logprobs=2,
    seed=SEED,
    grammar=GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=json.dumps(SCHEMA)),
)
TOLERANCE = 1e-4  # as tests/system/test_sampling_features.py: batching and paging move float32 by a few 1e-5


class Engine:
    """The failure-free reference: the staged engine in this process, one row at a time."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.pipeline = Pipeline(model, 1)
        self.prompt_ids = tuple(self.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))

    def choice(self, index: int) -> Completion:
        request = Request(self.prompt_ids, SPEC.for_choice(index), self.pipeline.spec.eos_token_ids)
        (completion,), _ = generate_batch(self.pipeline, [request])
        return completion


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return Engine(model)


def stream_choices(client: OpenAI, model: str, progress: threading.Event | None = None) -> dict[int, dict]:
    """The streamed ``n = 2`` chat: per choice index, its text, token texts, log probabilities and finish."""
    out: dict[int, dict] = {i: {"text": "", "tokens": [], "logprobs": [], "finish": None} for i in range(2)}
    messages = [{"role": "user", "content": QUESTION}]
    stream = client.chat.completions.create(model=model, messages=messages, n=2, stream=True, **CONTROLS)  # type: ignore[call-overload]
    for chunk in stream:
        for choice in chunk.choices:
            got = out[choice.index]
            got["text"] += choice.delta.content or ""
            for entry in (choice.logprobs.content or []) if choice.logprobs is not None else []:
                got["tokens"].append(entry.token)
                got["logprobs"].append(entry.logprob)
            if choice.finish_reason is not None:
                got["finish"] = choice.finish_reason
        if progress is not None and len(out[0]["tokens"]) >= 8:
            progress.set()
    return out


def check_choices(got: dict[int, dict], engine: Engine, launcher: Any) -> None:
    for index in range(2):
        ref = engine.choice(index)
        texts = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
        assert got[index]["tokens"] == texts, f"choice {index}\n{logs(launcher)}"
        assert got[index]["logprobs"] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=TOLERANCE)
        assert got[index]["finish"] == "stop"  # the grammar completed, then allowed EOS
        jsonschema.validate(json.loads(got[index]["text"]), SCHEMA)
    assert got[0]["text"] != got[1]["text"]  # two seed streams


@pytest.mark.parametrize(
    "deployment",
    [
        pytest.param(dict(prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2), id="1P+2T"),
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1, token_microbatch=2), id="colocated-1"),
    ],
)
def test_json_schema_chat_is_valid_json_equal_to_the_engine(
    deployment: dict[str, Any], redis_url: str, model: Path, engine: Engine
) -> None:
    settings = cluster_settings(redis_url, model, **deployment)
    with running(settings) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)
        check_choices(stream_choices(client, settings.model.name), engine, launcher)
        whole = client.chat.completions.create(
            model=settings.model.name,
            messages=[{"role": "user", "content": "Say yes or no."}],
            max_tokens=8,
            temperature=0,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert whole.choices[0].message.content in ("yes", "no")
        assert whole.choices[0].finish_reason == "stop"
        check_tool_calls(client, settings.model.name)
        check_refused(client, settings.model.name)


def check_refused(client: OpenAI, model: str) -> None:
    """A regex the gateway's checks let through but the grammar engine cannot compile (a word boundary) is a 400
    with the engine's reason, streamed and not, before anything is sent; the server answers on."""
    messages: Any = [{"role": "user", "content": "Say foo."}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="Word boundary") as refused:
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, stream=stream, extra_body={"guided_regex": r"\bfoo\b"}
            )
        assert refused.value.code == "invalid_grammar"
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content


WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def check_tool_calls(client: OpenAI, model: str) -> None:
    """A named function and ``required``: the model's calls parse, name offered functions and their arguments
    satisfy the functions' schemas (the grammar enforces it), streamed and not."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0
    )
    [call] = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        seed=3,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                got = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                got["name"] += delta.function.name or ""
                got["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for got in calls.values():
        jsonschema.validate(json.loads(got["arguments"]), schemas[got["name"]])


def test_a_token_stage_killed_mid_constrained_stream_resumes_every_choice_exactly(
    redis_url: str, model: Path, engine: Engine
) -> None:
    """Two token stages and a spare, colocated: SIGKILL the last token stage (the one that samples, with each
    row's grammar matcher) while the constrained n = 2 stream is under way; the spare takes over, rebuilds the
    rows' histories (and so their grammar states) from the token streams, and both choices equal the
    failure-free run, log probabilities included."""
    settings = cluster_settings(redis_url, model, mode=Mode.COLOCATED, token_depth=2, token_microbatch=2)
    with running(settings, spares=1) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)
        victim = token_stage_worker(settings, 1)
        got = killed_mid_stream(launcher, victim, lambda seen: stream_choices(client, settings.model.name, seen))
        check_choices(got, engine, launcher)

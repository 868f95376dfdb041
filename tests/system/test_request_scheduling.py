"""A request-scheduled pipeline (one colocated stage, the default deployment, or token stages fed by a prompt
pipeline) batches requests of any lengths together and survives a SIGKILL of a token worker with exact streams.

Each request has its own positions and blocks, so a short request batched beside a long prompt gets every token it
asked for, and a chat turn without ``max_tokens`` gets the rest of the context, not what is left of a padded
microbatch's span. A token worker is killed mid-answer: on one colocated stage, the spare that takes it over
continues every stream from its token stream (its prompt and delivered tokens recomputed in one go); on two token
stages fed by a prompt pipeline, the replacement is restored from its peer's replica and every request resumes
where the stages' KV reaches. Each text equals the failure-free one.
"""

from __future__ import annotations

import re
import threading

import pytest
from openai import OpenAI

from dejavu_common.messages import SamplingSpec
from dejavu_common.settings import Mode

from .cluster import cluster_settings, logs, running
from .reference import Reference
from .test_failures import _holder, _kill, _replaced, _wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

CONTEXT = 2048
LONG = "The history of the city is long and full of quiet change. " * 150  # ~1,800 tokens
SHORT = "Count with me: one, two, three,"  # ~10 tokens
CHAT = "Write a short poem about the sea."


@pytest.mark.parametrize(
    ("deployment", "killed"),
    [
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1), 0, id="colocated-1"),
        # A prompt pipeline streams each prompt's KV to two token stages, each replicating what every pass wrote
        # to the other: the last token stage is killed and its replacement restored from stage 0's replica; each
        # request resumes from the positions both stages hold, the tokens published meanwhile read back.
        pytest.param(dict(prompt_depth=1, token_depth=2, prompt_microbatch=2), 1, id="1P+2T"),
    ],
)
def test_short_and_long_requests_share_passes_and_survive_a_sigkill(redis_url, model, deployment, killed) -> None:
    settings = cluster_settings(redis_url, model, token_microbatch=4, **deployment)
    depth = settings.controller.token_depth
    settings.engine.max_context = CONTEXT
    ref = Reference(model)
    long_len = len(ref.tokenizer.encode(LONG))
    chat_len = len(ref.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}]))
    assert 1700 < long_len < CONTEXT - 16
    expected = {
        "long": ref.text(LONG, 16),
        "short": ref.text(SHORT, 600, ignore_eos=True),
        "chat": ref.text(CHAT, CONTEXT - chat_len, chat=True),
    }
    with running(settings, spares=1) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="x", timeout=300, max_retries=0)
        name = settings.model.name
        texts: dict[str, str] = {}
        finishes: dict[str, str | None] = {}
        errors: list[BaseException] = []
        streamed = threading.Semaphore(0)

        def run(key: str, create) -> None:
            try:
                parts = []
                for chunk in create():
                    for choice in chunk.choices:
                        parts.append(getattr(choice, "text", None) or getattr(choice.delta, "content", None) or "")
                        finishes[key] = choice.finish_reason or finishes.get(key)
                    if key == "short":
                        streamed.release()
                texts[key] = "".join(parts)
            except BaseException as exc:  # asserted below
                errors.append(exc)

        common = dict(model=name, temperature=0, stream=True)
        jobs = {
            "long": lambda: client.completions.create(prompt=LONG, max_tokens=16, **common),
            "short": lambda: client.completions.create(
                prompt=SHORT, max_tokens=600, extra_body={"ignore_eos": True}, **common
            ),
            "chat": lambda: client.chat.completions.create(messages=[{"role": "user", "content": CHAT}], **common),
        }
        threads = [threading.Thread(target=run, args=(key, job), daemon=True) for key, job in jobs.items()]
        for t in threads:
            t.start()
        for _ in range(60):  # the short answer is streaming beside the others: kill the worker mid-answer
            assert streamed.acquire(timeout=120), f"no progress\n{logs(launcher)}"
        victim = _holder(settings, killed)
        _kill(launcher, victim)
        for t in threads:
            t.join(300)
            assert not t.is_alive(), "a request hung"
        assert not errors, f"{errors}\n{logs(launcher)}"
        _replaced(settings, [victim])
        _wait_ready(launcher.api_url)
        for key, text in expected.items():
            assert texts[key] == text, f"{key}: {texts[key]!r}\n!=\n{text!r}\n{logs(launcher)}"
        assert finishes["short"] == "length" and finishes["long"] in ("length", "stop")
        text = logs(launcher, tail=None)
        assert "request scheduling: a paged pool" in text
        if depth > 1:  # the streaming request resumed from the replicas (a prompt still computing re-runs)
            assert re.search(r"resumed requests \[\d+", text), text[-4000:]


@pytest.mark.parametrize(
    ("deployment", "reader"),
    [
        pytest.param(dict(mode=Mode.COLOCATED, token_depth=1), "token", id="colocated-1"),
        # Two prompt stages over pools whose ids prompt stage 0's book hands out: the history's blocks are found
        # there and every prompt stage computes only the new message, in chunks of 48 positions (passes of a task
        # of 48 prompt tokens at most) that both prompt stages compute at once.
        pytest.param(dict(prompt_depth=2, token_depth=1, prompt_microbatch=2), "prompt", id="2P+1T"),
    ],
)
def test_a_multi_turn_chat_reads_its_history_from_the_prefix_cache(redis_url, model, capsys, deployment, reader):
    """Three turns of one conversation through the official client, each re-sending the whole history: every
    answer equals the in-process engine's for that history, and from the second turn on the stage that computes
    prompts (the colocated stage, or prompt stage 0) finds the history's blocks cached (its prefix-cache metrics
    count the hit tokens), so it computes only the new message."""
    import json

    from dejavu_cli.main import main as dejavu
    from dejavu_engine.generate import Request, generate_batch

    from .test_metrics import _scrape, _total

    settings = cluster_settings(redis_url, model, token_microbatch=4, worker={"metrics_port": 0}, **deployment)
    settings.controller.prompt_task_tokens = 48
    ref = Reference(model)

    def expected(messages: list[dict]) -> str:
        ids = ref.tokenizer.apply_chat_template(messages)
        request = Request(tuple(ids), SamplingSpec(max_tokens=24, temperature=0), ref.eos)
        (completion,), _ = generate_batch(ref.pipeline, [request])
        return ref.tokenizer.decode(completion.token_ids)

    with running(settings) as launcher:
        client = OpenAI(base_url=launcher.api_url + "/v1", api_key="x", timeout=120, max_retries=0)
        capsys.readouterr()
        assert dejavu(["admin", "--redis-url", redis_url, "status", "--json"]) == 0
        workers = json.loads(capsys.readouterr().out)["workers"]
        (worker,) = [w for w in workers.values() if (w["role"], w["stage"]["stage"]) == (reader, 0)]
        messages: list[dict] = [{"role": "system", "content": "You are a patient teacher of geography. " * 6}]
        hits = []
        for question in ("Where is Lyon?", "And what river runs through it?", "Name a dish from there."):
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(
                model=settings.model.name, messages=messages, max_tokens=24, temperature=0
            )
            answer = reply.choices[0].message.content
            assert answer == expected(messages), logs(launcher)
            messages.append({"role": "assistant", "content": answer})
            _names, scraped = _scrape(worker["metrics_url"])
            hits.append(_total(scraped, "dejavu_prefix_cache_hits_tokens_total"))
        history = len(ref.tokenizer.apply_chat_template(messages[:3])) // 16 * 16
        assert hits[0] == 0 and hits[1] - hits[0] >= history - 32 and hits[2] > hits[1], hits
        if reader == "prompt":  # a task of a prompt longer than 48 uncached positions ran in several passes
            assert _total(scraped, "dejavu_stage_pass_seconds_count", kind="prefill") > 3, logs(launcher)

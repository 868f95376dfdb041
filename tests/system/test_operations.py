"""Operations on a running deployment that must not look like failures to clients, or that must be
survived: Redis restarted empty, a worker drained (SIGTERM) during generation."""

from __future__ import annotations

import signal
import time

import openai
import pytest
import redis

from dejavu_common import keys

from .cluster import cluster_settings, logs, running
from .reference import Reference
from .test_failures import MAX_TOKENS, PROMPTS, Round

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(model):
    ref = Reference(model)
    return {p: ref.text(p, MAX_TOKENS) for p in PROMPTS}


def test_redis_restarted_empty_mid_traffic(own_redis, model, reference) -> None:
    """Redis SIGKILLed mid-traffic and restarted empty on the same port (as ``dejavu up`` runs it: no
    persistence): every in-flight request ends, exactly or with an OpenAI-style error, none hangs; the
    workers register again, the controller publishes a fresh pipeline, and the service answers exactly
    again without any process being restarted."""
    settings = cluster_settings(
        own_redis.url, model, prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2
    )
    with running(settings) as launcher:
        epoch = int(redis.Redis.from_url(own_redis.url).get(keys.EPOCH))
        r = Round(launcher, settings)
        r.wait_tokens(6)
        lost_at = time.monotonic()
        own_redis.restart(down_s=1.0)
        r.finish_with_errors(timeout_s=120)
        for prompt, text in r.texts.items():
            assert text == reference[prompt], f"{prompt!r}: {text!r}\n{logs(launcher)}"
        assert len(r.texts) + len(r.errors) == len(PROMPTS)
        assert all(isinstance(e, openai.APIError) for e in r.errors), r.errors
        launcher.wait_ready(60)
        back = time.monotonic() - lost_at
        texts = Round(launcher, settings).finish(timeout_s=120)
        assert texts == reference, logs(launcher)
        assert int(redis.Redis.from_url(own_redis.url).get(keys.EPOCH)) > epoch  # epochs went on, not back
        assert all(c.restarts == 0 and c.proc.poll() is None for c in launcher.children), logs(launcher)
        print(f"service ready again {back:.1f} s after Redis was killed; {len(r.errors)} of {len(PROMPTS)} failed")


def test_a_token_worker_drained_by_sigterm_during_generation_hands_its_stage_over(redis_url, model, reference):
    """SIGTERM (a rolling update) to a token stage while requests stream: it serves on until the
    controller has given its stage to the spare, then leaves with exit code 0; no client sees an error."""
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2
    )
    with running(settings, spares=1) as launcher:
        r = Round(launcher, settings)
        r.wait_tokens(6)
        drained = launcher.child("t1").proc
        drained.send_signal(signal.SIGTERM)
        assert r.finish(timeout_s=120) == reference, logs(launcher)
        assert drained.wait(settings.recovery.drain_timeout_s + 10) == 0, logs(launcher)
        assert "handing over the stages of draining ['t1']" in logs(launcher, tail=None)
        assert Round(launcher, settings).finish(timeout_s=120) == reference, logs(launcher)

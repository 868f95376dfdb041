"""A transient fault at token stage 0 while requests stream (real processes, real Redis): the worker pauses,
serves the same epoch again and continues what it holds, so every request completes with the failure-free
output of the in-process engine (each token exactly once, in order), none hangs, and the controller's
slots come back (a following round is served in full)."""

from __future__ import annotations

import re
import time

import pytest
import redis

from dejavu_common.settings import Mode

from .cluster import cluster_settings, logs, running
from .reference import Reference
from .test_failures import MAX_TOKENS, PROMPTS, Round, _check

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(model):
    ref = Reference(model)
    return {p: ref.text(p, MAX_TOKENS) for p in PROMPTS}


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.01)


# What each depth's worker logs: stage 0 alone (it samples and publishes) runs the broken pass's microbatches
# again from their streams; with two stages, the last stage (a follower) handles the broken pass again.
AGAIN = {
    1: r"run again from their token streams",
    # The last stage answers the pass it could not publish broken; stage 0 runs its requests again.
    2: r"the last stage could not publish its tokens\): requests .* run again from their token streams",
}


@pytest.mark.parametrize("token_depth", [1, 2])
def test_redis_refusing_writes_mid_generation_loses_no_request(redis_url, model, reference, token_depth) -> None:
    """Redis at ``maxmemory`` refuses the token workers' writes (their tokens, their state) for a moment: the
    stage that publishes the tokens breaks a pass on an OOM error. Every request still completes exactly;
    the worker logged serving its epoch again and running the broken pass again, not starting over."""
    # Leases outlive the fault (their renewals are writes too): this test is about the worker's retry,
    # not about failure detection.
    settings = cluster_settings(
        redis_url,
        model,
        mode=Mode.COLOCATED,
        token_depth=token_depth,
        token_microbatch=2,
        recovery={"lease_ttl_s": 6.0},
    )
    client = redis.Redis.from_url(redis_url)
    with running(settings) as launcher:
        r = Round(launcher, settings)
        r.wait_tokens(6)
        try:
            client.config_set("maxmemory", 1)  # below what Redis holds: every write that may grow it fails
            # Until a serving loop itself broke on it (another thread's write, such as a replica receiver's
            # watermark, may meet the error first and is retried on its own).
            _until(
                lambda: re.search(r"serving epoch \d+ failed \(OutOfMemoryError", logs(launcher, tail=None)),
                10.0,
                "no serving loop hit an OOM error",
            )
        finally:
            client.config_set("maxmemory", 0)
        _check(r.finish(timeout_s=90), reference, launcher)
        text = logs(launcher, tail=None)
        assert re.search(r"serving epoch \d+ again: continuing what this stage holds", text), logs(launcher)
        assert re.search(AGAIN[token_depth], text), logs(launcher)
        _check(Round(launcher, settings).finish(timeout_s=90), reference, launcher)  # every slot came back

"""Failures of real worker processes while requests stream: the pipeline is repaired and resumes.

Every case checks that all requests complete, that each streamed text equals the failure-free
output of the in-process engine (so every token arrived exactly once, in order), and that nothing
hangs (every client call has a deadline).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time

import httpx
import pytest
import redis
from openai import OpenAI

from dejavu_common import keys
from dejavu_common.admin import sign
from dejavu_common.messages import AdminAction, WorkerInfo
from dejavu_common.settings import Mode, Replication, Settings

from .cluster import cluster_settings, logs, running
from .reference import Reference

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def reference(model):
    ref = Reference(model)
    return {p: ref.text(p, MAX_TOKENS) for p in PROMPTS}


class Round:
    """Stream every prompt concurrently; ``wait_tokens`` blocks until that many chunks arrived."""

    def __init__(self, launcher, settings) -> None:
        # Like a client honouring 503 + Retry-After: a round that follows a failure starts once the repair
        # is over (a round that finished before its failure was even detected would otherwise be refused).
        _wait_ready(launcher.api_url)
        self.launcher = launcher
        self.client = OpenAI(base_url=launcher.api_url + "/v1", api_key="x", timeout=180, max_retries=0)
        self.model = settings.model.name
        self.texts: dict[str, str] = {}
        self.errors: list[BaseException] = []
        self.chunks = 0
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._one, args=(p,), daemon=True) for p in PROMPTS]
        for t in self.threads:
            t.start()

    def _one(self, prompt: str) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            parts = []
            for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                with self.cond:
                    self.chunks += 1
                    self.cond.notify_all()
            self.texts[prompt] = "".join(parts)
        except BaseException as exc:  # recorded and asserted by the test
            self.errors.append(exc)

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.chunks >= n, timeout_s), "requests made no progress"

    def finish_with_errors(self, timeout_s: float = 60) -> None:
        """Wait for requests that are expected to fail (their server died); they must not hang."""
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a request hung"

    def finish(self, timeout_s: float = 240) -> dict[str, str]:
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a request hung"
        assert not self.errors, f"{self.errors}\n{logs(self.launcher)}"
        return self.texts


def _wait_ready(api_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(api_url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"not ready again within {timeout_s} s")


def _kill(launcher, worker_id: str) -> None:
    os.kill(launcher.child(worker_id).proc.pid, signal.SIGKILL)


def _holder(settings: Settings, stage: int) -> str:
    """The worker holding token stage ``stage`` in the current topology."""
    from dejavu_common.messages import Topology

    raw = redis.Redis.from_url(settings.redis.url).get(keys.TOPOLOGY)
    return Topology.decode(raw).token_stages[stage].worker_id


def _replaced(settings: Settings, workers: list[str], timeout_s: float = 60.0) -> None:
    """Wait until the topology names none of ``workers``: their failure was detected and a repair
    published. The next round then starts after it (``Round`` waits for /ready), not in the moment
    between a failure and its detection, where /ready still says yes and the round's requests would be
    refused with 503 a few milliseconds later: a round of 20 tokens can finish within a lease TTL."""
    from dejavu_common.messages import Topology

    client = redis.Redis.from_url(settings.redis.url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        topology = Topology.decode(client.get(keys.TOPOLOGY))
        holders = {a.worker_id for a in (*topology.prompt_stages, *topology.token_stages)}
        if not holders & set(workers):
            return
        time.sleep(0.05)
    raise AssertionError(f"{workers} still in the topology after {timeout_s} s")


def _check(texts: dict[str, str], reference: dict[str, str], launcher) -> None:
    for p in PROMPTS:
        assert texts.get(p) == reference[p], f"{p!r}: {texts.get(p)!r} != {reference[p]!r}\n{logs(launcher)}"


def test_middle_last_and_first_token_stage_crashes(redis_url, model, reference) -> None:
    """Colocated 3-stage pipeline with spares, KV in paged pools: SIGKILL the middle, then the last, then
    the first stage, each at a random decode step of a new round of requests. The spare that takes stage 0 over
    resumes the requests in the blocks stage 1 holds them in (not from their prompts)."""
    rng = random.Random(7)
    settings = cluster_settings(redis_url, model, mode=Mode.COLOCATED, token_depth=3, token_microbatch=2)
    settings.engine.kv_block_size = 16
    # One spare more than the kills: a victim killed while writing into a survivor's shared-memory receive
    # FIFO wedges it, and the survivor then ends itself to be replaced too (DataEndpoint.check_receive_path).
    with running(settings, spares=4) as launcher:
        for stage in (1, 2, 0):
            victim = _holder(settings, stage)
            r = Round(launcher, settings)
            r.wait_tokens(rng.randint(4, 20))
            _kill(launcher, victim)
            _check(r.finish(), reference, launcher)
            _replaced(settings, [victim])
        assert re.search(r"took stage 0 over: resumed requests \[\d+", logs(launcher)), logs(launcher)[-4000:]


def test_paused_heartbeats_two_failures_and_a_failure_during_recovery(redis_url, model, reference) -> None:
    """Disaggregated 1P + 4T, KV in paged pools: a hung worker (heartbeats paused beyond the lease) is
    fenced and replaced; two non-adjacent stages die together; a third dies while the pipeline is being
    repaired."""
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=4, prompt_microbatch=2, token_microbatch=2
    )
    settings.engine.kv_block_size = 8  # paged pools: restores and replicas placed into blocks
    # Five failures need five replacements, and two simultaneous deaths may be detected in two repairs that
    # take one more: a fifth spare keeps the last failure from waiting for a worker that never comes.
    with running(settings, spares=5) as launcher:
        client = redis.Redis.from_url(settings.redis.url)
        # 1. A paused worker: its lease expires, a spare takes over, and it is fenced afterwards.
        _pause_mid_round(launcher, settings, reference, 2)
        # 2. Two non-adjacent failures at once.
        r = Round(launcher, settings)
        r.wait_tokens(8)
        victims = [_holder(settings, 0), _holder(settings, 2)]
        for victim in victims:
            _kill(launcher, victim)
        _check(r.finish(), reference, launcher)
        _replaced(settings, victims)
        # 3. A failure during recovery: kill stage 3, then stage 1 as soon as the repair epoch appears.
        r = Round(launcher, settings)
        r.wait_tokens(5)
        epoch = int(client.get(keys.EPOCH))
        _kill(launcher, _holder(settings, 3))
        deadline = time.monotonic() + 30
        while int(client.get(keys.EPOCH)) == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        _kill(launcher, _holder(settings, 1))
        _check(r.finish(), reference, launcher)


def _pause(settings: Settings, worker_id: str, seconds: float) -> None:
    """Order ``worker_id`` (signed, over Redis) to stop its heartbeats for ``seconds``: it looks hung."""
    client = redis.Redis.from_url(settings.redis.url)
    info = WorkerInfo.decode(client.hget(keys.worker(worker_id), "info"))
    signing = settings.admin.signing_key.get_secret_value()
    cmd = sign(signing, worker_id, info.instance, AdminAction.PAUSE_HEARTBEATS, seconds=seconds)
    client.xadd(keys.ADMIN_STREAM, {"cmd": cmd.encode()})


def _pause_mid_round(launcher, settings: Settings, reference: dict[str, str], stage: int) -> str:
    """A round in which the holder of token stage ``stage`` looks hung; returns it once it is replaced."""
    r = Round(launcher, settings)
    r.wait_tokens(6)
    paused = _holder(settings, stage)
    _pause(settings, paused, 4.0)
    _check(r.finish(), reference, launcher)
    _replaced(settings, [paused])
    return paused


def test_a_worker_takes_stage_0_back_after_another_held_it(redis_url, model, reference) -> None:
    """Stage 0's holder looks hung, a spare takes the stage over and serves a round; then the spare looks
    hung mid-round and the first worker, alive all along, takes stage 0 back with its layers still loaded.
    It must read only prompts announced from then on: the earlier ones are the other holder's (ended, or
    resuming through this recovery). Reading them again held the chaos benchmark's pipeline for 23 s and
    would admit a resumed microbatch twice."""
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2
    )
    with running(settings, spares=1) as launcher:
        first = _pause_mid_round(launcher, settings, reference, 0)
        _check(Round(launcher, settings).finish(), reference, launcher)  # announced while `first` is away
        r = Round(launcher, settings)
        r.wait_tokens(6)
        second = _holder(settings, 0)
        _pause(settings, second, 4.0)
        _replaced(settings, [second])
        assert _holder(settings, 0) == first
        _check(r.finish(), reference, launcher)
        _check(Round(launcher, settings).finish(), reference, launcher)
        # It read no announcement of a microbatch that had ended meanwhile (it used to wait 10 s for each).
        stale = re.compile(r"dropped (a ready entry|the announcement of microbatch)")
        assert not stale.search((launcher.log_dir / f"{first}.log").read_text()), logs(launcher)


def test_adjacent_failures_and_prompt_worker_crash_fall_back_to_prompts(redis_url, model, reference) -> None:
    """When a replica is lost with its stage (two adjacent stages die), the microbatches re-run their
    prompts; a dead prompt worker's microbatches re-run on a spare prompt worker."""
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=3, prompt_microbatch=2, token_microbatch=2
    )
    with running(settings, spares=2, prompt_spares=1) as launcher:
        r = Round(launcher, settings)
        r.wait_tokens(6)
        victims = [_holder(settings, 1), _holder(settings, 2)]
        for victim in victims:
            _kill(launcher, victim)
        _check(r.finish(), reference, launcher)
        _replaced(settings, victims)
        r = Round(launcher, settings)
        time.sleep(0.3)  # the prompts are being processed
        _kill(launcher, "p0")
        _check(r.finish(), reference, launcher)


def test_a_colocated_stage_crash_re_runs_every_microbatch_on_a_spare(redis_url, model, reference) -> None:
    """One colocated stage (no replica survives it) dies mid-round: the spare that takes the stage
    prefills every microbatch again, each as one task whatever its size (an idle pipeline's first request
    forms a microbatch alone; re-runs of uneven microbatches once reached the stage packed across them,
    and the task ended every worker that took it)."""
    settings = cluster_settings(redis_url, model, mode=Mode.COLOCATED, token_depth=1, token_microbatch=3)
    with running(settings, spares=1) as launcher:
        victim = _holder(settings, 0)
        r = Round(launcher, settings)
        r.wait_tokens(5)
        _kill(launcher, victim)
        _check(r.finish(), reference, launcher)
        _replaced(settings, [victim])
        _check(Round(launcher, settings).finish(), reference, launcher)


def test_swapping_with_disk_replicas_and_disaggregation_recovers(redis_url, model, reference, tmp_path) -> None:
    """Token stages that swap microbatch caches to host memory and keep their predecessor's replica on
    disk (DejaVuLib's disk transport, no host memory): outputs equal the engine's, before and after a
    stage crash, whose caches come back from its successor's disk."""
    settings = cluster_settings(
        redis_url,
        model,
        prompt_depth=1,
        token_depth=3,
        prompt_microbatch=2,
        token_microbatch=2,
        swap={"enabled": True},
        recovery={"replication": Replication.DISK, "replica_dir": tmp_path},
    )
    with running(settings, spares=1) as launcher:
        r = Round(launcher, settings)
        _check(r.finish(), reference, launcher)
        assert any(tmp_path.rglob("*.kv")), "no replica chunk was written to disk"
        r = Round(launcher, settings)
        r.wait_tokens(8)
        victim = _holder(settings, 1)
        _kill(launcher, victim)
        _check(r.finish(), reference, launcher)
        assert any("swapping on" in p.read_text() for p in launcher.log_dir.glob("t*.log"))
        restored = re.compile(r"sent \S+ its caches of microbatches \{\d")  # from the successor's disk
        assert any(restored.search(p.read_text()) for p in launcher.log_dir.glob("t*.log"))
    # Chunks go with their microbatches, a worker that stops removes its folder, and the killed worker's
    # was removed by the spare's store, which opened after it died: nothing is left but the empty leases.
    assert [p.name for p in tmp_path.iterdir()] == [".owners"] and not any((tmp_path / ".owners").iterdir())


def test_a_restarted_controller_clears_stale_work_and_serves_again(redis_url, model, reference) -> None:
    """The controller dies (its clients with it) and a new one starts against the same Redis and the
    same, still running, workers: the stale queues are dropped and new requests are served exactly."""
    settings = cluster_settings(
        redis_url, model, prompt_depth=1, token_depth=2, prompt_microbatch=2, token_microbatch=2
    )
    with running(settings) as launcher:
        r = Round(launcher, settings)
        r.wait_tokens(4)
        controller = launcher.child("controller")
        controller.proc.kill()
        controller.proc.wait(10)
        r.finish_with_errors()
        launcher._spawn(controller)
        launcher.wait_ready(120)
        _check(Round(launcher, settings).finish(), reference, launcher)

"""The controller's loops end when cancelled, whenever the cancellation lands. Python 3.11's
``asyncio.wait_for`` swallows a cancellation that lands in the same moment as the awaited operation
finishes: in the dispatch loop's own wake-up wait once (seen in CI: ``asyncio.run`` waiting forever in
``_cancel_all_tasks``), and inside redis-py, which sends every command through ``wait_for`` when the
client has a socket timeout (seen in CI: a leader's lease-keeping loop went on after its controller
shut down, and the standby never took over). Each loop turn is a cancellation point, and shutting the
backend down has a deadline that names a task that still would not end."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from dejavu_common.settings import Settings
from dejavu_controller import pipeline_backend
from dejavu_controller.leadership import Leadership
from dejavu_controller.pipeline_backend import PipelineBackend


def test_the_dispatch_loop_always_ends_when_cancelled(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        base = Settings()
        settings = base.model_copy(update={"controller": base.controller.model_copy(update={"batch_wait_ms": 1.0})})
        backend = PipelineBackend(settings, r, n_layers=6)
        for i in range(300):
            loop = asyncio.create_task(backend._dispatch_loop())
            await asyncio.sleep(0.001 * (i % 7) / 3)  # cancellations at many points of the wait's period
            if i % 2:
                backend._wake.set()  # ... and with a wake-up in the same moment
            loop.cancel()
            done, _ = await asyncio.wait({loop}, timeout=2)
            assert done, f"the dispatch loop ignored cancellation {i}"
        await r.aclose()

    asyncio.run(scenario())


async def _swallowing_call(finished: asyncio.Future) -> None:
    """A Redis call as redis-py makes it with a socket timeout: through ``wait_for``."""
    await asyncio.wait_for(finished, timeout=5)


def test_a_loop_ends_when_a_redis_call_swallowed_its_cancellation(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        lease = Leadership(r, "a:1", ttl_s=0.03)
        calls: list[asyncio.Future] = []

        async def renew() -> None:  # the lease renewal, stopped in its Redis call
            calls.append(asyncio.get_running_loop().create_future())
            await _swallowing_call(calls[-1])

        lease.renew = renew  # type: ignore[method-assign]
        keeping = asyncio.create_task(lease.keep())
        while not calls:
            await asyncio.sleep(0.005)
        calls[-1].set_result(None)  # the reply arrives ...
        keeping.cancel()  # ... in the same moment as the shutdown
        done, _ = await asyncio.wait({keeping}, timeout=2)
        assert done and keeping.cancelled(), "the lease-keeping loop went on after being cancelled"
        await r.aclose()

    asyncio.run(scenario())


def test_shutdown_has_a_deadline_and_names_a_task_that_ignores_cancellation(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pipeline_backend, "SHUTDOWN_DEADLINE_S", 0.2)

    let_go = False

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if let_go:
                    raise

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(Settings(), r, n_layers=6)
        task = asyncio.create_task(stubborn(), name="controller-stubborn")
        backend._tasks.append(task)
        await asyncio.sleep(0.01)  # it runs (a task cancelled before it starts never does)
        async with asyncio.timeout(5):
            await backend.__aexit__(None, None, None)
        assert not task.done()
        nonlocal let_go
        let_go = True
        task.cancel()
        await asyncio.wait({task}, timeout=2)
        await r.aclose()

    with caplog.at_level(logging.ERROR, logger="dejavu.controller"):
        asyncio.run(scenario())
    [record] = [r for r in caplog.records if "did not end" in r.getMessage()]
    assert "controller-stubborn" in record.getMessage() and "in stubborn" in record.getMessage()


def test_a_leader_cancelled_as_it_takes_the_lease_starts_no_loops_after_shutdown(redis_url: str) -> None:
    """Shutdown lands as the lease is granted (the cancellation swallowed in that Redis call): the
    backend must not go on to clear queues and start its loops, which would then act without a lease."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(Settings(), r, n_layers=6)
        granted: list[asyncio.Future] = []

        async def acquire(poll_s: float | None = None) -> None:
            granted.append(asyncio.get_running_loop().create_future())
            await _swallowing_call(granted[-1])

        backend.leadership.acquire = acquire  # type: ignore[method-assign]
        await backend.__aenter__()
        while not granted:
            await asyncio.sleep(0.005)
        granted[-1].set_result(None)  # the lease is granted ...
        await backend.__aexit__(None, None, None)  # ... in the same moment as the shutdown
        await asyncio.sleep(0.05)
        running = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("controller-")]
        assert running == [], f"still running after shutdown: {running}"
        await r.aclose()

    asyncio.run(scenario())

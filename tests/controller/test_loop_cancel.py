"""The controller's dispatch loop ends when cancelled, whenever the cancellation lands: its wake-up wait
must not swallow it. Python 3.11's ``asyncio.wait_for`` does when the awaited event is set in the same
moment (a request arriving as the controller shuts down): the loop then never ends and shutdown hangs
(seen in CI: ``asyncio.run`` waiting forever in ``_cancel_all_tasks``)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from dejavu_common.settings import Settings
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

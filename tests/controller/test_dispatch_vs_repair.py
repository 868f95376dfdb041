"""A dispatch never interleaves with a change of topology (the backend on a real Redis).

A microbatch formed and queued while the control loop is between publishing a new epoch and planning
its repair would be in neither the repair's plan nor a pipeline that keeps it: the workers drop, at
the resume point, every cache the plan does not name, and the request hangs. Here the change of
topology is held open at that point (deterministically, by an event), a request waits to be
dispatched meanwhile, and the dispatch loop must not form its microbatch until the change is done.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from dejavu_common.settings import Settings
from dejavu_controller.backend import GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend


def test_a_request_waiting_during_a_change_of_topology_is_dispatched_after_it(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        base = Settings()
        settings = base.model_copy(
            update={"controller": base.controller.model_copy(update={"token_microbatch": 1, "batch_wait_ms": 1.0})}
        )
        backend = PipelineBackend(settings, r, n_layers=6)
        backend._ready = True
        in_change, finish_change = asyncio.Event(), asyncio.Event()
        dispatched_at: list[str] = []  # what the change of topology had reached when each dispatch ran
        changes: list[str] = []

        async def topology_change(trust_leases: bool) -> None:  # publish the epoch ... plan the repair
            changes.append("published")
            in_change.set()
            await finish_change.wait()
            changes.append("planned")

        real_dispatch = backend._dispatch

        async def dispatch(mbs, write_specs=True):
            if mbs:
                dispatched_at.append(changes[-1] if changes else "before")
            await real_dispatch(mbs, write_specs)

        backend._topology_once = topology_change  # type: ignore[method-assign]
        backend._dispatch = dispatch  # type: ignore[method-assign]
        dispatcher = asyncio.create_task(backend._dispatch_loop())
        control = asyncio.create_task(backend._control_once())
        await asyncio.wait_for(in_change.wait(), 5)
        events = await backend.generate(GenerationRequest("r", (1, 2, 3), SamplingSpec(max_tokens=2)))
        await asyncio.sleep(0.3)  # many dispatch-loop wake-ups (batch_wait 1 ms) while the change is open
        assert backend.scheduler.queue_depth == 1 and not backend.scheduler.active, "formed during the change"
        finish_change.set()
        await asyncio.wait_for(control, 5)
        for _ in range(200):
            if backend.scheduler.active:
                break
            await asyncio.sleep(0.01)
        assert dispatched_at == ["planned"]  # dispatched once the repair was planned, never in between
        dispatcher.cancel()
        await events.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))

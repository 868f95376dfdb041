"""Work that keeps failing is failed to its clients, not re-run forever (the backend on a real Redis).

A microbatch that kills every worker taking it would otherwise be resumed or re-run by each repair,
kill the replacement, and loop. The backend counts the repairs a microbatch is in flight for without
delivering a token and, past ``controller.max_stalled_repairs``, fails its requests and tells the
workers (through the repair's resume point) to drop it.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from dejavu_common.messages import StageAssignment, Topology
from dejavu_common.settings import Settings
from dejavu_controller.backend import FinishReason, GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend


def _topology(epoch: int, holders: list[str]) -> Topology:
    return Topology(
        epoch=epoch,
        mode="disaggregated",
        n_layers=6,
        prompt_stages=(StageAssignment(worker_id="p0", stage=0, layers=(0, 6)),),
        token_stages=tuple(
            StageAssignment(worker_id=w, stage=i, layers=(3 * i, 3 * i + 3)) for i, w in enumerate(holders)
        ),
        prompt_microbatch=4,
        token_microbatch=4,
    )


def test_a_microbatch_stalled_across_repairs_is_failed_and_dropped(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        base = Settings()
        settings = base.model_copy(
            update={
                "controller": base.controller.model_copy(
                    update={"token_depth": 2, "token_microbatch": 1, "max_stalled_repairs": 2}
                )
            }
        )
        backend = PipelineBackend(settings, r, n_layers=6)
        backend._ready = True
        orders: list[tuple[list[int], list[int], list[int]]] = []

        async def repair_run(topology, replaced, resumable, not_started, redispatch, detected_at, metrics, dropped):
            orders.append((resumable, not_started, dropped))

        backend.repair.run = repair_run
        events = await backend.generate(
            GenerationRequest("poison", (1, 2, 3), SamplingSpec(max_tokens=4, temperature=0))
        )
        healthy = await backend.generate(GenerationRequest("ok", (4, 5), SamplingSpec(max_tokens=4, temperature=0)))
        poison_mb, healthy_mb = (m.spec.mb_id for m in backend.scheduler.form(now=1e9))
        # The healthy microbatch delivers a token between repairs; the poison one never does.
        for epoch in (2, 3, 4):
            old, new = _topology(epoch - 1, ["t0", "t1"]), _topology(epoch, ["s0", "t1"])
            backend._start_repair(new, backend._plan_repair(old, new, ["t0"]))
            await backend._repair_task
            req = backend.scheduler.active[healthy_mb].requests[0]
            req.deliver(epoch, 7, None)
        assert orders[0] == ([], [poison_mb, healthy_mb], [])
        assert orders[1] == ([], [poison_mb, healthy_mb], [])
        assert orders[2] == ([], [healthy_mb], [poison_mb])  # the third stalled repair drops it
        assert poison_mb not in backend.scheduler.active and healthy_mb in backend.scheduler.active
        failed = [ev async for ev in events]
        assert [ev.finish_reason for ev in failed] == [FinishReason.ERROR]
        assert backend.scheduler.active[healthy_mb].requests[0].output_ids == [7, 7, 7]
        await healthy.aclose()
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))

"""The controller's repair driver against a real Redis: the reports it waits for decide where each
microbatch resumes, and a replacement that could not restore its caches makes every prompt re-run at
once, not at the repair's deadline."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import ResumePoint, StageAssignment, StageProgress, Topology
from dejavu_common.settings import Settings
from dejavu_controller.repair import Repair

MBS = [10, 11]


def _topology(epoch: int) -> Topology:
    return Topology(
        epoch=epoch,
        mode="colocated",
        n_layers=6,
        token_stages=tuple(StageAssignment(worker_id=f"t{i}", stage=i, layers=(2 * i, 2 * i + 2)) for i in range(3)),
        prompt_microbatch=2,
        token_microbatch=2,
    )


async def _repair(redis_url: str, restored: bytes) -> tuple[ResumePoint, list[list[int]]]:
    """Stage 1 is replaced; the survivors report their progress and the replacement ``restored``. A
    deadline far beyond the test's own guard: a repair that waited it out would fail the test."""
    client = aioredis.Redis.from_url(redis_url)
    settings = Settings()
    settings = settings.model_copy(update={"transport": settings.transport.model_copy(update={"deadline_s": 3600.0})})
    repair = Repair(settings, client)
    epoch = 5
    for stage, done in ((0, {10: 7, 11: 4}), (2, {10: 6, 11: 4})):
        report = StageProgress(epoch=epoch, stage=stage, worker_id=f"t{stage}", done=done)
        await client.set(keys.progress(epoch, stage), report.encode())
    await client.hset(keys.watermark(1), mapping={10: 6, 11: 3})
    await client.set(keys.restored(epoch, 1), restored)
    rerun: list[list[int]] = []

    async def redispatch(mbs: list[int]) -> None:
        rerun.append(mbs)

    async with asyncio.timeout(60):
        plan = await repair.run(_topology(epoch), {1: "spare0"}, MBS, [], redispatch, 0.0)
    assert ResumePoint.decode(await client.get(keys.RESUME)) == plan
    await client.aclose()
    return plan, rerun


def test_a_restored_replacement_resumes_each_microbatch_past_its_slowest_stage(redis_url: str) -> None:
    plan, rerun = asyncio.run(_repair(redis_url, keys.RESTORED))
    assert plan.resume == {10: 7, 11: 4} and plan.rerun == () and rerun == []


def test_a_replacement_that_could_not_restore_re_runs_every_prompt_at_once(redis_url: str) -> None:
    plan, rerun = asyncio.run(_repair(redis_url, keys.RESTORE_FAILED))
    assert plan.resume == {} and plan.rerun == tuple(MBS) and rerun == [MBS]

"""The controller's repair driver against a real Redis: the reports it waits for decide where each
microbatch resumes, and a replacement that could not restore its caches makes every prompt re-run at
once, not at the repair's deadline."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import ResumePoint, StageAssignment, StageProgress, Topology
from dejavu_common.settings import Settings
from dejavu_common.signing import EntrySigner, public_key, seal, sign_watermark
from dejavu_controller.repair import Repair

MBS = [10, 11]
SIGNERS = {w: EntrySigner(w) for w in ("t0", "t1", "t2", "spare0")}  # stage holders and a spare


def _topology(epoch: int) -> Topology:
    return Topology(
        epoch=epoch,
        mode="colocated",
        n_layers=6,
        token_stages=tuple(StageAssignment(worker_id=f"t{i}", stage=i, layers=(2 * i, 2 * i + 2)) for i in range(3)),
        prompt_microbatch=2,
        token_microbatch=2,
    )


async def _watermark(client: aioredis.Redis, by: str | None, mb: int | str, signed: int | str, step=None) -> None:
    """Stage 1's watermark of ``mb``: ``step`` (default ``signed``), with ``by``'s signature of ``signed``
    (None: unsigned)."""
    key = keys.watermark(1)
    if by is not None:
        await client.hset(keys.watermark_signatures(1), mb, sign_watermark(SIGNERS[by], key, mb, signed))
    await client.hset(key, mb, signed if step is None else step)


async def _repair(
    redis_url: str, restored: bytes, forge: dict[str, bytes] | None = None, marks: dict | None = None
) -> tuple[ResumePoint, list[list[int]]]:
    """Stage 1 is replaced; the survivors report their progress and the replacement ``restored``. A
    deadline far beyond the test's own guard: a repair that waited it out would fail the test.
    ``forge``: Redis keys written over (after the reports), as a compromised worker could; ``marks``:
    watermark fields of stage 1 added (microbatch -> (signer or None, signed value, value written))."""
    client = aioredis.Redis.from_url(redis_url)
    settings = Settings()
    settings = settings.model_copy(update={"transport": settings.transport.model_copy(update={"deadline_s": 3600.0})})
    repair = Repair(settings, client)
    repair.writers = {w: (public_key(s.public_key),) for w, s in SIGNERS.items()}
    epoch = 5
    for stage, done in ((0, {10: 7, 11: 4}), (2, {10: 6, 11: 4})):
        report = StageProgress(epoch=epoch, stage=stage, worker_id=f"t{stage}", done=done)
        key = keys.progress(epoch, stage)
        await client.set(key, seal(SIGNERS[f"t{stage}"], key, report.encode()))
    for mb, step in ((10, 6), (11, 3)):  # written and signed by stage 2's holder, which keeps stage 1's replica
        await _watermark(client, "t2", mb, step)
    await client.set(keys.restored(epoch, 1), restored)
    for key, value in (forge or {}).items():
        await client.set(key, value)
    for mb, (by, signed, step) in (marks or {}).items():
        await _watermark(client, by, mb, signed, step)
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


def test_a_replaced_stage_0_gets_the_tables_stage_1_holds_its_requests_in(redis_url: str) -> None:
    """A request-scheduled pipeline whose stage 0 was replaced: stage 1's report carries each request's block
    table, and the resume point hands the tables of the requests that resume to the new stage 0 (which takes them
    over in those blocks); the request that re-runs has none."""

    async def repair() -> ResumePoint:
        client = aioredis.Redis.from_url(redis_url)
        settings = Settings()
        settings = settings.model_copy(
            update={"transport": settings.transport.model_copy(update={"deadline_s": 3600.0})}
        )
        repair = Repair(settings, client)
        repair.writers = {w: (public_key(s.public_key),) for w, s in SIGNERS.items()}
        tables = {10: (4, 5, 6), 11: (4, 7)}
        for stage, done in ((1, {10: 9, 11: 4}), (2, {10: 9, 11: 4})):
            report = StageProgress(epoch=5, stage=stage, worker_id=f"t{stage}", done=done,
                                   tables=tables if stage == 1 else {})  # fmt: skip
            key = keys.progress(5, stage)
            await client.set(key, seal(SIGNERS[f"t{stage}"], key, report.encode()))
        key = keys.watermark(0)  # stage 0's replica lives on stage 1, whose holder signs the watermarks
        await client.hset(keys.watermark_signatures(0), 10, sign_watermark(SIGNERS["t1"], key, 10, 9))
        await client.hset(key, 10, 9)
        await client.set(keys.restored(5, 0), keys.RESTORED)

        async def redispatch(mbs: list[int]) -> None:
            pass

        async with asyncio.timeout(60):
            plan = await repair.run(_topology(5), {0: "spare0"}, MBS, [], redispatch, 0.0)
        await client.aclose()
        return plan

    plan = asyncio.run(repair())
    assert plan.resume == {10: 10} and plan.rerun == (11,)  # no replica of stage 0's KV of request 11
    assert plan.tables == {10: (4, 5, 6)}


def _report(stage: int, worker_id: str, epoch: int = 5) -> bytes:
    return StageProgress(epoch=epoch, stage=stage, worker_id=worker_id, done={10: 7, 11: 4}).encode()


def _sealed(by: str, payload: bytes, key: str = keys.progress(5, 0)) -> bytes:
    return seal(SIGNERS[by], key, payload)


FORGED = {
    "not json": b"not json",
    "unsigned": _report(0, "t0"),  # a well-formed report that no key vouches for
    "malformed": _sealed("t0", b'{"v": 1, "epoch": 5}'),
    "other stage": _sealed("t0", _report(2, "t0")),  # stage 0's key holding stage 2's report
    "not the holder": _sealed("spare0", _report(0, "t0")),  # signed by a worker the topology does not name
    "older epoch": _sealed("t0", _report(0, "t0", epoch=4)),
    "moved": _sealed("t0", _report(0, "t0"), keys.progress(4, 0)),  # sealed for another key
}


@pytest.mark.parametrize("forged", FORGED.values(), ids=FORGED.keys())
def test_a_forged_or_malformed_progress_report_re_runs_every_prompt_at_once(redis_url: str, forged: bytes) -> None:
    """Resuming from a report nobody can vouch for could splice wrong tokens: every prompt re-runs, and
    the repair does not wait for a report that will never parse."""
    plan, rerun = asyncio.run(_repair(redis_url, keys.RESTORED, forge={keys.progress(5, 0): forged}))
    assert plan.resume == {} and plan.rerun == tuple(MBS) and rerun == [MBS]


def test_malformed_watermark_fields_are_skipped_and_the_rest_are_used(redis_url: str) -> None:
    marks = {"x": ("t2", "1", "1"), "12": ("t2", "y", "y"), "13": (None, "-", "-")}
    plan, rerun = asyncio.run(_repair(redis_url, keys.RESTORED, marks=marks))
    assert plan.resume == {10: 7, 11: 4} and plan.rerun == () and rerun == []


@pytest.mark.parametrize(
    "forged",
    [
        (None, 9, 9),  # unsigned
        ("spare0", 9, 9),  # signed by a worker that does not keep stage 1's replica
        ("t0", 9, 9),  # ...nor does stage 0's holder
        ("t2", 6, 9),  # the replica holder's signature of another step
    ],
    ids=["unsigned", "spare", "other stage", "other step"],
)
def test_a_forged_watermark_counts_as_no_replica(redis_url: str, forged: tuple) -> None:
    """Microbatch 11's watermark claims step 9 of stage 1's replica without its holder's signature: 11 has
    no replica of stage 1 to resume from and re-runs; 10 resumes as before."""
    plan, rerun = asyncio.run(_repair(redis_url, keys.RESTORED, marks={11: forged}))
    assert plan.resume == {10: 7} and plan.rerun == (11,) and rerun == [[11]]


def test_a_watermark_key_of_the_wrong_type_counts_as_no_watermarks(redis_url: str) -> None:
    """No replica of stage 1's cache can be vouched for: every microbatch re-runs (plan_resume)."""
    plan, rerun = asyncio.run(_repair(redis_url, keys.RESTORED, forge={keys.watermark(1): b"forged"}))
    assert plan.resume == {} and plan.rerun == tuple(MBS) and rerun == [MBS]

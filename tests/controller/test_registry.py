"""Worker registry against a real Redis: leases, pipeline assembly, spares, epochs."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import WorkerInfo, WorkerRole
from dejavu_common.partition import split_layers
from dejavu_common.settings import ControllerSettings, Mode
from dejavu_controller.registry import Registry


def test_split_layers_is_contiguous_and_balanced() -> None:
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(5, 5) == [(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError):
        split_layers(3, 4)


async def _register(
    r: aioredis.Redis, wid: str, role: WorkerRole, spare: bool = False, alive: bool = True, instance: str | None = None
) -> None:
    info = WorkerInfo(
        worker_id=wid, role=role, host="h", pid=1, instance=instance or f"{wid}-1", data_address="", spare=spare
    )
    await r.hset(keys.worker(wid), mapping={"info": info.encode(), "state": "serving", "epoch": 0})
    await r.sadd(keys.WORKERS, wid)
    if alive:
        await r.set(keys.worker_lease(wid), "1", px=5000)


def test_assembly_replacement_and_epochs(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        settings = ControllerSettings(prompt_depth=1, token_depth=2)
        reg = Registry(r, settings, n_layers=6)
        await _register(r, "p0", WorkerRole.PROMPT)
        await _register(r, "t0", WorkerRole.TOKEN)
        assert reg.assemble(await reg.workers()) is None  # token pipeline incomplete
        await _register(r, "t1", WorkerRole.TOKEN)
        await _register(r, "spare0", WorkerRole.TOKEN, spare=True)
        workers = await reg.workers()
        topo = await reg.publish(reg.assemble(workers), workers)
        assert topo.epoch == 1
        assert [(a.worker_id, a.layers) for a in topo.token_stages] == [("t0", (0, 3)), ("t1", (3, 6))]
        assert [(a.worker_id, a.layers) for a in topo.prompt_stages] == [("p0", (0, 6))]
        # t0's lease expires: the spare takes stage 0, t1 keeps stage 1, the epoch moves on.
        await r.delete(keys.worker_lease("t0"))
        workers = await reg.workers()
        assert reg.lost(workers) == ["t0"]
        topo2 = await reg.publish(reg.assemble(workers), workers)
        assert topo2.epoch == 2
        assert [a.worker_id for a in topo2.token_stages] == ["spare0", "t1"]
        assert reg.replaced(topo, topo2, ["t0"]) == {0: "spare0"}
        # t1 restarts (same id, new process instance): lost, and it takes its own stage back as a replacement.
        await _register(r, "t1", WorkerRole.TOKEN, instance="t1-2")
        workers = await reg.workers()
        assert reg.lost(workers) == ["t1"]
        topo3 = await reg.publish(reg.assemble(workers), workers)
        assert [a.worker_id for a in topo3.token_stages] == ["spare0", "t1"]
        assert reg.replaced(topo2, topo3, ["t1"]) == {1: "t1"}
        await r.aclose()

    asyncio.run(scenario())


def test_a_record_that_claims_another_worker_is_skipped(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        registry = Registry(r, ControllerSettings(prompt_depth=1, token_depth=1), n_layers=4)
        await _register(r, "t0", WorkerRole.TOKEN)
        forged = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=2, instance="x", data_address="")
        await r.hset(keys.worker("t9"), mapping={"info": forged.encode(), "state": "serving", "epoch": 0})
        await r.sadd(keys.WORKERS, "t9")
        await r.set(keys.worker_lease("t9"), "1", px=5000)
        assert set(await registry.workers()) == {"t0"}
        await r.aclose()

    asyncio.run(scenario())


def test_colocated_mode_needs_no_prompt_workers(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        reg = Registry(r, ControllerSettings(mode=Mode.COLOCATED, token_depth=2), n_layers=4)
        await _register(r, "t0", WorkerRole.TOKEN)
        await _register(r, "t1", WorkerRole.TOKEN)
        await r.hset(keys.worker("bad"), mapping={"info": b"{not json"})
        await r.sadd(keys.WORKERS, "bad")
        topo = reg.assemble(await reg.workers())
        assert topo is not None and topo.prompt_stages == () and len(topo.token_stages) == 2
        await r.aclose()

    asyncio.run(scenario())


def test_the_context_is_capped_at_the_models_own_position_limit(tmp_path) -> None:
    import json

    from dejavu_controller.model_info import context_limit

    for name, config, expected in [
        ("llama", {"max_position_embeddings": 8192}, 2048),
        ("gpt2", {"n_positions": 1024}, 1024),
        ("bloom", {}, 2048),  # ALiBi: no position limit of its own
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        assert context_limit(folder, 2048) == expected


def test_a_restarted_controller_keeps_the_spare_that_holds_a_stage(redis_url: str) -> None:
    """A spare replaced t1, then the controller restarted: the new one reads the published topology and
    assembles with the spare in stage 1 (without it, spares only replace, and it would wait for t1 for ever)."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        settings = ControllerSettings(mode=Mode.COLOCATED, token_depth=2)
        first = Registry(r, settings, n_layers=4)
        for wid, spare in (("t0", False), ("t1", False), ("spare0", True)):
            await _register(r, wid, WorkerRole.TOKEN, spare=spare)
        workers = await first.workers()
        await first.publish(first.assemble(workers), workers)
        await r.delete(keys.worker_lease("t1"))
        workers = await first.workers()
        replaced = await first.publish(first.assemble(workers), workers)
        assert [a.worker_id for a in replaced.token_stages] == ["t0", "spare0"]
        await r.srem(keys.WORKERS, "t1")  # t1 is gone for good

        restarted = Registry(r, settings, n_layers=4)
        workers = await restarted.workers()
        assert restarted.assemble(workers) is None  # without the published topology: waits for a regular worker
        assert (await restarted.seed()).epoch == replaced.epoch
        topo = restarted.assemble(workers)
        assert topo is not None and [a.worker_id for a in topo.token_stages] == ["t0", "spare0"]
        assert (await restarted.publish(topo, workers)).epoch > replaced.epoch
        assert restarted.previous is None
        await r.aclose()

    asyncio.run(scenario())


def test_a_topology_in_redis_that_does_not_decode_is_ignored(redis_url: str) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        await r.set(keys.TOPOLOGY, b"{not a topology")
        reg = Registry(r, ControllerSettings(mode=Mode.COLOCATED, token_depth=1), n_layers=4)
        assert await reg.seed() is None and reg.previous is None
        await r.delete(keys.TOPOLOGY)
        assert await reg.seed() is None
        await r.aclose()

    asyncio.run(scenario())

"""The control loop on a real Redis when a worker writes garbage where the controller reads (issue 34, 5b-c).

Every worker may write the KV byte counters (``dejavu:wm:kvbytes``) and its own registry record, lease and
KV report. Each value the controller reads from them is parsed on its own: a forged field is skipped and
logged, and failure detection and repair go on in the same control-loop iteration.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Histogram

from dejavu_common import keys
from dejavu_common.messages import TokenStep, WorkerInfo, WorkerRole
from dejavu_common.settings import Settings
from dejavu_common.signing import EntrySigner
from dejavu_controller.api.metrics import RuntimeMetrics
from dejavu_controller.backend import FinishReason, GenerationRequest, SamplingSpec
from dejavu_controller.pipeline_backend import PipelineBackend
from tests.controller.entry_writer import publish, stage_holder


def _settings() -> Settings:
    base = Settings()
    return base.model_copy(update={"controller": base.controller.model_copy(update={"token_depth": 1})})


def _metrics() -> tuple[RuntimeMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    kv = Counter("dejavu_kv_bytes_streamed", "KV bytes", labelnames=["purpose"], registry=registry)
    recovery = Histogram("dejavu_recovery_phase_seconds", "phases", labelnames=["phase"], registry=registry)
    return RuntimeMetrics(kv, recovery), registry


async def _register(r: aioredis.Redis, worker_id: str, role: WorkerRole, spare: bool = False) -> None:
    info = WorkerInfo(worker_id=worker_id, role=role, host="h", pid=1, instance=worker_id, data_address="", spare=spare)
    await r.hset(keys.worker(worker_id), mapping={"info": info.encode(), "state": "serving", "epoch": 0, "seen": 0})
    await r.sadd(keys.WORKERS, worker_id)
    await r.set(keys.worker_lease(worker_id), "1", px=60_000)


async def _forge_kv_bytes(r: aioredis.Redis) -> None:
    await r.hset(keys.KV_BYTES, mapping={"replication": "forged", "no-such-purpose": "12", "swap": "100"})


async def _forge_kv_bytes_type(r: aioredis.Redis) -> None:
    await r.delete(keys.KV_BYTES)
    await r.set(keys.KV_BYTES, "forged")


async def _forge_records(r: aioredis.Redis) -> None:
    """Records of registered ids a worker could write: a huge epoch, a non-integer one, a record that is
    not a hash, a KV report that is not a string, a state that is no state."""
    await _register(r, "t9", WorkerRole.TOKEN)
    await r.hset(keys.worker("t9"), mapping={"epoch": str(10**30), "seen": "x"})
    await r.sadd(keys.WORKERS, "t8", "t7", "t6")
    await r.set(keys.worker("t8"), "forged")
    await _register(r, "t7", WorkerRole.TOKEN)
    await r.hset(keys.worker_kv("t7"), "bytes", "1")
    await _register(r, "t6", WorkerRole.TOKEN)
    await r.hset(keys.worker("t6"), "state", "\xff-no-state")


@pytest.mark.parametrize("forge", [_forge_kv_bytes, _forge_kv_bytes_type, _forge_records])
def test_forged_worker_fields_do_not_stop_failure_detection(redis_url: str, forge) -> None:
    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        metrics, registry = _metrics()
        backend = PipelineBackend(_settings(), r, n_layers=6, metrics=metrics)
        repairs: list[dict[int, str]] = []

        async def repair_run(topology, replaced, *args, **kwargs) -> None:
            repairs.append(replaced)

        backend.repair.run = repair_run
        await _register(r, "p0", WorkerRole.PROMPT)
        await _register(r, "t0", WorkerRole.TOKEN)
        await _register(r, "s0", WorkerRole.TOKEN, spare=True)
        await backend._control_once()  # publishes the first pipeline: p0, t0
        first = backend.registry.topology
        assert first is not None and [a.worker_id for a in first.token_stages] == ["t0"]

        await forge(r)
        await r.delete(keys.worker_lease("t0"))  # t0 fails
        await backend._control_once()
        topology = backend.registry.topology
        assert topology is not None and topology.epoch > first.epoch
        assert [a.worker_id for a in topology.token_stages] == ["s0"]
        await backend._repair_task
        assert repairs == [{0: "s0"}]
        swap = registry.get_sample_value("dejavu_kv_bytes_streamed_total", {"purpose": "swap"})
        assert swap == (100 if forge is _forge_kv_bytes else None)  # the well-formed counter still counts
        # What would make every worker's HINCRBY fail is gone; the well-formed counter stays.
        assert await r.hgetall(keys.KV_BYTES) == ({b"swap": b"100"} if forge is _forge_kv_bytes else {})
        await r.hincrby(keys.KV_BYTES, "replication", 4096)  # as a worker's heartbeat does
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_the_relay_takes_token_entries_only_from_stage_holders_under_their_own_keys(redis_url: str) -> None:
    """Any worker's Redis user may append to any token stream: an entry is relayed to its client only when
    a stage holder of the topology signed it with its own key (dejavu_common.signing)."""

    async def scenario() -> None:
        r = aioredis.Redis.from_url(redis_url)
        backend = PipelineBackend(Settings(), r, n_layers=6)
        backend._ready = True
        events = await backend.generate(GenerationRequest("r", (1, 2, 3), SamplingSpec(max_tokens=1, temperature=0)))
        [mb] = backend.scheduler.form(now=1e9)
        await backend._dispatch([mb])
        holder = await stage_holder(r, backend, "t0")
        spare = EntrySigner("s0")  # registered, but holds no stage
        info = WorkerInfo(worker_id="s0", role=WorkerRole.TOKEN, host="h", pid=2, instance="s0-1", data_address="",
                          spare=True, entry_key=spare.public_key)  # fmt: skip
        await r.hset(keys.worker("s0"), mapping={"info": info.encode(), "state": "idle", "epoch": 0})
        await r.sadd(keys.WORKERS, "s0")
        backend._workers = await backend.registry.workers()
        stream, mb_id = keys.tokens(mb.spec.mb_id), mb.spec.mb_id
        forged = TokenStep(mb_id=mb_id, step=0, tokens=(66,), finished=(FinishReason.STOP,)).encode()
        as_holder = spare.entry(stream, "step", forged)
        as_holder["by"] = b"t0"  # the spare's signature under the holder's name
        for fields in (spare.entry(stream, "step", forged), as_holder, {"step": forged}):
            await r.xadd(stream, fields)
        await backend._relay_once()
        assert not backend.scheduler.active[mb_id].requests[0].output_ids  # nothing forged reached the client
        await publish(r, holder, TokenStep(mb_id=mb_id, step=0, tokens=(5,), finished=(FinishReason.LENGTH,)))
        await backend._relay_once()
        delivered = [ev async for ev in events]
        assert [t for ev in delivered for t in ev.token_ids] == [5]
        assert delivered[-1].finish_reason is FinishReason.LENGTH
        await r.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))

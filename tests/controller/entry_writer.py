"""A token-stream writer the controller accepts, for tests that play a worker: a registered worker with an
entry key (dejavu_common.signing), holding token stage 0 of the backend's topology."""

from __future__ import annotations

import redis.asyncio as aioredis

from dejavu_common import keys
from dejavu_common.messages import StageAssignment, TokenStep, Topology, WorkerInfo, WorkerRole
from dejavu_common.signing import EntrySigner
from dejavu_controller.pipeline_backend import PipelineBackend


async def stage_holder(r: aioredis.Redis, backend: PipelineBackend, worker_id: str = "t0") -> EntrySigner:
    """Register ``worker_id`` (with a fresh entry key) and make it the only token stage of a topology the
    backend holds, as after a publish; returns its signer."""
    signer = EntrySigner(worker_id)
    info = WorkerInfo(worker_id=worker_id, role=WorkerRole.TOKEN, host="h", pid=1, instance=f"{worker_id}-1",
                      data_address="", entry_key=signer.public_key)  # fmt: skip
    await r.hset(keys.worker(worker_id), mapping={"info": info.encode(), "state": "serving", "epoch": 1})
    await r.sadd(keys.WORKERS, worker_id)
    await r.set(keys.worker_lease(worker_id), "1", px=60_000)
    n_layers = backend.registry.n_layers
    backend.registry.topology = Topology(
        epoch=1,
        mode="colocated",
        n_layers=n_layers,
        token_stages=(StageAssignment(worker_id=worker_id, stage=0, layers=(0, n_layers)),),
        prompt_microbatch=1,
        token_microbatch=1,
    )
    backend._workers = await backend.registry.workers()
    return signer


async def publish(r: aioredis.Redis, signer: EntrySigner, step: TokenStep) -> None:
    """Append ``step`` to its microbatch's token stream, signed by ``signer``."""
    await r.xadd(keys.tokens(step.mb_id), signer.entry(keys.tokens(step.mb_id), "step", step.encode()))

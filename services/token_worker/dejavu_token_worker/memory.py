"""The host memory a token stage gives its KV: the paged pool, the host copies of preempted caches and the replicas
of its predecessor, each bounded by its setting or by a share of the memory available when the stage loads."""

from __future__ import annotations

from dejavu_common.settings import Settings
from dejavu_worker.memory import available_memory_bytes
from dejavulib.paged import BlockGeometry


def pool_blocks(settings: Settings, geometry: BlockGeometry) -> int:
    """Blocks of ``geometry`` in the paged pool: ``engine.kv_pool_bytes``, or 60% of the memory available now."""
    budget = settings.engine.kv_pool_bytes
    if budget is None:
        budget = int(0.6 * available_memory_bytes())
    return max(1, budget // geometry.bytes_per_block)


def host_bytes(settings: Settings) -> int:
    """Bound on the preempted host copies: ``engine.kv_host_bytes``, or 10% of the memory available now."""
    budget = settings.engine.kv_host_bytes
    return budget if budget is not None else int(0.1 * available_memory_bytes())


def replica_bytes(settings: Settings) -> int:
    """Bound on the replica pool: ``recovery.replica_memory_bytes``, or 30% of the memory available now."""
    budget = settings.recovery.replica_memory_bytes
    return budget if budget is not None else int(0.3 * available_memory_bytes())

"""Registry records of test data-plane endpoints: what a worker publishes at its start, for its peers."""

from __future__ import annotations

import base64

import redis

from dejavu_common import keys
from dejavu_common.messages import WorkerInfo, WorkerRole
from dejavu_worker.endpoint import DataEndpoint


def register(client: redis.Redis, endpoint: DataEndpoint, instance: str = "i") -> WorkerInfo:
    """Publish ``endpoint``'s registry record (its address and data-plane key), as a worker's start does."""
    info = WorkerInfo(
        worker_id=endpoint.worker_id,
        role=WorkerRole.TOKEN,
        host="h",
        pid=1,
        instance=instance,
        data_address=base64.b64encode(endpoint.address).decode(),
        data_key=endpoint.data_key,
    )
    client.hset(keys.worker(endpoint.worker_id), mapping={"info": info.encode()})
    client.sadd(keys.WORKERS, endpoint.worker_id)
    return info

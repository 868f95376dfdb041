"""A token worker serving the same epoch again after an error it outlives (the lifecycle's retry) continues
that epoch: its recovery does not run again (run again, a fresh pipeline's would free every cache and forget
every announcement, and a repaired one's would drop every microbatch admitted since), and stage 0 runs the
same driver again. Real Redis; the scripted pipeline of the driver's tests stands in for the engine and the
data plane."""

from __future__ import annotations

import itertools
import time

import pytest
import redis

from dejavu_common import keys
from dejavu_common.messages import StageAssignment, Topology
from dejavu_common.settings import Settings
from dejavu_token_worker import recovery
from dejavu_token_worker.worker import TokenWorker

from .test_driver import Publishing, Ready, _published


class Stage0Ready(Ready):
    """The READY stream's view as the worker drives it: announcements popped before a fresh start (which
    resets the view) are gone with it; those not made yet still come."""

    def serving(self, epoch: int) -> None:
        pass

    def reset(self) -> None:
        pass


class Endpoint:
    """A data endpoint with no peers and no prompt KV on the way."""

    def set_epoch(self, epoch: int) -> None:
        pass

    def recv_message(self, channel, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def connect_all(self, client, peers) -> None:
        assert peers == []


def test_an_epoch_served_again_after_a_redis_error_is_continued_not_recovered_again(redis_url, monkeypatch) -> None:
    client = redis.Redis.from_url(redis_url)
    client.delete(keys.RECOVERY)  # a fresh pipeline: no repair order for this epoch
    rows = {1: 1, 2: 2, 3: 1}
    p = Publishing(client, 1, dict.fromkeys(rows, 6), rows)
    p.breaks = {3: 0}  # Redis refuses the tokens of the 4th pass (OOM at maxmemory)
    settings = Settings(recovery={"replication": "off"})
    worker = TokenWorker(settings, "t0")
    worker.redis, worker.endpoint, worker.runner = client, Endpoint(), p
    worker.ready = Stage0Ready(p, [(1, 0), (2, 0), (3, 5)])
    recoveries = []
    monkeypatch.setattr(recovery, "recovery_order", lambda *a: recoveries.append(a) or None)
    topology = Topology(epoch=4, mode="disaggregated", n_layers=2, prompt_microbatch=4, token_microbatch=4,
                        token_stages=(StageAssignment(worker_id="t0", stage=0, layers=(0, 2)),))  # fmt: skip
    rounds = itertools.count()

    def done() -> bool:  # the driver's stop: every microbatch published its last step (or a round cap)
        return all(_published(client, mb)[-1:] == [6] for mb in rows) or next(rounds) > 5_000

    worker.epoch_changed = done  # type: ignore[method-assign]

    with pytest.raises(redis.ResponseError):
        worker.serve(topology)
    assert len(recoveries) == 1 and p.broken == [(1, 2)]
    worker.serve(topology)  # what the lifecycle does after its pause: the same epoch again
    assert len(recoveries) == 1  # no second recovery
    assert p.failed == [] and sorted(p.released) == [1, 2, 3]
    for mb in rows:
        assert _published(client, mb) == [1, 2, 3, 4, 5, 6], mb

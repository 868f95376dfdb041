"""A payload corrupted on the way never ends a token worker's receiving threads (real Redis, DejaVuLib's
in-process transport): the data endpoint drops and counts it, the receiver keeps running, and the next
good message is processed. What the dropped message carried is lost, and its consumer's deadline covers
that (prompt KV that never completes fails its microbatch; a replica step past a hole is not served)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
import torch

from dejavu_common import fatal, keys
from dejavu_common.fatal import guarded
from dejavu_common.messages import MicrobatchSpec, RowSpec, SamplingSpec
from dejavu_common.settings import Replication, TransportSettings
from dejavu_token_worker.prompt_kv import cohort_placer, receive_prompt_kv
from dejavu_token_worker.replication import ReplicaStore
from dejavu_worker.endpoint import DataEndpoint
from dejavulib.handle import Handle
from dejavulib.header import Channel, Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout
from tests.dejavulib.fake_transport import FakeTransport
from tests.worker.records import register


class FlakyLink(FakeTransport):
    """Flips one payload byte of the next ``corrupt`` messages it sends, after they were sealed (as a bad
    link would): the receiver's payload MAC check fails."""

    def __init__(self, self_id: str) -> None:
        super().__init__(self_id)
        self.corrupt = 0

    def send_message(self, peer_id: str, header: bytes, payload: np.ndarray) -> Handle:
        if self.corrupt > 0 and payload.nbytes:
            self.corrupt -= 1
            payload = payload.copy()
            payload[payload.nbytes // 2] ^= 0x40
        return super().send_message(peer_id, header, payload)


def _wait(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """The exit codes the fatal-thread handler would have ended the process with."""
    codes: list[int] = []
    monkeypatch.setattr(fatal, "_exit", codes.append)
    return codes


@pytest.fixture
def link(redis_url) -> Iterator[tuple[DataEndpoint, DataEndpoint, FlakyLink, redis.Redis]]:
    """Worker t0's endpoint (sending over a flaky link) connected to worker t1's, as workers connect:
    through their registry records."""
    client = redis.Redis.from_url(redis_url)
    settings = TransportSettings()
    flaky = FlakyLink("t0")
    sender = DataEndpoint(settings, "t0", transport=flaky)
    receiver = DataEndpoint(settings, "t1", transport=FakeTransport("t1"), registry=client)
    register(client, sender)
    register(client, receiver)
    sender.connect_all(client, ["t1"])
    yield sender, receiver, flaky, client
    sender.close()
    receiver.close()
    client.close()


def _spec(client: redis.Redis, mb: int) -> None:
    row = RowSpec(request_id=f"r{mb}", prompt_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=100, seed=0))
    client.set(keys.microbatch(mb), MicrobatchSpec(mb_id=mb, rows=(row,), prompt_len=3, max_len=200).encode())


def _cache(fill: float) -> KVCache:
    """Stage 1's cache (layers 2 and 3) of a one-row microbatch: its 3 prompt positions hold ``fill``."""
    cache = KVCache.allocate(KVLayout(2, 1, 2, 3, 8, "float32", 2))
    cache.k.fill_(fill)
    cache.v.fill_(fill)
    return cache


def test_a_corrupt_replica_message_is_dropped_and_the_receiver_serves_the_next(link, tmp_path, exits) -> None:
    sender, receiver, flaky, client = link
    for mb in (5, 6):
        _spec(client, mb)
    store = ReplicaStore(client, receiver, 1, (2, 4), (2, 8, "float32"), Replication.MEMORY, tmp_path, 1.0,
                         worker_id="t1")  # fmt: skip
    stop = threading.Event()
    receive = guarded("replica receiver", store.run, retry_on=(redis.RedisError,))
    thread = threading.Thread(target=receive, args=(stop,))
    thread.start()
    try:
        flaky.corrupt = 1
        for mb in (5, 6):  # microbatch 5's prompt replica is corrupted on the way, 6's is not
            cache = _cache(float(mb))
            sender.send_region("t1", Header(Channel.KV_REPLICA, microbatch=mb, step=0), cache, cache.whole(mb))
        _wait(lambda: client.hget(keys.watermark(1), 6) == b"0")
        assert thread.is_alive() and exits == []
        assert receiver.corrupt[Channel.KV_REPLICA.name] == 1
        assert store.microbatches() == {6}  # 5 was never replicated: a failure of stage 1 re-runs its prompt
        assert client.hget(keys.watermark(1), 5) is None
        [(mb, cache, step)] = store.restorable([5, 6])
        assert (mb, step) == (6, 0) and torch.equal(cache.dense(3).k, torch.full((2, 1, 2, 3, 8), 6.0))
    finally:
        stop.set()
        thread.join(5)
        store.close()
    assert not thread.is_alive() and exits == []


class Cells:
    """A stage's microbatch state as the prompt KV receiver fills it: which regions arrived."""

    def __init__(self) -> None:
        self.placed: list[tuple[int, tuple[int, int]]] = []

    def place(self, region, message) -> None:
        self.placed.append((region.microbatch, region.positions))

    def add_prompt_cells(self, layers, rows) -> None:
        pass


class Runner:
    def __init__(self) -> None:
        self.states: dict[int, Cells] = {}

    def state(self, mb: int) -> Cells:
        return self.states.setdefault(mb, Cells())


def test_a_corrupt_prompt_kv_message_is_dropped_and_the_receiver_serves_the_next(link, exits) -> None:
    sender, receiver, flaky, _client = link
    runner = Runner()
    stop, recovered = threading.Event(), threading.Event()
    recovered.set()
    receive = guarded("prompt KV receiver", receive_prompt_kv, retry_on=(redis.RedisError,))
    thread = threading.Thread(target=receive, args=(receiver, stop, recovered, 1, cohort_placer(runner, 1)))
    thread.start()
    try:
        flaky.corrupt = 1
        for mb in (5, 6):
            cache = _cache(float(mb))
            header = Header(Channel.KV_PROMPT, microbatch=mb, user=1)  # for token stage 1
            sender.send_region("t1", header, cache, cache.whole(mb))
        _wait(lambda: 6 in runner.states)
        assert thread.is_alive() and exits == []
        assert receiver.corrupt[Channel.KV_PROMPT.name] == 1
        assert set(runner.states) == {6} and runner.states[6].placed == [(6, (0, 3))]
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive() and exits == []

"""A worker's data plane accepts payloads up to the deployment's largest legitimate message, not 4 GiB
(issue 34, 5e): the bound comes from the topology, the shared settings and the checkpoint, so prompt and
token workers compute the same one; the largest real messages fit under it, and a peer's larger payload is
dropped unread (DejaVuLib's in-process transport, real Redis for the registry records)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch

from dejavu_common.messages import StageAssignment, Topology
from dejavu_common.partition import split_layers
from dejavu_common.settings import Settings, TransportSettings
from dejavu_engine.families import family_for
from dejavu_engine.family import ModelSpec
from dejavu_engine.weights import load_config
from dejavu_worker.dataplane import Kind, StageMessage
from dejavu_worker.endpoint import DataEndpoint, largest_message
from dejavulib.header import Channel
from dejavulib.layout import KVLayout
from tests.dejavulib.fake_transport import FakeTransport
from tests.worker.records import register


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    """The default model's shape (the prepared checkpoint)."""
    return family_for(load_config(Settings().model.folder)).spec


def _stages(worker: str, n_layers: int, depth: int) -> tuple[StageAssignment, ...]:
    ranges = split_layers(n_layers, depth)
    return tuple(StageAssignment(worker_id=f"{worker}{i}", stage=i, layers=r) for i, r in enumerate(ranges))


def _topology(spec: ModelSpec, prompt_depth: int = 2, token_depth: int = 3) -> Topology:
    return Topology(
        epoch=1,
        mode="disaggregated",
        n_layers=spec.num_layers,
        prompt_stages=_stages("p", spec.num_layers, prompt_depth),
        token_stages=_stages("t", spec.num_layers, token_depth),
        prompt_microbatch=4,
        token_microbatch=8,
    )


def test_the_bound_fits_the_largest_kv_region_and_prefill_pass_and_is_far_below_4_gib(spec: ModelSpec) -> None:
    settings = Settings()
    topology = _topology(spec)
    bound = largest_message(topology, settings, spec)
    positions, rows = settings.engine.max_context, 8
    # K and V of a whole token microbatch at the full context, over the largest stage of either pipeline
    # (a restore or a replica of it).
    widest = max(b - a for a, b in (s.layers for s in (*topology.prompt_stages, *topology.token_stages)))
    layout = KVLayout(widest, rows, spec.num_kv_heads, positions, spec.head_dim, settings.model.dtype)
    assert 2 * layout.bytes_per_tensor <= bound
    # A prefill pass of that microbatch (float32 hidden states), as a stage sends it, meta included.
    members = ((7, 0, tuple(range(rows))),)
    hidden = torch.zeros(rows, positions, spec.hidden_size)
    prefill = StageMessage(Kind.PREFILL, 7, 0, hidden, members=members).encode()
    assert len(prefill) <= bound
    # ...and nothing near what a peer could send before (4 GiB).
    assert bound < max(2 * layout.bytes_per_tensor, len(prefill)) * 2
    assert bound < settings.transport.max_message_bytes // 8


def test_the_bound_follows_the_stage_geometry(spec: ModelSpec) -> None:
    """Deeper pipelines hold fewer layers per stage, so their largest KV region, and the bound, shrink; it
    never drops below a prefill pass of the largest microbatch."""
    settings = Settings()
    shallow = largest_message(_topology(spec, prompt_depth=1, token_depth=1), settings, spec)
    deep = largest_message(_topology(spec, prompt_depth=6, token_depth=6), settings, spec)
    prefill = 8 * settings.engine.max_context * spec.hidden_size * 4
    assert prefill < deep < shallow


def test_the_operators_limit_stays_the_upper_bound(spec: ModelSpec) -> None:
    settings = Settings()
    limit = TransportSettings(max_message_bytes=1 << 20)
    endpoint = DataEndpoint(limit, "t0", transport=FakeTransport("t0"))
    try:
        endpoint.bound_messages(largest_message(_topology(spec), settings, spec))
        assert endpoint.max_message_bytes == 1 << 20
    finally:
        endpoint.close()


@pytest.fixture
def pair(redis_url: str) -> Iterator[tuple[DataEndpoint, DataEndpoint]]:
    """Worker t0's endpoint, connected to worker t1's through t1's registry record."""
    client = redis.Redis.from_url(redis_url)
    settings = TransportSettings()
    sender = DataEndpoint(settings, "t0", transport=FakeTransport("t0"))
    receiver = DataEndpoint(settings, "t1", transport=FakeTransport("t1"), registry=client)
    register(client, sender)
    register(client, receiver)
    sender.connect_all(client, ["t1"])
    yield sender, receiver
    sender.close()
    receiver.close()
    client.close()


def test_a_peer_payload_over_the_bound_is_dropped_unread_and_the_next_one_arrives(pair) -> None:
    sender, receiver = pair
    receiver.bound_messages(1 << 20)
    assert receiver.max_message_bytes == 1 << 20
    sender.send("t1", Channel.ACTIVATION, bytes(8 << 20))  # a peer with the old 4 GiB bound may send it
    sender.send("t1", Channel.ACTIVATION, b"\x01" * (1 << 20))  # exactly at the bound
    got = receiver.recv(Channel.ACTIVATION, 10.0)
    assert got is not None and np.frombuffer(got, dtype=np.uint8).min() == 1 and got.nbytes == 1 << 20
    assert receiver.stats["rejected_size"] == 1
    assert receiver.recv(Channel.ACTIVATION, 0.2) is None

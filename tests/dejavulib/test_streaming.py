"""stream_out/stream_in between prompt and token pipelines of different depths, batch sizes and padded
lengths, compared cell by cell; layer-by-layer streaming overlapping compute."""

from __future__ import annotations

import threading

import pytest
import torch

from dejavu_common.partition import split_layers
from dejavulib.endpoint import Endpoint
from dejavulib.errors import IntegrityError, ProtocolError
from dejavulib.header import Channel, Header
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout, Region, Which
from dejavulib.streamer import Streamer
from dejavulib.streaming import LayerStreamer, region_of, stream_in, stream_out
from dejavulib.topology import Piece, plan_pieces

from .fake_transport import FakeTransport

N_LAYERS, HEADS, HEAD_DIM, SECRET = 6, 3, 4, "s"


def _reference(request: tuple[int, int], layer: int, position: int, which: Which) -> float:
    """A value unique to each cell of a request (its token microbatch and row), so any misplaced byte shows."""
    mb, row = request
    return float(mb * 100_000 + row * 10_000 + layer * 100 + position) + (0.5 if which == Which.V else 0.0)


def _prompt_cache(layers: tuple[int, int], rows: list[tuple[int, int, int]], padded: int) -> KVCache:
    """A prompt stage's cache of a batch of ``rows`` (token microbatch, row, prompt length), left padded."""
    lo, hi = layers
    cache = KVCache.allocate(KVLayout(hi - lo, len(rows), HEADS, padded, HEAD_DIM, first_layer=lo))
    for which in (Which.K, Which.V):
        t = cache.tensor(which)
        for i, (mb, row, length) in enumerate(rows):
            for layer in range(lo, hi):
                for p in range(length):
                    t[layer - lo, i, :, padded - length + p, :] = _reference((mb, row), layer, p, which)
    return cache


@pytest.mark.parametrize(("dp", "dt"), [(1, 2), (2, 3), (3, 2), (2, 2)])
def test_prompt_batches_land_in_the_token_stages_caches(dp: int, dt: int) -> None:
    # Two token microbatches: 0 (4 rows, prompts up to 9) and 1 (3 rows, prompts up to 5).
    lengths = {0: [9, 4, 7, 2], 1: [5, 5, 3]}
    dst_padded = {mb: max(ls) for mb, ls in lengths.items()}
    # Two prompt batches: the first carries mb 0's rows 0-2, the second mb 0's row 3 and all of mb 1.
    batches = [[(0, (0, 3))], [(0, (3, 4)), (1, (0, 3))]]
    src_stages, dst_stages = split_layers(N_LAYERS, dp), split_layers(N_LAYERS, dt)
    senders = [Endpoint(FakeTransport(f"p{s}"), SECRET) for s in range(dp)]
    receivers = [Endpoint(FakeTransport(f"t{d}"), SECRET) for d in range(dt)]
    for s in senders:
        for d, r in enumerate(receivers):
            s.connect(f"t{d}", r.address)
    peers = {d: f"t{d}" for d in range(dt)}
    sent = 0
    for s, endpoint in enumerate(senders):
        streamer = Streamer(endpoint, max_inflight_bytes=1 << 20)
        for batch in batches:
            rows = [(mb, r, lengths[mb][r]) for mb, (r0, r1) in batch for r in range(r0, r1)]
            padded = max(length for _, _, length in rows)
            pieces = [Piece(mb, rs, max(lengths[mb][r] for r in range(*rs)), dst_padded[mb]) for mb, rs in batch]
            transfers = plan_pieces(pieces, padded, tuple(src_stages[s]), [tuple(r) for r in dst_stages])
            for h in stream_out(streamer, _prompt_cache(tuple(src_stages[s]), rows, padded), transfers, peers, 5):
                h.wait()
                sent += 1
        streamer.close()

    received = 0
    for d, endpoint in enumerate(receivers):
        lo, hi = dst_stages[d]
        caches = {
            mb: KVCache.allocate(KVLayout(hi - lo, len(ls), HEADS, dst_padded[mb], HEAD_DIM, first_layer=lo))
            for mb, ls in lengths.items()
        }
        while endpoint.pending(Channel.KV_PROMPT):
            message = endpoint.recv(Channel.KV_PROMPT, 1)
            assert message.header.user == d
            region = stream_in(caches[region_of(message.header).microbatch], message)
            assert region.layers[0] >= lo and region.layers[1] <= hi
            received += 1
        for mb, cache in caches.items():
            for which in (Which.K, Which.V):
                for layer in range(lo, hi):
                    for row, length in enumerate(lengths[mb]):
                        got = cache.tensor(which)[layer - lo, row, 0, :, 0]
                        want = torch.zeros(dst_padded[mb])
                        pad = dst_padded[mb] - length
                        want[pad:] = torch.tensor([_reference((mb, row), layer, p, which) for p in range(length)])
                        assert torch.equal(got, want), f"stage {d} mb {mb} {which.name} layer {layer} row {row}"
    assert received == sent


def test_stream_in_refuses_a_payload_that_is_not_its_region() -> None:
    layout = KVLayout(2, 2, HEADS, 8, HEAD_DIM)
    sender, receiver = Endpoint(FakeTransport("a"), SECRET), Endpoint(FakeTransport("b"), SECRET)
    sender.connect("b", receiver.address)
    cache = KVCache.allocate(layout)
    # The header claims two rows, the payload holds one row's bytes.
    region = layout.region(rows=(0, 1), positions=(0, 4))
    packed = cache.pack(region, torch.empty(region.nbytes(layout), dtype=torch.uint8))
    header = Header(Channel.KV_REPLICA, which=int(Which.KV), layers=(0, 2), rows=(0, 2), positions=(0, 4))
    sender.send("b", header, packed.reshape(-1)).wait(5)
    with pytest.raises(IntegrityError):
        stream_in(cache, receiver.recv(Channel.KV_REPLICA, 5))
    sender.send("b", Header(Channel.KV_REPLICA), b"marker").wait(5)
    with pytest.raises(ProtocolError):
        region_of(receiver.recv(Channel.KV_REPLICA, 5).header)


def test_layer_by_layer_streaming_overlaps_compute() -> None:
    """Each layer's KV reaches the receiver, in layer order, while later layers are still computing."""
    length = 16
    layout = KVLayout(layers=8, batch=2, kv_heads=HEADS, max_len=length, head_dim=HEAD_DIM)
    transfers = plan_pieces([Piece(0, (0, 2), length, length)], length, (0, 8), [(0, 8)])
    sender, receiver = Endpoint(FakeTransport("p0"), SECRET), Endpoint(FakeTransport("t0"), SECRET)
    sender.connect("t0", receiver.address)
    cache, received = KVCache.allocate(layout), KVCache.allocate(layout)
    first_layer_arrived = threading.Event()
    arrivals: list[tuple[int, int]] = []  # (layer, layers computed by the sender when it arrived)
    computed = [0]

    def receive() -> None:
        for _ in range(layout.layers):
            m = receiver.recv(Channel.KV_PROMPT, 10)
            arrivals.append((m.header.layers[0], computed[0]))
            first_layer_arrived.set()
            h = m.header
            assert region_of(h) == Region(h.microbatch, h.layers, h.rows, h.positions, Which(h.which))
            stream_in(received, m)

    thread = threading.Thread(target=receive)
    thread.start()
    streamer = Streamer(sender, max_inflight_bytes=1 << 20)
    hook = LayerStreamer(streamer, cache, transfers, {0: "t0"}, deadline_s=5)
    x = torch.randn(64, 64)
    for layer in range(layout.layers):
        if layer == layout.layers - 1:  # the last layer computes only once the first one has been delivered
            assert first_layer_arrived.wait(10)
        for _ in range(20):  # simulated compute: a real matmul workload writing this layer's K and V
            x = torch.tanh(x @ x) * 0.5
        cache.k[layer].copy_(x.reshape(-1)[: cache.k[layer].numel()].view_as(cache.k[layer]))
        cache.v[layer].copy_(-cache.k[layer])
        computed[0] = layer + 1
        hook.on_layer_done(layer)
    hook.wait(10)
    thread.join(10)
    streamer.close()
    assert [layer for layer, _ in arrivals] == list(range(layout.layers))
    assert arrivals[0][1] < layout.layers, "layer 0 must arrive before the last layer is computed"
    assert torch.equal(received.k, cache.k) and torch.equal(received.v, cache.v)
